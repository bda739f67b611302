"""Time verify_candidate on each family's first case from the tiny zoo models (a script, not a
test): `python tests/verify/verify_time.py [--device cuda] [family ...]`. Each family is verified
once untimed (imports, compilation) and then timed; prints seconds per family and one JSON line.
Run from another checkout's root (`cd OLD && python NEW/tests/verify/verify_time.py`) to time
that checkout's verifier: its modules come first on sys.path, down to c7f4255's layout."""

import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.getcwd())
args = sys.argv[1:]
DEVICE = "cpu"
if args[:1] == ["--device"]:
    DEVICE, args = args[1], args[2:]
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from codegen.registry import families  # noqa: E402
from verify.harness import verify_candidate  # noqa: E402

try:
    from core.workload import Workload
    from profiling.loader import build, resolve
except ImportError:  # a checkout from before core/ (c7f4255, the verifier before issue 27)
    from models.loader import build, resolve
    from pipeline.workload import Workload

MODELS = ["tiny-llama", "tiny-gemma", "tiny-phi3", "tiny-gpt2"]
dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
models = {m: build(resolve(m), dtype, DEVICE) for m in MODELS}
workload = Workload(2, 8, dtype=str(dtype).removeprefix("torch."), device=DEVICE)
times, tmp = {}, tempfile.mkdtemp()
for name, fam in sorted(families().items()):
    if args and name not in args:
        continue
    case = next((c for m in models.values() for c in fam.cases_from_model(m, workload)), None)
    if case is None:
        print(name, "no case from the tiny models")
        continue
    path = os.path.join(tmp, f"{name}.py")
    with open(path, "w") as f:
        f.write(fam.render(fam.search_space(case)[0], case))
    verify_candidate(fam, path, [case], device=DEVICE, timeout_s=600)
    t0 = time.monotonic()
    result = verify_candidate(fam, path, [case], device=DEVICE, timeout_s=600)
    times[name] = round(time.monotonic() - t0, 2)
    print(name, result.verdict, f"{times[name]:.2f}s", result.reasons[:1], flush=True)
print(json.dumps(times))
