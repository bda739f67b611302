"""The search strategies against each other, per kernel family at a real shape, on one GPU.

    python benchmarks/search_strategies.py --out DIR [--families rmsnorm,gated_act,...]
        [--strategies grid,random,tpe,hybrid] [--seeds 0[,1,...]] [--full] [--dry-run]
    python benchmarks/search_strategies.py --out DIR --table A/search_strategies.json B/...

Per family, one case at a model's shape (CASES: Llama-3.2-1B's, GPT-2's LM head for matmul),
bf16. The grid times every config of the space first; its best is the target. Then random
search, TPE and the hybrid (TPE with a proposer on 30 % of its trials: the language model
behind OPENAI_BASE_URL, model from PIPELINE_LLM_MODEL, when that is set, else
scripted_proposer.py) run with the whole space as their budget, each seed apart, and each
stops once it has timed a config within 1 % of the grid's best (`--full`: not before its
budget). Each run is codegen.search.CaseSearch as `pipeline optimize` runs it: a fresh
screening worker and a fresh Triton cache (so every run pays its own compiles), no search
memory (a temporary cache folder).

"Within 1 %" reads a config's time from the grid's table, so the timing noise between two
runs of the same config does not decide it; a proposed kernel file (not in the grid) counts by
its own time. Per run: trials and seconds (from the run's start, its worker's start-up
included) until within 1 %, the best found (its own time and the grid's time of its config),
failures (candidates that did not pass the screen), proposer calls. Writes
DIR/search_strategies.json, DIR/search_strategies.md (both after each family, so a call cut
off at its time limit keeps the families it finished) and DIR/logs/ (each run's search log
entry). `--dry-run`: the same flow on the CPU with a synthetic time per config instead of the
screen, to test it; its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: sys.path[0] is benchmarks/, not the repo root
    sys.path.insert(1, str(ROOT))

FAMILIES = ("rmsnorm", "gated_act", "gemv", "decode_attention", "matmul")
STRATEGIES = ("grid", "random", "tpe", "hybrid")
WITHIN = 0.01
SHARE = 0.3
CPU_REFUSAL = ("benchmarks/search_strategies.py: no CUDA GPU here; timings on the CPU mean "
               "nothing (--dry-run tests the flow on the CPU)")


def _make(family: str, *args, **kwargs) -> dict:
    return importlib.import_module(f"codegen.{family}.reference").make_case(*args, **kwargs)


# (shape, case): Llama-3.2-1B prefill b8 s1024 (8192 tokens) or decode b1 over a 1024-slot
# cache; GPT-2's LM head (50257 wide, padded) for matmul, whose Llama widths are aligned
CASES = {
    "rmsnorm": lambda: ("Llama-3.2-1B prefill b8 s1024", {
        "rows": 8192, "hidden": 2048, "dtype": "bfloat16", "eps": 1e-5, "offset": 0.0,
        "cast_first": True}),
    "gated_act": lambda: ("Llama-3.2-1B prefill b8 s1024 (SwiGLU)",
                          _make("gated_act", 8192, 8192, "bfloat16", "silu", "separate")),
    "matmul_epilogue": lambda: ("Llama-3.2-1B prefill b8 s1024 (gate/up + SiLU)",
                                _make("matmul_epilogue", 8192, 2048, 8192, "bfloat16", "silu")),
    "gemv": lambda: ("Llama-3.2-1B decode b1 (gate/up projection)",
                     _make("gemv", 1, 2048, 8192, "bfloat16", False, (1, 1))),
    "decode_attention": lambda: ("Llama-3.2-1B decode b1, 1024 cached slots",
                                 _make("decode_attention", 1, 32, 8, 64, 1024, "bfloat16")),
    "matmul": lambda: ("GPT-2 LM head, prefill b8 s1024",
                       _make("matmul", 8192, 768, 50257, "bfloat16", "linear", False,
                             lead=(8, 1024))),
}


class SyntheticSession:
    """--dry-run's screen: a config's time from its log2 sizes, nothing runs."""

    def __init__(self):
        self.baseline = {"median_ms": 1.0, "meaningful": False}

    def run(self, jobs):
        out = []
        for j in jobs:
            c = j.get("config") or {}
            ms = 1.0 + sum(0.03 * (math.log2(v) - 6) ** 2 for v in c.values()
                           if isinstance(v, int) and not isinstance(v, bool) and v > 0)
            out.append({**j, "screen": "pass", "timing": {"median_ms": ms, "meaningful": False}})
        return out

    def close(self):
        pass


def _proposer(run_dir: Path):
    from codegen.hybrid import CommandProposer, LLMProposer

    if os.environ.get("OPENAI_BASE_URL"):
        from codegen.llm_proposer import LLMOptions

        return LLMProposer(run_dir, LLMOptions(os.environ.get("PIPELINE_LLM_MODEL")))
    return CommandProposer(f"{sys.executable} {Path(__file__).with_name('scripted_proposer.py')}")


def _median(c: dict) -> float | None:
    return (c.get("timing") or {}).get("median_ms")


def _key(config) -> str:
    return json.dumps(config, sort_keys=True)


def _reached(c: dict, grid: dict) -> bool:
    """Whether candidate `c` is within 1 % of the grid's best, by the grid's time of its config
    (a kernel file not in the grid: by its own)."""
    ms = grid["table"].get(_key(c["config"])) if c.get("config") is not None else None
    ms = _median(c) if ms is None else ms
    return ms is not None and ms <= grid["best_ms"] * (1 + WITHIN)


def one_run(family, case, strategy: str, seed: int, out: Path, dry: bool, grid: dict | None,
            full: bool) -> dict:
    """One strategy on one case, its log kept under out/logs; `grid`: the grid's table
    {config key: ms} and best, which a run stops at unless `full` (None: the grid's own run)."""
    from codegen.screen import ScreenSession
    from codegen.search import CaseSearch
    from codegen.strategies import SearchPlan

    run_dir = out / "runs" / family.name / f"{strategy}-s{seed}"
    space = family.search_space(case)
    if strategy == "grid":
        plan = SearchPlan("grid", fresh=True)
    else:
        plan = SearchPlan("tpe" if strategy == "hybrid" else strategy, trials=len(space),
                          seed=seed, fresh=True,
                          proposer_share=SHARE if strategy == "hybrid" else 0.0)

    def until(entry: dict) -> str | None:
        if full or grid is None or not any(_reached(c, grid) for c in entry["candidates"]):
            return None
        return "within 1 % of the grid's best"

    # every run pays its own Triton compiles (the screening worker inherits the variable);
    # outside DIR, whose size a device call brings back
    os.environ["TRITON_CACHE_DIR"] = triton_cache = tempfile.mkdtemp(prefix="triton-")
    session = SyntheticSession() if dry else ScreenSession(family, case, "cuda")
    t0 = time.monotonic()
    try:
        entry = CaseSearch(family, case, run_dir / "candidates", "cpu" if dry else "cuda", plan,
                           session, proposer=_proposer(run_dir) if strategy == "hybrid"
                           else None, until=until).run()
    finally:
        session.close()
        shutil.rmtree(triton_cache, ignore_errors=True)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    (logs / f"{family.name}-{strategy}-s{seed}.json").write_text(json.dumps(entry, indent=1))
    return {"family": family.name, "strategy": strategy,
            "seed": None if strategy == "grid" else seed, "space": len(space),
            "trials": entry["search"]["trials"], "candidates": len(entry["candidates"]),
            "wall_s": round(time.monotonic() - t0, 2), "stopped": entry["search"]["stopped"],
            "failures": sum(c.get("screen") != "pass" for c in entry["candidates"]),
            "proposer_calls": len(entry.get("proposals") or []),
            "proposer": entry["search"].get("hybrid"), "entry": entry}


def scored(row: dict, grid: dict) -> dict:
    """`row` with what its run reached against the grid's table (its log entry dropped)."""
    cands = row.pop("entry")["candidates"]
    timed = [c for c in cands if _median(c) is not None]
    best = min(timed, key=_median) if timed else None
    first = next((c for c in cands if _reached(c, grid)), None) if grid["table"] else None
    return {**row, "best_ms": _median(best) if best else None,
            "best_config": best.get("config") if best else None,
            "best_by": best.get("strategy") if best else None,
            "best_grid_ms": grid["table"].get(_key(best.get("config"))) if best else None,
            "trials_to_1pct": first["trial"] if first else None,
            "seconds_to_1pct": first["elapsed_s"] if first else None}


def run_family(name: str, strategies: list[str], seeds: list[int], out: Path, dry: bool,
               full: bool, say) -> list[dict]:
    from codegen.registry import get_family

    family = get_family(name)
    shape, case = CASES[name]()
    say(f"{name}: {shape}, {len(family.search_space(case))} configs")
    grid_row = one_run(family, case, "grid", 0, out, dry, None, True)
    table = {_key(c["config"]): _median(c) for c in grid_row["entry"]["candidates"]
             if _median(c) is not None}
    grid = {"table": table, "best_ms": min(table.values()) if table else None}
    rows = [{**scored(grid_row, grid), "shape": shape, "case": case}]
    say(f"  grid: {rows[0]['trials']} trials, best {grid['best_ms']} ms, within 1 % at trial "
        f"{rows[0]['trials_to_1pct']}")
    for strategy in [s for s in strategies if s != "grid"]:
        for seed in seeds:
            row = {**scored(one_run(family, case, strategy, seed, out, dry, grid, full), grid),
                   "shape": shape}
            rows.append(row)
            say(f"  {strategy} seed {seed}: within 1 % at trial {row['trials_to_1pct']} "
                f"({row['seconds_to_1pct']} s); best {row['best_ms']} ms")
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Search strategies ({meta['device']}, {meta['date']})", "",
             f"Target: within {WITHIN:.0%} of the grid's best (by the grid's time of a "
             f"config). Hybrid proposer: {meta['proposer']}. "
             + ("DRY RUN: synthetic times, not measurements." if meta["dry_run"] else ""), "",
             "| family | shape | strategy | seed | space | trials | trials to 1 % | "
             "s to 1 % | best ms (own) | best ms (grid's) | failures | proposer calls |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append("| " + " | ".join(str(x if x is not None else "-") for x in (
            r["family"], r.get("shape", ""), r["strategy"], r["seed"], r["space"], r["trials"],
            r["trials_to_1pct"], r["seconds_to_1pct"], _fmt(r["best_ms"]),
            _fmt(r["best_grid_ms"]), r["failures"], r["proposer_calls"])) + " |")
    lines += ["", "Model-based (tpe) within 1 % in at most 30 % of the grid's trials: "
              + ", ".join(f"{f}: {'yes' if ok else 'no'}" for f, ok in summary(rows).items())]
    return "\n".join(lines) + "\n"


def _fmt(ms):
    return None if ms is None else f"{ms:.4f}"


def summary(rows: list[dict]) -> dict[str, bool]:
    """Per family: whether every TPE seed reached 1 % within 30 % of the grid's trials."""
    out = {}
    for fam in dict.fromkeys(r["family"] for r in rows):
        grid = next(r for r in rows if r["family"] == fam and r["strategy"] == "grid")
        tpe = [r for r in rows if r["family"] == fam and r["strategy"] == "tpe"]
        if tpe:
            out[fam] = all(r["trials_to_1pct"] is not None
                           and r["trials_to_1pct"] <= 0.3 * grid["trials"] for r in tpe)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the table, the logs and the runs")
    p.add_argument("--families", default=",".join(FAMILIES),
                   help=f"of {', '.join(CASES)}")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--seeds", default="0", help="seeds of random, tpe and hybrid")
    p.add_argument("--full", action="store_true", help="spend every budget, not stopping at 1 %%")
    p.add_argument("--dry-run", action="store_true", help="CPU, synthetic times: tests the flow")
    p.add_argument("--table", nargs="+", metavar="JSON", help="no run: merge these "
                   "search_strategies.json files (calls that each ran some families) into "
                   "OUT/search_strategies.json and .md")
    args = p.parse_args(argv)
    if args.table:
        return merge(args.table, Path(args.out))
    families = [f for f in args.families.split(",") if f]
    strategies = [s for s in args.strategies.split(",") if s]
    if set(families) - set(CASES) or set(strategies) - set(STRATEGIES):
        p.error(f"families are {', '.join(CASES)}; strategies {', '.join(STRATEGIES)}")
    if os.environ.get("OPENAI_BASE_URL") and not os.environ.get("PIPELINE_LLM_MODEL") \
            and "hybrid" in strategies:
        p.error("OPENAI_BASE_URL is set: name the model in PIPELINE_LLM_MODEL")
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print(CPU_REFUSAL, file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    # no search memory read or written: every run starts cold
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="search-cache-")
    seeds = [int(s) for s in args.seeds.split(",")]
    import triton

    meta = {"device": "dry run (CPU)" if args.dry_run else torch.cuda.get_device_name(0),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "dry_run": args.dry_run,
            "proposer": (f"llm {os.environ.get('PIPELINE_LLM_MODEL')} at "
                         f"{os.environ['OPENAI_BASE_URL']}" if os.environ.get("OPENAI_BASE_URL")
                         else "scripted (benchmarks/scripted_proposer.py)"),
            "argv": sys.argv[1:]}
    rows: list[dict] = []
    for fam in families:
        rows += run_family(fam, strategies, seeds, out, args.dry_run, args.full,
                           lambda line: print(line, flush=True))
        text = write(out, rows, meta)  # after each family: a call cut off keeps the finished
    print(text)
    return 0


def write(out: Path, rows: list[dict], meta: dict) -> str:
    (out / "search_strategies.json").write_text(json.dumps(
        {"meta": meta, "rows": rows, "tpe_within_1pct_in_30pct": summary(rows)}, indent=1,
        default=str))
    text = markdown(rows, meta)
    (out / "search_strategies.md").write_text(text)
    return text


def merge(paths: list[str], out: Path) -> int:
    """One table from several calls' files (the last file's row of a family wins)."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    fams = {r["family"]: i for i, run in enumerate(runs) for r in run["rows"]}
    rows = [r for i, run in enumerate(runs) for r in run["rows"] if fams[r["family"]] == i]
    meta = {**runs[-1]["meta"], "merged": paths,
            "device": " / ".join(dict.fromkeys(run["meta"]["device"] for run in runs))}
    out.mkdir(parents=True, exist_ok=True)
    print(write(out, rows, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())
