"""Host time per call on the GPU machine: an aten op, a Triton launch (through the JIT and
straight through the compiled kernel), and each family's patched module call against the
Hugging Face one, at a launch-bound shape (Llama-3.2-1B, batch 1 x seq 128).

Why: in a launch-bound pass the host time of a call decides the speedup, not the kernel; the
first H200 run lost 14 % at batch 1 x seq 128 with kernels that were each faster on the device.

    python3 benchmarks/probes/host_cost.py OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # benchmarks/ (host_profile)

import torch
import triton
import triton.language as tl


@triton.jit
def _noop_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def host_us(call, reps: int = 2000) -> dict:
    """Median and p90 of the host time of one call; the GPU is drained every 100 calls so
    the launch queue never fills (a full queue would make launches block)."""
    for _ in range(50):
        call()
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        t = time.perf_counter()
        call()
        times.append((time.perf_counter() - t) * 1e6)
        if i % 100 == 99:
            torch.cuda.synchronize()
    times.sort()
    return {"median_us": statistics.median(times), "p10_us": times[len(times) // 10],
            "p90_us": times[9 * len(times) // 10]}


def launches() -> dict:
    x = torch.zeros(2048, device="cuda", dtype=torch.bfloat16)
    out = {"aten_neg": host_us(lambda: torch.neg(x)),
           "aten_empty_like": host_us(lambda: torch.empty_like(x))}
    out["triton_jit"] = host_us(lambda: _noop_kernel[(2,)](x, 2048, BLOCK=1024))
    compiled = _noop_kernel[(2,)](x, 2048, BLOCK=1024)
    from triton.runtime import driver

    dev = driver.active.get_current_device()
    stream = driver.active.get_current_stream(dev)

    def direct():
        compiled.run(2, 1, 1, stream, compiled.function, compiled.packed_metadata, None,
                     None, None, x, 2048, 1024)

    try:
        direct()
        torch.cuda.synchronize()
        out["triton_compiled_run"] = host_us(direct)
    except Exception as e:  # noqa: BLE001 - a private API: report, do not fail the run
        out["triton_compiled_run"] = {"error": f"{type(e).__name__}: {e}"[:200]}
    out["cpp_extension"] = cpp_extension_launch(x)
    return out


_CUDA_SRC = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
__global__ void copy_kernel(const at::BFloat16* x, at::BFloat16* y, int64_t n) {
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i];
}
void copy_into(torch::Tensor x, torch::Tensor y) {
  int64_t n = x.numel();
  copy_kernel<<<(n + 255) / 256, 256, 0, at::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const at::BFloat16*>(x.data_ptr()),
      reinterpret_cast<at::BFloat16*>(y.data_ptr()), n);
}
"""


def cpp_extension_launch(x) -> dict:
    """Compile time of a one-kernel extension through load_inline, and its host cost per call."""
    try:
        from torch.utils.cpp_extension import load_inline

        t = time.perf_counter()
        mod = load_inline("host_cost_probe", cpp_sources="void copy_into(torch::Tensor x, "
                          "torch::Tensor y);", cuda_sources=_CUDA_SRC, functions=["copy_into"],
                          extra_cuda_cflags=["-O3"], verbose=False)
        compile_s = time.perf_counter() - t
        y = torch.empty_like(x)
        mod.copy_into(x, y)
        torch.cuda.synchronize()
        assert torch.equal(x, y)
        return {"compile_s": compile_s, **host_us(lambda: mod.copy_into(x, y))}
    except Exception as e:  # noqa: BLE001 - report what failed, keep the other numbers
        return {"error": f"{type(e).__name__}: {e}"[:300]}


def families(model_id: str = "llama-3.2-1b", batch: int = 1, seq: int = 128) -> dict:
    """Patched vs original per-call host time, the kernel being the family's middle config."""
    import tempfile
    from pathlib import Path

    from host_profile import middle_config_choosers  # benchmarks/, this script's folder

    from codegen.registry import get_family
    from core.workload import Workload
    from profiling.loader import build, resolve

    model = build(resolve(model_id), torch.bfloat16, "cuda")
    w = Workload(batch=batch, seq=seq, dtype="bfloat16", device="cuda", mode="prefill")
    ids = torch.randint(0, 1000, (batch, seq), device="cuda")
    tmp = Path(tempfile.mkdtemp())
    res = {}

    def pass_us():
        with torch.no_grad():
            return host_us(lambda: model(ids), reps=60)

    choosers = middle_config_choosers(model, w, ["rmsnorm", "rope", "gated_act", "add_rmsnorm"],
                                      tmp)
    res["pass_eager"] = pass_us()
    for names in [[n] for n in choosers] + [["rmsnorm", "rope", "gated_act"]]:
        undos = [get_family(n).patch(model, choosers[n]) for n in names]
        try:
            res["pass_" + "+".join(names)] = pass_us()
        finally:
            for u in reversed(undos):
                u()
    return res


def main() -> None:
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "launch": launches(), "families": families()}
    text = json.dumps(out, indent=1)
    print(text)
    if len(sys.argv) > 1:
        Path = __import__("pathlib").Path
        Path(sys.argv[1]).write_text(text)


if __name__ == "__main__":
    main()
