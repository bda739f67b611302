"""Do the families' in-model host deltas add up to the set's? Offline, over committed runs.

The host-delta stage (`pipeline.host_delta`) measures each family patched alone, as a share of
the unpatched pass's host time. The paired whole-model timing records both passes' host time
(time until the forward returns) with every kept family patched together. This sets the sum of
the kept families' shares (each times its calls per pass, as measured alone: where rmsnorm and
add_rmsnorm are both kept, the norms add_rmsnorm takes over are counted twice, so the sum is if
anything too high) against the set's measured share.

Where the folder has its trace, each row is also re-projected (replay, the set that shipped,
from the frozen inputs as `reproject.py` does) twice: with the families' deltas, and with the
set's measured saving instead, its difference from the families' sum spread evenly over the
set's kernel calls. The second uses the timing's own host readings, so it is not a projection
the pipeline could freeze; it shows how much of the error the host saving explains.

    python benchmarks/host_share_check.py OUT.json [RESULTS_DIR ...]

Without folders it reads every `benchmarks/results/optimize-*` that recorded both.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path


def rows_of(results: Path) -> list[dict]:
    from pipeline.host_delta import summed_share

    try:
        proj = json.loads((results / "projection.json").read_text())
        integ = json.loads((results / "integration.json").read_text())
    except (OSError, ValueError):
        return []
    out = []
    for key, iw in (integ.get("workloads") or {}).items():
        comb, kept = iw.get("combined") or {}, iw.get("kept") or []
        alone = (proj["workloads"].get(key) or {}).get("host_in_model") or {}
        windows = summed_share(alone, kept)
        if not kept or not comb.get("host_b_ms") or windows is None:
            continue
        before, after = (statistics.median(comb[k]) for k in ("host_a_ms", "host_b_ms"))
        # per pair, since the host's speed moves between pairs (a ratio of the medians mixes
        # pairs at different speeds: 23.9 % against 28.6 % per pair on one run)
        per_pair = statistics.median((a - b) / a for a, b in zip(comb["host_a_ms"],
                                                                 comb["host_b_ms"]))
        out.append({"run": results.name, "workload": key, "kept": kept,
                    "measured": 1 / comb["estimate"], "host_ms": [before, after],
                    "set_share": per_pair, "sum_of_windows": windows,
                    "sum_of_passes": summed_share(alone, kept, "pass_share_per_call")})
    if out and (results / "trace").is_dir():
        _replays(results, out)
    return out


def _replays(results: Path, rows: list[dict]) -> None:
    import tempfile

    from reproject import unpack_run

    from pipeline.optimize import host_of, project_set

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        proj, _, ranking = unpack_run(results, run)
        for r in rows:
            key, kept = r["workload"], r["kept"]
            alone = proj["workloads"][key]["host_in_model"]
            calls = sum(alone[f]["calls_per_pass"] for f in kept)
            extra = (r["set_share"] - r["sum_of_windows"]) * ranking[key]["enqueue_ms"] * 1e3
            host = host_of(proj, key)
            with_set = {f: v + extra / calls if f in kept else v for f, v in host.items()}
            r["replay"], r["replay_with_set_saving"] = (
                project_set(run, ranking[key], proj["kernel_speedups"], h, True,
                            only=kept)["replay"] for h in (host, with_set))


def main() -> None:
    from reproject import out_and_folders

    out, folders = out_and_folders(__doc__)
    rows = [r for f in folders for r in rows_of(f)]
    for r in rows:
        replays = (f"  replay {r['replay'] / r['measured'] - 1:+6.1%}, with the set's saving "
                   f"{r['replay_with_set_saving'] / r['measured'] - 1:+6.1%}"
                   if r.get("replay") else "")
        print(f"{r['run']:48} {r['workload']:22} set {r['set_share']:6.1%}  "
              f"windows {r['sum_of_windows']:6.1%}  passes {r['sum_of_passes']:6.1%}" + replays)
    summary = {}
    for batch in ("b1", "b8"):
        got = [r for r in rows if f"-{batch}-" in r["run"] and r.get("replay")]
        for name in ("replay", "replay_with_set_saving"):
            errs = [abs(r[name] / r["measured"] - 1) for r in got]
            if errs:
                summary[f"{batch} {name}"] = {
                    "rows": len(errs), "mean_error": statistics.mean(errs),
                    "max_error": max(errs), "within_5pct": sum(e <= 0.05 for e in errs)}
    print(json.dumps(summary, indent=1))
    out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
