"""Would the projection have been right at another host speed? Offline, over committed runs.

The replay projection calibrates its host chain to the profile's unpatched host time
(`enqueue_ms`), and the lent H200's host speed moves between the profile and the measurement.
This re-projects each committed run's shipped set, from its frozen kernel numbers, with the
host chain and the in-model host deltas scaled to another host time H per unpatched pass:

- profile: the profile's own (a control: it must give the frozen projection back);
- fresh: the median unpatched host time the host-delta stage read, minutes before integration
  (a projection frozen before integration could use it);
- measured: the median unpatched host time during the paired whole-model timing itself (an
  oracle: not available to a frozen projection; it bounds what any host-speed correction can
  do).

    python benchmarks/host_speed_reproject.py OUT.json [RESULTS_DIR ...]

Without folders it reads every `benchmarks/results/optimize-*` that has the needed files.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from contextlib import contextmanager
from pathlib import Path

SPEEDS = ("profile", "fresh", "measured")


@contextmanager
def host_scaled(scale: float):
    """The projection's replay graph with its calibrated host time multiplied by `scale`."""
    import pipeline.projection.workload as rank_stage
    from profiling.replay import scale_host

    original = rank_stage.workload_graph

    def scaled(w, trace_path):
        graph = original(w, trace_path)
        return graph if graph is None or scale == 1.0 else scale_host(graph, scale)

    rank_stage.workload_graph = scaled
    try:
        yield
    finally:
        rank_stage.workload_graph = original


def host_speeds(proj_w: dict, integ_w: dict, then: float | None) -> dict:
    fresh = [d["base_enqueue_ms"] for d in (proj_w.get("host_in_model") or {}).values()
             if d.get("base_enqueue_ms")]
    during = (integ_w.get("combined") or {}).get("host_a_ms")
    return {"profile": then, "fresh": statistics.median(fresh) if fresh else None,
            "measured": statistics.median(during) if during else None}


def reproject_at(results: Path) -> dict:
    """Per workload of one run: measured speedup, frozen replay, and the replay at each host
    speed of SPEEDS (None where the run did not record it)."""
    from reproject import unpack_run

    from pipeline.projection.host import host_of, rescaled_host
    from pipeline.projection.workload import project_set

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp)
        proj, integ, ranking = unpack_run(results, run)
        for key, iw in integ["workloads"].items():
            kept = list(iw.get("kept") or [])
            if not kept or not iw.get("combined"):
                continue
            pw, ranked = proj["workloads"][key], ranking[key]
            then = ranked.get("enqueue_ms")
            row = {"kept": kept, "measured": 1 / iw["combined"]["estimate"],
                   "frozen": (iw.get("projection_for_kept") or pw)["replay"],
                   "host_ms": host_speeds(pw, iw, then), "replay": {}}
            for speed, h in row["host_ms"].items():
                if not h or not then:
                    continue
                at_h = {**ranked, "enqueue_ms": h}  # the in-model deltas' shares times h
                host = {**host_of(proj, key), **rescaled_host(at_h, pw.get("host_in_model") or {})}
                with host_scaled(h / then):
                    row["replay"][speed] = project_set(run, at_h, proj["kernel_speedups"], host,
                                                       True, only=kept,
                                                       cases=proj.get("case_speedups"))["replay"]
            out[key] = row
    return out


def summary(rows: list[dict]) -> dict:
    """Mean, median and max |error| per reading, over the rows that have every reading."""
    full = [r for r in rows if r["frozen"] and all(r["replay"].get(s) for s in SPEEDS)]
    out = {"rows": len(full)}
    for name, get in [("frozen", lambda r: r["frozen"])] + [
            (s, lambda r, s=s: r["replay"][s]) for s in SPEEDS]:
        errs = [abs(get(r) - r["measured"]) / r["measured"] for r in full]
        if errs:
            out[name] = {"mean": statistics.mean(errs), "median": statistics.median(errs),
                         "max": max(errs), "within_5pct": sum(e <= 0.05 for e in errs)}
    return out


def main() -> None:
    from reproject import out_and_folders

    out, folders = out_and_folders(__doc__)
    need = ("projection.json", "integration.json", "ranking.json", "trace")
    rows = []
    for folder in folders:
        if not all((folder / n).exists() for n in need):
            continue
        for key, row in reproject_at(folder).items():
            rows.append({"run": folder.name, "workload": key, **row})
            err = {s: f"{abs(v - row['measured']) / row['measured']:.1%}"
                   for s, v in row["replay"].items()}
            print(f"{folder.name} {key}: measured {row['measured']:.3f}x, frozen "
                  f"{row['frozen']:.3f}x; errors at each host speed {err}")
    result = {"summary": summary(rows), "rows": rows}
    print(json.dumps(result["summary"], indent=1))
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
