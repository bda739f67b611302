"""Probe: does one wgmma over both weights bring the gated dual GEMM to cuBLAS's rate?

Issue 29: the patched b8 s1024 passes spend most of their time in GEMMs, and the dual GEMM
(codegen/matmul_epilogue, Triton, TMA, persistent) runs slower per FLOP than cuBLAS's plain
GEMMs beside it: on an H100 about 676 against 740 TFLOP/s in Llama-3.2-1B's pass (13.0 ms
over 16 calls) and 637 against 707 in Gemma-2B's (31.1 ms over 18). At cuBLAS's rate the two
passes would be about 1.1 and 3.1 ms shorter: #29's 1.6x and 1.35x.

The family's kernel issues two dots per K step, x (BM x BK) against a gate and an up tile
(BN x BK each), into two (BM x BN) accumulators: each warpgroup reads its x rows from shared
memory twice, once per dot. Here the two weight tiles arrive as one (2, BN, BK) box of a
three-dimensional TMA descriptor whose leading stride is the distance between the two weight
tensors (no copy, no packed buffer: TMA never touches what lies between them), viewed as
(2 BN, BK), and one dot makes a (BM, 2 BN) accumulator, the n = 256 wgmma cuBLAS's widest
tiles use; the epilogue splits it into gate and up. Same registers per thread as the family's
two accumulators, x read once per K step. The kernel is the family's own
(`_gated_gemm_wide_kernel`, its "WIDE" configs); this probe times it at fixed tiles beside
the two-dot kernel and cuBLAS, outside any model.

Per MLP shape at 8192 rows (bf16): cuBLAS's F.linear over [gate; up] stacked (the rate to
reach; the activation not included), the family's TMA kernel at its configs, and this one;
each output checked against the fp32 reference first (max abs error beside the family's).
Timed with verify.timing.bench (CUDA events, L2 flushed, medians).

GPU only: python3 benchmarks/probes/dual_gemm_wide.py OUT.json. The launch is checked on the
CPU, in the interpreter, by tests/benchmarks/test_dual_gemm_wide_probe.py.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F
import triton

from codegen.dtypes import dtype_name
from codegen.launch import ensure_allocator
from codegen.matmul_epilogue.kernel import (
    _gated_gemm_tma_kernel,
    _gated_gemm_wide_kernel,
    input_precision,
)
from verify.timing import bench

# (model, hidden, intermediate, activation)
SHAPES = (("llama-3.2-1b", 2048, 8192, "silu"), ("qwen2.5-0.5b", 896, 4864, "silu"),
          ("gemma-2b", 2048, 16384, "gelu_tanh"), ("phi-3-mini", 3072, 8192, "silu"))
ROWS = 8192
# (BM, BN, BK, num_warps, stages): BN is each weight's tile width, so the accumulator is
# BM x 2 BN. 128 x 128 is the family's tile; 64 x 128 with 4 warps gives one warpgroup a
# 64 x 256 accumulator as cuBLAS's 128x256 tiles give each of their two.
WIDE = ((128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (64, 128, 64, 4, 4), (128, 64, 64, 8, 4))
FAMILY = ((128, 128, 64, 8, 3, False), (128, 128, 64, 8, 4, True))


def _programs(tiles: int, device: torch.device) -> int:
    if device.type != "cuda":
        return tiles  # the interpreter: one program per tile
    ensure_allocator()
    return min(tiles, torch.cuda.get_device_properties(device).multi_processor_count)


def wide(x, w_gate, w_up, out, act: str, bm: int, bn: int, bk: int, warps: int,
         stages: int) -> None:
    """out = act(x w_gate^T) * (x w_up^T), both weights read through one descriptor."""
    rows, hidden = x.shape
    cols = w_gate.shape[0]
    size = x.element_size()
    up_first = w_up.data_ptr() < w_gate.data_ptr()
    lo, hi = (w_up, w_gate) if up_first else (w_gate, w_up)
    pair = (hi.data_ptr() - lo.data_ptr()) // size
    assert (hi.data_ptr() - lo.data_ptr()) % 16 == 0 and w_gate.stride() == w_up.stride()
    tiles = triton.cdiv(rows, bm) * triton.cdiv(cols, bn)
    programs = _programs(tiles, x.device)
    _gated_gemm_wide_kernel[(programs,)](
        x, lo, out, rows, x.stride(0), pair, lo.stride(0), out.stride(0), programs,
        HIDDEN=hidden, COLS=cols, UP_FIRST=up_first, GELU_TANH=act == "gelu_tanh",
        INPUT_PRECISION=input_precision(dtype_name(x.dtype)), BM=bm, BN=bn, BK=bk, GROUP_M=8,
        STAGES=stages, num_warps=warps)


def family(x, w_gate, w_up, out, act: str, bm: int, bn: int, bk: int, warps: int,
           stages: int, subtile: bool) -> None:
    """The family's TMA kernel (codegen/matmul_epilogue), launched as its rendered source
    does."""
    rows, hidden = x.shape
    cols = w_gate.shape[0]
    tiles = triton.cdiv(rows, bm) * triton.cdiv(cols, bn)
    programs = _programs(tiles, x.device)
    _gated_gemm_tma_kernel[(programs,)](
        x, w_gate, w_up, out, rows, x.stride(0), w_gate.stride(0), w_up.stride(0),
        out.stride(0), programs, HIDDEN=hidden, COLS=cols, GELU_TANH=act == "gelu_tanh",
        INPUT_PRECISION=input_precision(dtype_name(x.dtype)), BM=bm, BN=bn, BK=bk, GROUP_M=8,
        STAGES=stages, SUBTILE=subtile, num_warps=warps)


def reference(x, w_gate, w_up, act: str) -> torch.Tensor:
    g, u = x.double() @ w_gate.double().t(), x.double() @ w_up.double().t()
    a = F.gelu(g, approximate="tanh") if act == "gelu_tanh" else F.silu(g)
    return a * u


def _inputs(rows, hidden, cols, dtype, device, up_first=False):
    torch.manual_seed(0)
    x = torch.randn(rows, hidden, dtype=dtype, device=device)
    ws = [torch.randn(cols, hidden, dtype=dtype, device=device) / hidden ** 0.5
          for _ in range(2)]
    # the order in memory decides UP_FIRST: both orders get checked
    ws.sort(key=lambda t: t.data_ptr(), reverse=up_first)
    return x, ws[0], ws[1]


def one_shape(model: str, hidden: int, inter: int, act: str) -> dict:
    x, wg, wu = _inputs(ROWS, hidden, inter, torch.bfloat16, "cuda")
    out = torch.empty(ROWS, inter, dtype=torch.bfloat16, device="cuda")
    ref = reference(x, wg, wu, act)
    flops = 2 * 2 * ROWS * hidden * inter
    stacked = torch.cat([wg, wu])
    row = {"model": model, "hidden": hidden, "inter": inter, "act": act, "us": {},
           "tflops": {}, "max_abs_error": {}}

    def put(name, fn, check=True):
        try:
            if check:
                out.zero_()
                fn()
                row["max_abs_error"][name] = (out.double() - ref).abs().max().item()
            us = bench(fn, device="cuda").median_ms * 1e3
        except Exception as exc:  # a config this Triton cannot compile is a finding
            row["us"][name] = f"{type(exc).__name__}: {str(exc)[:200]}"
            print(model, name, row["us"][name], flush=True)
            return
        row["us"][name], row["tflops"][name] = us, flops / us / 1e6
        print(f"{model:13s} {name:34s} {us:8.1f} us {flops / us / 1e6:6.1f} TFLOP/s "
              f"err {row['max_abs_error'].get(name, float('nan')):.3g}", flush=True)

    put("cublas [gate;up] (no activation)", lambda: F.linear(x, stacked), check=False)
    for bm, bn, bk, warps, stages, sub in FAMILY:
        put(f"family {bm}x{bn}x{bk} w{warps} s{stages}{' sub' if sub else ''}",
            lambda c=(bm, bn, bk, warps, stages, sub): family(x, wg, wu, out, act, *c))
    for bm, bn, bk, warps, stages in WIDE:
        put(f"wide {bm}x2*{bn}x{bk} w{warps} s{stages}",
            lambda c=(bm, bn, bk, warps, stages): wide(x, wg, wu, out, act, *c))
    return row


def main(path: str) -> None:
    rows = [one_shape(*shape) for shape in SHAPES]
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                   "triton": triton.__version__, "rows_per_case": ROWS, "rows": rows}, f,
                  indent=1)


if __name__ == "__main__":
    if len(sys.argv) != 2 or not torch.cuda.is_available():
        raise SystemExit("usage (GPU only): python3 benchmarks/probes/dual_gemm_wide.py OUT.json")
    main(sys.argv[1])
