"""The hybrid search's proposer when no language model is reachable (search_strategies.py runs
it as `python benchmarks/scripted_proposer.py TASK`, codegen/hybrid.py's contract).

It reads the optimiser's state in TASK/task.json and proposes, as `out/neighbour.json`, the
config of the space nearest the best so far that was not tried (one key one step away where
there is one: codegen.strategies.Encoding's distance), which is what a reader of the state
who trusts the incumbent would try. Without a timed config it proposes nothing, and the
optimiser's suggestion runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: sys.path[0] is benchmarks/
    sys.path.insert(1, str(ROOT))


def neighbour(optimiser: dict) -> dict | None:
    from codegen.strategies import Encoding

    space = optimiser["space"]
    best = next((b["config"] for b in optimiser["best"] if b["config"] in space), None)
    tried = [t["config"] for t in optimiser["tried"]]
    untried = [c for c in space if c not in tried]
    if best is None or not untried:
        return None
    enc = Encoding(space)
    return enc.nearest(enc.params(best), untried)


def main(task: Path) -> None:
    spec = json.loads((task / "task.json").read_text())
    config = neighbour(spec["optimiser"])
    if config is not None:
        (task / "out" / "neighbour.json").write_text(json.dumps(config))


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1], "task.json").is_file():
        sys.exit("usage: python benchmarks/scripted_proposer.py TASK (a folder with task.json)")
    main(Path(sys.argv[1]))
