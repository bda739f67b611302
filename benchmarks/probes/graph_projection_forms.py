"""How far each way of projecting an `ours-graphs` row lands from its measurement, over the
committed `graphs-*` run folders (h2h.json, projection.json, integration.json). Offline.

A (what results_table does): the h2h eager median over the frozen graphed pass time;
B: the profile's unpatched wall over it (`projected_for_kept.kept`);
C: A with the graphed pass slowed by the unpatched graph's measured over projected time in the
same h2h (a device-speed factor read from a baseline).

    python benchmarks/probes/graph_projection_forms.py [RESULTS_DIR]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def forms(run: Path) -> dict | None:
    h2h = json.loads((run / "h2h.json").read_text())
    medians, workload = h2h["median_ms"], h2h["workload"]
    projected = json.loads((run / "projection.json").read_text())["workloads"].get(workload, {})
    integ = run / "integration.json"
    kept = json.loads(integ.read_text())["workloads"].get(workload, {}) if integ.exists() else {}
    g = (kept.get("graphs") or {}).get("projected_for_kept") or projected.get("graphs") or {}
    measured = (h2h.get("over_eager", {}).get("ours-graphs") or {}).get("speedup")
    eager, pass_ms = medians.get("eager"), (g.get("kept_pass_us") or 0) / 1e3
    if not (measured and eager and pass_ms):
        return None
    out = {"measured": measured, "A": eager / pass_ms, "B": g.get("kept")}
    if medians.get("graph") and g.get("unpatched_pass_us"):
        out["C"] = out["A"] / (medians["graph"] / (g["unpatched_pass_us"] / 1e3))
    return out


if __name__ == "__main__":
    default = Path(__file__).resolve().parents[1] / "results"
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else default
    for run in sorted(root.glob("graphs-*")):
        if not (run / "h2h.json").exists() or not (run / "projection.json").exists():
            continue
        f = forms(run)
        if f is None:
            continue
        errs = "  ".join(f"{k} {100 * abs(f[k] - f['measured']) / f['measured']:5.1f} %"
                         if f.get(k) else f"{k}    -  " for k in "ABC")
        print(f"{run.name.removeprefix('graphs-'):48s} measured {f['measured']:7.3f}x  {errs}")
