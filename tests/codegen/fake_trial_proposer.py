"""A stand-in for a proposer in a hybrid search (tests/codegen/test_hybrid.py runs it as
`CMD TASK`). From task.json's `optimiser` it proposes, as `out/next.json`, the first config of
the space not tried yet; on its first call it also writes a kernel file, `out/fast.py`, whose
synthetic time (`# FAKE_MS`, read by cost_session.py) beats every config. With `--nothing` it
proposes a config outside the space and a file that is not JSON."""

import json
import sys
from pathlib import Path


def main(task: Path, nothing: bool) -> None:
    spec = json.loads((task / "task.json").read_text())
    opt = spec["optimiser"]
    out = task / "out"
    if nothing:
        (out / "outside.json").write_text(json.dumps({"BM": 7}))
        (out / "broken.json").write_text("{BM: ")
        return
    tried = [t["config"] for t in opt["tried"]]
    untried = [c for c in opt["space"] if c not in tried]
    if untried:
        (out / "next.json").write_text(json.dumps(untried[0]))
    if not any(t["strategy"] == "proposer" and t["config"] is None for t in opt["tried"]):
        (out / "fast.py").write_text("# FAKE_MS 0.5\n" + (task / "best.py").read_text())
    (task / "proposer_saw.json").write_text(json.dumps({"argv": sys.argv, "optimiser": opt}))


if __name__ == "__main__":
    main(Path(sys.argv[-1]), "--nothing" in sys.argv)
