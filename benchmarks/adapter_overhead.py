"""Host cost of the patch adapters themselves, measured on the CPU (no GPU needed).

A launch-bound or host-bound pass (batch 1, or Qwen2.5-0.5B at batch 8 on a slow host) pays
every microsecond of Python an adapter adds per call. This isolates that: tiny-llama in fp32
on the CPU, each family patched with a kernel that does nothing, so what is timed is the HF
code the adapter keeps (linears, attention) plus the adapter's own Python, against the
unpatched model. Denormals are flushed so the unwritten output buffers cannot slow the math.

    python benchmarks/adapter_overhead.py [--out FILE.json] [--rounds N] [--families a,b]
        [--model tiny-gpt2]

Prints per family: the forward's median time unpatched and patched, and the median paired
difference per patched call (negative: the adapter plus a free kernel costs less than the HF
ops it replaces). `--rendered` instead times four families' rendered candidate `forward` (its
checks and argument handling) with the kernel launch replaced by a no-op, on one small case.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
import timeit
from pathlib import Path

import torch

FAMILIES = "rmsnorm,add_rmsnorm,rope,gated_act,kv_cache,matmul_epilogue"
GPT2_FAMILIES = "layernorm,add_layernorm,gelu,kv_cache,matmul"


def _block_us(model, ids, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        model(ids)
    return (time.perf_counter() - t) * 1e6 / n


def _paired_us(model, ids, patch, rounds: int, n: int = 50) -> tuple[float, float, float]:
    """(unpatched, patched, median of per-round differences), rounds interleaved so a drift
    of the host's speed hits both sides alike."""
    base, patched, diffs = [], [], []
    with torch.no_grad():
        for _ in range(3):
            model(ids)
        for _ in range(rounds):
            b = _block_us(model, ids, n)
            undo = patch()
            p = _block_us(model, ids, n)
            undo()
            base.append(b)
            patched.append(p)
            diffs.append(p - b)
    return statistics.median(base), statistics.median(patched), statistics.median(diffs)


def _rendered_cases() -> dict[str, tuple[dict, int]]:
    """family -> (case, which config of its search space) for `--rendered`: small shapes, and
    for matmul_epilogue the wide TMA kernel (the space's last config from 256 rows), which
    prefill runs."""
    from codegen.matmul_epilogue.reference import make_case as gemm_case
    from codegen.rope.reference import make_case as rope_case

    norm = {"rows": 16, "hidden": 64, "dtype": "float32", "eps": 1e-6, "offset": 0.0,
            "cast_first": True}
    return {"rmsnorm": (norm, 0), "add_rmsnorm": (norm, 0),
            "rope": (rope_case(8, 16, 4, 2, 16, 16, "float32"), 0),
            "matmul_epilogue": (gemm_case(256, 64, 128, "float32", "silu"), -1)}


def rendered_us(name: str, case: dict, index: int, tmp: Path) -> float:
    """us per call of one rendered forward on the CPU, its kernel launch a no-op: the best of
    5 repeats of 20000 calls."""
    from codegen.registry import get_family
    from core.source import load_module

    family = get_family(name)
    path = tmp / f"{name}.py"
    path.write_text(family.render(family.search_space(case)[index], case))
    module = load_module(path)
    # the launchers' names in the rendered files: `_launch`, `_kernel`, and the wide dual
    # GEMM's second one, `_kernel_up_first`, whichever weight lies first in memory (a real
    # interpreter launch left in would be launched 100000 times: the test's 300 s limit)
    launchers = [n for n in vars(module) if n == "_launch" or n.startswith("_kernel")]
    assert launchers, f"no launcher found in the rendered {name} forward"
    for launch in launchers:
        setattr(module, launch, lambda *a, **k: None)
    inputs = family.make_inputs(case, "cpu", torch.Generator().manual_seed(0))
    out = family.make_out(case, inputs)
    n = 20000
    return min(timeit.repeat(lambda: module.forward(*inputs, out=out), number=n,
                             repeat=5)) / n * 1e6


def main() -> None:
    from codegen.registry import get_family
    from profiling.loader import build, resolve

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--families", default=None,
                    help=f"comma-separated (default: {FAMILIES}; with tiny-gpt2: "
                         f"{GPT2_FAMILIES})")
    ap.add_argument("--model", default="tiny-llama", help="a built-in tiny model")
    ap.add_argument("--rendered", action="store_true",
                    help="time the rendered forwards of rmsnorm, add_rmsnorm, rope and "
                         "matmul_epilogue instead")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.rendered:
        with tempfile.TemporaryDirectory() as tmp:
            for name, (case, index) in _rendered_cases().items():
                print(f"{name:15s} rendered forward, no-op launch: "
                      f"{rendered_us(name, case, index, Path(tmp)):6.2f} us/call")
        return
    torch.set_flush_denormal(True)
    model = build(resolve(args.model), torch.float32, "cpu")
    ids = torch.randint(3, 500, (1, 8), generator=torch.Generator().manual_seed(0))
    rows = {}
    default = GPT2_FAMILIES if "gpt2" in args.model else FAMILIES
    for name in (args.families or default).split(","):
        calls = [0]

        def chooser(case, calls=calls):
            def kernel(*a, **k):
                calls[0] += 1

            return kernel

        family = get_family(name)
        undo = family.patch(model, chooser)
        with torch.no_grad():
            model(ids)
        per_pass = calls[0]
        undo()
        base, patched, diff = _paired_us(model, ids, lambda f=family, c=chooser: f.patch(model, c),
                                         args.rounds)
        rows[name] = {"unpatched_us": base, "patched_noop_us": patched,
                      "calls_per_pass": per_pass,
                      "delta_per_call_us": diff / max(per_pass, 1)}
        print(f"{name:12s} unpatched {base:8.1f} us  patched(no-op kernel) {patched:8.1f} us  "
              f"{per_pass:3d} calls  {rows[name]['delta_per_call_us']:+6.2f} us/call")
    result = {"machine": platform.processor() or platform.machine(),
              "python": platform.python_version(), "torch": torch.__version__,
              "model": f"{args.model} fp32, batch 1 x seq 8, 1 CPU thread",
              "method": f"{args.rounds} interleaved rounds of 50 forwards unpatched, then 50 "
                      "patched; median per-round difference", "families": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
