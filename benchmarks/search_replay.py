"""The sampled search strategies replayed over a GPU grid's measured times, many seeds, no GPU.

    python benchmarks/search_replay.py DIR [--seeds 30] [--out DIR]

DIR is a `search_strategies.py` output folder. Its grid timed every config of each family's
case once; here random search and TPE (codegen.strategies, the code `pipeline optimize` runs)
pick from the same space, seed after seed, and each pick is told the grid's measured time of
that config. What differs from a GPU run is only the timing noise a pick would see, which the
GPU table's scoring ignores anyway (it reads each config's time from the grid). One seed on a
GPU says little on spaces of 7-17 configs where two or three configs sit within 1 % of the
best; the distribution over seeds says how often a strategy gets there in a given share of the
space. Writes DIR/search_replay.json and .md (or --out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: sys.path[0] is benchmarks/, not the repo root
    sys.path.insert(1, str(ROOT))

WITHIN = 0.01
SHARE = 0.3  # the bar: within 1 % in at most 30 % of the grid's trials
STRATEGIES = ("random", "tpe")


def _key(config: dict) -> str:
    return json.dumps(config, sort_keys=True)


def grid_tables(folder: Path) -> dict[str, list[tuple[dict, float]]]:
    """Per family, the grid's (config, median ms) in its order, from the run's logs, and
    under "leads" the family's guesses among them (Family.leads), which a GPU search times
    first whatever its strategy (codegen.search.CaseSearch)."""
    from codegen.registry import get_family

    out = {}
    for log in sorted((folder / "logs").glob("*-grid-s0.json")):
        entry = json.loads(log.read_text())
        table = [(c["config"], c["timing"]["median_ms"]) for c in entry["candidates"]
                 if (c.get("timing") or {}).get("median_ms") is not None]
        family = get_family(entry["family"])
        space = family.search_space(entry["case"])
        guesses = space[:family.leads(entry["case"])] if family.leads else []
        out[entry["family"]] = (table, [c for c in guesses if any(c == t for t, _ in table)])
    if not out:
        raise SystemExit(f"search_replay: no grid log (logs/*-grid-s0.json) under {folder}")
    return out


def trials_to_reach(strategy: str, table: list[tuple[dict, float]], seed: int,
                    leads: list[dict] = ()) -> int | None:
    """Trials a strategy takes, told the measured times, to pick a config within 1 %."""
    from codegen.strategies import make

    ms = {_key(c): m for c, m in table}
    target = min(ms.values()) * (1 + WITHIN)
    search = make(strategy, [c for c, _ in table], None, seed=seed, seeds=list(leads))
    while (pick := search.suggest()) is not None:
        search.tell(pick[0], ms[_key(pick[0])])
        if ms[_key(pick[0])] <= target:
            return len(search.told)
    return None


def replay(tables: dict, seeds: int) -> list[dict]:
    rows = []
    for family, (table, leads) in tables.items():
        size, target = len(table), min(t for _, t in table) * (1 + WITHIN)
        grid_first = next(i + 1 for i, (_, m) in enumerate(table) if m <= target)
        for strategy in STRATEGIES:
            runs = [trials_to_reach(strategy, table, s, leads) for s in range(seeds)]
            reached = [r for r in runs if r is not None]
            rows.append({
                "family": family, "strategy": strategy, "space": size, "seeds": seeds,
                "leads": len(leads),
                "within_1pct_configs": sum(m <= target for _, m in table),
                "grid_trials_to_1pct": grid_first,
                "median_trials_to_1pct": statistics.median(reached) if reached else None,
                "worst": max(reached) if reached else None,
                "share_of_seeds_within_30pct": round(
                    sum(r <= SHARE * size for r in reached) / seeds, 3),
                "median_within_30pct": bool(reached)
                and statistics.median(reached) <= SHARE * size})
    return rows


def markdown(rows: list[dict], source: str) -> str:
    lines = [f"# Search strategies replayed over the grid's measured times ({source})", "",
             "Each seed's picks are told the grid's median of that config; \"within 1 %\" is "
             "against the grid's best. Each strategy first times the family's guesses "
             "(`leads`, Family.leads), as a GPU search does.", "",
             "| family | space | configs within 1 % | grid's order reaches it at | leads | "
             "strategy | seeds | median trials to 1 % | worst | seeds within 30 % of the "
             "space |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['family']} | {r['space']} | {r['within_1pct_configs']} | "
            f"{r['grid_trials_to_1pct']} | {r.get('leads', 0)} | {r['strategy']} | "
            f"{r['seeds']} | "
            f"{r['median_trials_to_1pct']} | {r['worst']} | "
            f"{r['share_of_seeds_within_30pct']:.0%} |")
    tpe = [r for r in rows if r["strategy"] == "tpe"]
    met = sum(r["median_within_30pct"] for r in tpe)
    lines += ["", f"TPE's median within 30 % of the space on {met} of {len(tpe)} families: "
              + ", ".join(
                  f"{r['family']} {'yes' if r['median_within_30pct'] else 'no'}" for r in tpe)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path, help="a search_strategies.py --out folder")
    p.add_argument("--seeds", type=int, default=30, help="seeds 0..N-1 per strategy")
    p.add_argument("--out", type=Path, help="where to write (default: the folder)")
    args = p.parse_args(argv)
    if not args.folder.is_dir():
        p.error(f"{args.folder} is not a folder")
    rows = replay(grid_tables(args.folder), args.seeds)
    out = args.out or args.folder
    out.mkdir(parents=True, exist_ok=True)
    meta = json.loads((args.folder / "search_strategies.json").read_text())["meta"] \
        if (args.folder / "search_strategies.json").exists() else {}
    source = f"{meta.get('device', 'unknown device')}, {meta.get('date', '')}"
    (out / "search_replay.json").write_text(json.dumps({"source": meta, "rows": rows}, indent=1))
    text = markdown(rows, source)
    (out / "search_replay.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
