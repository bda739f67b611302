"""One contender against eager, in its own process (Liger patches classes; compile caches).

    python benchmarks/contenders.py compile llama-3.2-1b 8 1024 OUT.json
    python benchmarks/contenders.py liger   llama-3.2-1b 8 1024 OUT.json

compile: eager and torch.compile(model) (default mode) interleaved in one process, paired
ratios with a bootstrap CI (the harness the pipeline uses). liger: liger-kernel's
apply_liger_kernel_to_<model_type>(rope, rms_norm, swiglu or geglu: the arguments it accepts)
patches module-level code too, so eager
is timed first and Liger after, in the same process; the ratio is of medians.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from core.workload import Workload
from profiling.capture import make_runner, wall_time
from profiling.loader import build, resolve
from verify.timing import paired_ratio

# what the pipeline's kernels replace; cross entropy is off because no loss is computed
LIGER_ARGS = {"rope": True, "rms_norm": True, "swiglu": True, "geglu": True,
              "cross_entropy": False, "fused_linear_cross_entropy": False}


def liger_apply(lk, model_type: str):
    """Liger's apply function for `model_type`, or SystemExit saying there is none."""
    apply = getattr(lk, f"apply_liger_kernel_to_{model_type}", None)
    if apply is None:
        raise SystemExit(f"no Liger support for {model_type}")
    return apply


def call_accepted(apply, wanted: dict, **always) -> dict:
    """Call `apply` with the arguments of `wanted` its signature names (Gemma's takes `geglu`,
    not `swiglu`; an unknown keyword is a TypeError) plus `always`; returns what was passed."""
    import inspect

    params = inspect.signature(apply).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        passed = dict(wanted)
    else:
        passed = {k: v for k, v in wanted.items() if k in params}
        always = {k: v for k, v in always.items() if k in params}
    apply(**passed, **always)
    return passed


def main(contender: str, model_id: str, batch: int, seq: int, out: str) -> None:
    spec = resolve(model_id)
    if contender == "liger":  # before building the model: GPT-2 has no Liger patch
        import liger_kernel.transformers as lk

        apply = liger_apply(lk, spec.model_type)
    w = Workload(batch, seq, "bfloat16", "cuda")
    model = build(spec, torch.bfloat16, "cuda")
    runner = make_runner(model, w)
    result = {"contender": contender, "model": model_id, "workload": w.key,
              "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0)}
    if contender == "compile":
        compiled = torch.compile(model)
        ids = runner.input_ids
        t = time.perf_counter()
        with torch.no_grad():
            compiled(ids)
            torch.cuda.synchronize()
        result["compile_s"] = time.perf_counter() - t

        def base():
            with torch.no_grad():
                model(ids)

        def cand():
            with torch.no_grad():
                compiled(ids)

        r = paired_ratio(base, cand, n=30, device="cuda")
        result.update(speedup=1 / r.estimate, ci=[1 / r.ci_high, 1 / r.ci_low],
                      eager_ms=statistics.median(r.times_a_ms),
                      contender_ms=statistics.median(r.times_b_ms), method="interleaved pairs")
    elif contender == "liger":
        eager = wall_time(runner, "cuda", reps=30)
        result["liger_arguments"] = call_accepted(apply, LIGER_ARGS, model=model)
        liger = wall_time(runner, "cuda", reps=30)
        result.update(eager_ms=eager["median_ms"], contender_ms=liger["median_ms"],
                      speedup=eager["median_ms"] / liger["median_ms"],
                      eager_spread=[eager["p10_ms"], eager["p90_ms"]],
                      contender_spread=[liger["p10_ms"], liger["p90_ms"]],
                      method="eager then Liger, same process, medians of 30")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "ratios"}))


if __name__ == "__main__":
    if len(sys.argv) != 6 or sys.argv[1] not in ("compile", "liger"):
        sys.exit("usage: python benchmarks/contenders.py compile|liger MODEL BATCH SEQ OUT.json")
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
