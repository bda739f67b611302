"""The host probe for launch-bound passes, on and off: re-project every committed run both ways.

`pipeline.projection.replay.workload_graph` scales the replay's host chain to the unprofiled wall,
then, before run 14, also to the profile's host-bound probe (a tiny pass) wherever that was
faster. Since run 14 the probe is used for device-bound passes only. This re-projects the set
each committed workload shipped, from its frozen inputs (`reproject.py`), with the probe
applied to every pass ("before") and with the current code ("now"), and prints both errors
against the measured speedup.

    python benchmarks/probes/probe_rule_ab.py OUT.json [RESULTS_DIR ...]
"""

from __future__ import annotations

import json
import statistics
import sys
from functools import partial
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # benchmarks/ (reproject)
from reproject import out_and_folders, reproject  # noqa: E402


def probe_everywhere(workload_graph, w: dict, trace_path):
    """`workload_graph` as it was before run 14: the probe tightens any pass, as it still does
    a device-bound one."""
    return workload_graph(dict(w, gpu_busy_share=1.0), trace_path)


def main() -> None:
    import pipeline.projection.workload as rs

    out, folders = out_and_folders(__doc__)
    current, rows = rs.workload_graph, []
    for folder in folders:
        if not (folder / "trace").is_dir() or not (folder / "projection.json").exists():
            continue
        rs.workload_graph = partial(probe_everywhere, current)
        try:
            before = reproject(folder)
        finally:
            rs.workload_graph = current
        now = reproject(folder)
        for key, r in now.items():
            rows.append({"run": folder.name, "workload": key, "measured": r["measured"],
                         "before": before[key]["now"]["replay"], "now": r["now"]["replay"]})
            m = r["measured"]
            print(f"{folder.name:46} {key:22} measured {m:.3f}x  before "
                  f"{rows[-1]['before']:.3f}x ({rows[-1]['before'] / m - 1:+.1%})  now "
                  f"{rows[-1]['now']:.3f}x ({rows[-1]['now'] / m - 1:+.1%})")
    summary = {}
    for name in ("before", "now"):
        signed = [r[name] / r["measured"] - 1 for r in rows]
        summary[name] = {"mean_abs": statistics.mean(map(abs, signed)),
                         "mean_signed": statistics.mean(signed), "max_abs": max(map(abs, signed)),
                         "within_5pct": sum(abs(e) <= 0.05 for e in signed)}
    print(json.dumps({"rows": len(rows), **summary}, indent=1))
    out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
