"""Do the families' in-model host deltas add up to the set's? Offline, over committed runs.

The host-delta stage (`pipeline.stages.host`) measures each family patched alone, as a share of
the unpatched pass's host time. The paired whole-model timing records both passes' host time
(time until the forward returns) with every kept family patched together. This sets the sum of
the kept families' shares (each times its calls per pass, as measured alone: where rmsnorm and
add_rmsnorm are both kept, the norms add_rmsnorm takes over are counted twice, so the sum is if
anything too high) against the set's measured share.

Where the folder has its trace, each row is also re-projected (replay, the set that shipped,
from the frozen inputs as `reproject.py` does): with the families' deltas alone; with the
set's saving from the timing instead, its difference from the families' sum spread evenly over
the set's kernel calls (the timing's own host readings, so not a projection the pipeline could
freeze: it shows how much of the error the host saving explains); and, for runs that measured
the set before integration (`host_delta.set_host_share`), with that reading spread the same
way, which is what the pipeline now projects.

    python benchmarks/probes/host_share_check.py OUT.json [RESULTS_DIR ...]

Without folders it reads every `benchmarks/results/optimize-*` that recorded both.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # benchmarks/ (reproject)


def rows_of(results: Path) -> list[dict]:
    from pipeline.projection.host import summed_share

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

    from pipeline.projection.host import host_of, spread_set_share
    from pipeline.projection.workload import project_set

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        proj, _, ranking = unpack_run(results, run)
        for r in rows:
            key, kept = r["workload"], r["kept"]
            pw, enqueue = proj["workloads"][key], ranking[key]["enqueue_ms"]
            alone, before = pw["host_in_model"], pw.get("host_set") or {}
            # the families' own deltas: runs since run 15 froze them with the set's extra
            # saving added (`spread_set_share`), which is taken off again here
            spread = before.get("extra_us_per_call") or 0.0
            host = {f: v - spread if f in before.get("families", []) else v
                    for f, v in host_of(proj, key).items()}
            timing = {**before, "families": kept, "share": r["set_share"]}
            hosts = {"replay": host,
                     "replay_with_set_saving": spread_set_share(host, alone, timing, enqueue)[0]}
            if before.get("share") is not None:
                r["set_share_before"] = before["share"]
                hosts["replay_with_set_before"] = spread_set_share(host, alone, before,
                                                                   enqueue)[0]
            for name, h in hosts.items():
                r[name] = project_set(run, ranking[key], proj["kernel_speedups"], h, True,
                                      only=kept)["replay"]


def main() -> None:
    from reproject import out_and_folders

    out, folders = out_and_folders(__doc__)
    rows = [r for f in folders for r in rows_of(f)]
    for r in rows:
        replays = (f"  replay {r['replay'] / r['measured'] - 1:+6.1%}, with the set's saving "
                   f"{r['replay_with_set_saving'] / r['measured'] - 1:+6.1%}"
                   if r.get("replay") else "")
        if r.get("replay_with_set_before"):
            replays += (f", measured before {r['set_share_before']:6.1%}: "
                        f"{r['replay_with_set_before'] / r['measured'] - 1:+6.1%}")
        print(f"{r['run']:48} {r['workload']:22} set {r['set_share']:6.1%}  "
              f"windows {r['sum_of_windows']:6.1%}  passes {r['sum_of_passes']:6.1%}" + replays)
    summary = {}
    for batch in ("b1", "b8"):
        got = [r for r in rows if f"-{batch}-" in r["run"] and r.get("replay")]
        for name in ("replay", "replay_with_set_saving", "replay_with_set_before"):
            errs = [abs(r[name] / r["measured"] - 1) for r in got if r.get(name)]
            if errs:
                summary[f"{batch} {name}"] = {
                    "rows": len(errs), "mean_error": statistics.mean(errs),
                    "max_error": max(errs), "within_5pct": sum(e <= 0.05 for e in errs)}
    print(json.dumps(summary, indent=1))
    out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
