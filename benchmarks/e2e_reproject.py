"""Compose a `pipeline e2e` record's projections again from its run directory (no GPU).

    python benchmarks/e2e_reproject.py RUN_DIR [--write]

The projection of a generation (`pipeline.e2e_projection.compose`) is computed from frozen run
artifacts (profile, traces, projection.json) and the e2e record's own measurements (hf-eager's
call, which families served the prefill and the steps), so it can be recomputed offline when
the composition changes. Records that predate `served` take it as each variant's families
less the cases it had no kernel for; a graphed variant's steps run its whole graph set.
Prints old and new projected speedups and errors; `--write` replaces them in e2e.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from core.artifacts import load, write_json
from core.records import E2E
from pipeline.e2e_projection import compose


def served(v, phase: str) -> set[str]:
    if v.served:
        return set(v.served.get(phase, []))
    return set(v.families) - set((v.declined or {}).get(phase, {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()
    rec = load(args.run_dir / "e2e.json", E2E, "e2e")
    points = []
    for p in rec.points:
        eager = next((v.times for v in p.variants if v.name == "hf-eager"), None)
        graph = next((v.times for v in p.variants if v.name == "graph"), None)
        variants = []
        for v in p.variants:
            if v.name in ("graph", "ours", "ours-graphs") and v.times and eager:
                new = compose(args.run_dir, v.name, eager, p.new, p.prefill_workload,
                              p.decode_workload, served(v, "prefill"), served(v, "steps"),
                              graph)
                if new is not None:
                    new = new.model_copy(update={"error": abs(new.speedup - v.over_eager)
                                                 / v.over_eager})
                old = v.projected
                print(f"{p.key} {v.name}: measured {v.over_eager:.3f}x; projected "
                      f"{old.speedup if old else float('nan'):.3f}x -> "
                      f"{new.speedup if new else float('nan'):.3f}x (error "
                      f"{new.error if new else float('nan'):.1%})")
                v = v.model_copy(update={"projected": new})
            variants.append(v)
        points.append(p.model_copy(update={"variants": variants}))
    if args.write:
        note = "projections composed again offline (benchmarks/e2e_reproject.py)"
        notes = rec.notes + ([note] if note not in rec.notes else [])
        write_json(args.run_dir / "e2e.json",
                   rec.model_copy(update={"points": points, "notes": notes}).model_dump())


if __name__ == "__main__":
    main()
