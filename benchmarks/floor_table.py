"""Each profiled pass's floor against what the results table measured (issue 29).

    python benchmarks/floor_table.py RUN_DIR [RUN_DIR ...] [--results RESULTS.json]

The floor is the profile's own measurement (`profiling.density.floor`: the pass's GEMMs and
attention alone, back to back in one CUDA graph, in steady state), read as a speedup over the
eager wall the same profile timed minutes before, in the same process. The measured rows are
the results table's, whose eager ran in another process: their speedups are compared, not
their milliseconds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows(run_dirs: list[Path], results: dict) -> list[dict]:
    measured: dict[tuple, dict] = {}
    for r in results.get("rows", []):
        measured[(r["model"], r["workload"], r["variant"])] = r
    out = []
    for d in run_dirs:
        prof = json.loads((d / "profile.json").read_text())
        model = prof["model"]["id"]
        for w in prof["workloads"]:
            f = w.get("floor")
            if not f:
                continue
            wall = w["wall"]["median_ms"]
            row = {"model": model, "workload": w["key"], "eager_ms": wall,
                   "floor_ms": f["wall_ms"], "kernel_ms": f["kernel_ms"],
                   "floor_x": wall / f["wall_ms"]}
            for v in ("ours", "ours-graphs", "compile", "liger"):
                m = measured.get((model, w["key"], v))
                row[v] = m["over_eager"] if m else None
                row[f"{v}_ms"] = m["ms"] if m else None
            out.append(row)
    return out


def markdown(table: list[dict]) -> str:
    def x(v):
        return "-" if v is None else f"{v:.3f}x"

    lines = ["| model | eager | floor (kernels) | floor over eager | ours | ours-graphs "
             "| ours-graphs pass over the floor | compile | liger |", "|---" * 9 + "|"]
    for r in table:
        # in time, not in speedup: the results' eager ran in another process than the floor's
        g = r["ours-graphs_ms"]
        above = f"{g:.2f} ms: {g / r['floor_ms'] - 1:+.1%}" if g else "-"
        lines.append(
            f"| {r['model']} | {r['eager_ms']:.2f} ms | {r['floor_ms']:.2f} ms "
            f"({r['kernel_ms']:.2f}) | {x(r['floor_x'])} | {x(r['ours'])} | "
            f"{x(r['ours-graphs'])} | {above} | {x(r['compile'])} | {x(r['liger'])} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dirs", nargs="+", type=Path)
    ap.add_argument("--results", type=Path, default=Path("benchmarks/results/latest.json"))
    ap.add_argument("--write", type=Path, help="also write the rows here as JSON")
    a = ap.parse_args()
    results = json.loads(a.results.read_text()) if a.results.exists() else {}
    table = rows(a.run_dirs, results)
    if a.write:
        a.write.write_text(json.dumps(table, indent=1) + "\n")
    print(markdown(table))


if __name__ == "__main__":
    main()
