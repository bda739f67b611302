"""A stand-in for an external proposer (tests/pipeline/test_optimize.py runs it as `CMD TASK`).

It reads task.json, then leaves three candidates in `out/`:
- good.py: the current best source, unchanged (a correct proposal);
- wrong.py: the best source with every output shifted by 1 after the launch (a wrong result);
- cheat.py (rmsnorm only): the right numbers from the family's own reference, i.e. the aten ops
  the kernel must replace (passes a numbers-only screen; verification must reject it).
"""

import json
import sys
from pathlib import Path

WRONG_TAIL = '''

_proposed_forward = forward


def forward(*inputs, out, **params):
    _proposed_forward(*inputs, out=out, **params)
    for o in (out if isinstance(out, tuple) else (out,)):
        o.sub_(1.0)  # shifted: a wrong result
'''

CHEAT = '''from codegen.rmsnorm.reference import rms_norm


def forward(x, weight, *, out, **params):
    out.copy_(rms_norm(x, weight, **params))
'''


def main(task: Path) -> None:
    spec = json.loads((task / "task.json").read_text())
    for key in ("family", "case", "contract", "best", "baseline", "min_bytes"):
        if key not in spec:
            sys.exit(f"task.json lacks {key!r}")
    if not (task / "reference.py").is_file():
        sys.exit("no reference.py in the task folder")
    best = (task / "best.py").read_text()
    out = task / "out"
    (out / "good.py").write_text(best)
    (out / "wrong.py").write_text(best + WRONG_TAIL)
    if spec["family"] == "rmsnorm":
        (out / "cheat.py").write_text(CHEAT)
    (task / "proposer_saw.json").write_text(json.dumps({"argv": sys.argv, "task": spec}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
