"""Cold against warm `pipeline optimize`: wall times and what the warm run took from memory.

    python benchmarks/warm_optimize.py COLD_RUN WARM_RUN [--cold-log LOG --warm-log LOG]

Both runs optimized the same profile with the same options; the cold one started from empty
caches (Triton's, the search memory, calibrate's ceilings), the warm one right after it with
those caches as the cold run left them (`benchmarks/gpu_decode.sh` WARM=1). Wall time is the
last progress stamp of each run's optimize log (`[  182.1 s] optimize: ...`), the time
`optimize` itself reports; trials are the configs each search log timed, and the warm run's
candidates tried because the memory named them are counted apart. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: sys.path[0] is benchmarks/, not the repo root
    sys.path.insert(1, str(ROOT))


def elapsed_s(log: Path) -> float | None:
    stamps = re.findall(r"\[\s*([0-9.]+) s\]", log.read_text(errors="replace"))
    return float(stamps[-1]) if stamps else None


def trials(run: Path) -> dict:
    from core.artifacts import load
    from core.records import SearchLog

    log = load(run / "candidates" / "search_log.json", SearchLog, "search log")
    cands = [c for s in log.searches for c in (s.candidates or [])]
    return {"cases": sum(s.case_key is not None for s in log.searches),
            "trials": len(cands),
            # a remembered config is tried first, under strategy "memory" (codegen.search)
            "from_memory": sum(getattr(c, "strategy", None) == "memory" for c in cands)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cold_run", type=Path)
    p.add_argument("warm_run", type=Path)
    p.add_argument("--cold-log", type=Path, help="the cold optimize's output")
    p.add_argument("--warm-log", type=Path, help="the warm optimize's output")
    args = p.parse_args(argv)
    out: dict = {}
    for side, run, log in (("cold", args.cold_run, args.cold_log),
                           ("warm", args.warm_run, args.warm_log)):
        if not (run / "candidates" / "search_log.json").exists():
            p.error(f"{run}: no candidates/search_log.json (did optimize run there?)")
        out[side] = {"run": str(run), "wall_s": elapsed_s(log) if log else None,
                     **trials(run)}
    cold, warm = out["cold"]["wall_s"], out["warm"]["wall_s"]
    out["warm_over_cold"] = warm / cold if cold and warm else None
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
