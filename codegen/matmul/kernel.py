"""Candidates for one projection: cuBLAS on the adapter's (padded) weight, or a Triton GEMM.

"cublas": torch.mm / torch.addmm on the weight as the adapter holds it. Where the adapter
padded the weight (n_pad > n), the product is computed n rounded up to a multiple of 64, 128
or 256 columns wide (a config each where the widths differ: which multiple tiles best for
cuBLAS is measured by the search, not assumed), into a buffer whose leading dimension is
aligned for cuBLAS's vector loads and stores (GPT-2's LM head, vocab 50257, ran at about 96
TFLOP/s unpadded on an H200, 8x under the measured peak; issue 26). The adapter holds the
weight padded to the widest choice and hands a candidate its own `n_pad`-wide buffer, sliced
afterwards, so every width is a view and nothing is copied (the verifier passes that same
buffer: reference.make_out); given an `n`-wide `out` (a caller of its own), the candidate
computes into a padded buffer and copies.

Not searched: the other weight layout (a (K, N) contiguous copy of a Linear's (N, K) weight
for cuBLAS's NN kernels). The adapter must hold the layout before it learns which candidate
won (the chooser hands it a forward, not a config), so that would mean holding both copies
of every padded weight, or a chooser that reports the winning config.

Triton: one fp32 accumulator per (BM, BN) output tile, the bias added in the epilogue and one
rounding to the output dtype; the weight is read through its strides, so both layouts run the
same kernel. Tiles are numbered in grouped order (codegen.matmul_epilogue's `_tile`: GROUP_M
row blocks share a column block, so programs running together reuse weight tiles from L2).
Loads wrap rows and columns past the edge back into the tensor instead of masking them
(values nobody stores); the store is masked, so any output strides work, `n`-wide or padded.

Precision: fp32 inputs use input_precision="ieee" (torch's fp32 matmul does not use TF32 by
default); 16-bit inputs multiply exactly on the tensor cores and accumulate in fp32. Under the
CPU interpreter tl.dot is numpy's fp32 matmul; bf16 checks run on a GPU.
"""

from __future__ import annotations

import json
import textwrap

import triton
import triton.language as tl

from codegen.dtypes import element_size
from codegen.matmul.reference import MAX_BLOCK_M, PAD_CHOICES, padded
from codegen.matmul_epilogue.kernel import _tile
from core.family import Case
from core.source import kernel_source


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, n_rows, x_row_stride, x_col_stride,
                   w_n_stride, w_k_stride, out_row_stride, out_col_stride,
                   K: tl.constexpr, N: tl.constexpr, HAS_BIAS: tl.constexpr,
                   INPUT_PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, GROUP_M: tl.constexpr, GELU_TANH: tl.constexpr):
    row_block, col_block = _tile(tl.program_id(0), n_rows, N, BM, BN, GROUP_M)
    # int64: rows * stride passes 2**31 for the LM head's logits at 43k tokens of vocab 50257
    rows = row_block.to(tl.int64) * BM + tl.arange(0, BM)
    cols = col_block.to(tl.int64) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    x_ptrs = x_ptr + (rows % n_rows)[:, None] * x_row_stride + ks[None, :] * x_col_stride
    w_ptrs = w_ptr + (cols % N)[None, :] * w_n_stride + ks[:, None] * w_k_stride
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        if K % BK == 0:  # decided at compile time: every step is a full BK
            x = tl.load(x_ptrs)
            w = tl.load(w_ptrs)
        else:  # the last step is partial: zeros past K add nothing to the dot
            k_in = ks < K - k
            x = tl.load(x_ptrs, mask=k_in[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_in[:, None], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=INPUT_PRECISION)
        x_ptrs += BK * x_col_stride
        w_ptrs += BK * w_k_stride
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols % N).to(tl.float32)[None, :]
    if GELU_TANH:  # codegen.matmul_gelu's epilogue: 1 + tanh(z) = 2 sigmoid(2z)
        z = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
        acc = 0.5 * acc * (2.0 * tl.sigmoid(2.0 * z))
    out_ptrs = out_ptr + rows[:, None] * out_row_stride + cols[None, :] * out_col_stride
    mask = (rows[:, None] < n_rows) & (cols[None, :] < N)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# (BM, BN, BK, num_warps, num_stages, GROUP_M), small tiles to large; BK counts 16-bit
# elements (an fp32 case takes half as many per step: the same bytes per stage).
PREFILL_TILES = (
    (64, 64, 64, 4, 4, 8),
    (64, 128, 64, 4, 4, 8),
    (128, 64, 64, 4, 4, 8),
    (128, 128, 32, 8, 4, 8),
    (128, 128, 64, 8, 3, 8),
    (128, 256, 64, 8, 3, 8),
)
# Few rows (decode, short prompts): the weight is the traffic; narrow column blocks cover the
# SMs, long K steps keep the loads wide.
FEW_ROWS_TILES = (
    (16, 32, 128, 4, 4, 8),
    (16, 64, 128, 4, 4, 8),
    (32, 64, 128, 4, 4, 8),
    (64, 64, 128, 4, 3, 8),
)
FEW_ROWS = 64

assert max(t[0] for t in PREFILL_TILES + FEW_ROWS_TILES) == MAX_BLOCK_M


def _config(tile: tuple, elem_bytes: int) -> dict:
    bm, bn, bk, warps, stages, group_m = tile
    return {"impl": "triton", "BM": bm, "BN": bn, "BK": max(16, bk * 2 // elem_bytes),
            "num_warps": warps, "num_stages": stages, "GROUP_M": group_m}


def cublas_configs(case: Case) -> list[dict]:
    """cuBLAS computing `padded(n, pad)` columns for each pad of PAD_CHOICES that gives a
    distinct width (on GPT-2's LM head 50304, 50304 and 50432: two), widest first, so the
    narrowest (the fewest wasted columns) comes last."""
    widths = {}
    for pad in sorted(PAD_CHOICES, reverse=True):
        widths.setdefault(padded(case["n"], pad), pad)
    return [{"impl": "cublas", "pad": pad} for pad in widths.values()]


def search_space(case: Case) -> list[dict]:
    """The Triton tiles by area, then the cuBLAS widths; the last (cuBLAS at the narrowest
    padded width) is the one a CPU run uses (a single config there: the cheapest for the
    interpreter, and one that carries the padding)."""
    tiles = FEW_ROWS_TILES if case["rows"] <= FEW_ROWS else PREFILL_TILES
    configs = sorted((_config(t, element_size(case)) for t in tiles),
                     key=lambda c: c["BM"] * c["BN"])
    return configs + cublas_configs(case)


def input_precision(dtype: str) -> str:
    return "ieee" if dtype == "float32" else "tf32"


_HEADER = '''\
"""Projection candidate ({impl}): out = x @ W{t} (+ b), {layout} layout.

Generated by codegen.matmul.kernel.render. {how} Specialised for k={k}, n={n} (weight
{n_pad} columns wide as the adapter holds it), {dtype}, bias={bias}; tuned for {rows} rows.
case:   {case_json}
config: {config_json}
"""

import torch

K = {k}
N = {n}
N_PAD = {n_pad}
LAYOUT = {layout!r}
HAS_BIAS = {bias}
DTYPE = {dtype!r}
TORCH_DTYPE = getattr(torch, DTYPE)
BAKED_PARAMS = {{"n": N, "layout": LAYOUT}}


def _check(x, w, b, out, params):
    if params and params != BAKED_PARAMS:
        raise ValueError(f"specialised for {{BAKED_PARAMS}}, called with {{params}}")
    wshape = (N_PAD, K) if LAYOUT == "linear" else (K, N_PAD)
    if (x.shape[-1] != K or tuple(w.shape) != wshape or out.shape[-1] not in (N, N_PAD)
            or out.numel() // out.shape[-1] != x.numel() // K or (b is None) == HAS_BIAS
            or (b is not None and tuple(b.shape) != (N_PAD,))):
        raise ValueError(f"expected x (..., {{K}}), weight {{wshape}}, bias ({{N_PAD}},) "
                         f"{{'given' if HAS_BIAS else 'absent'}}, out (..., {{N}}) or "
                         f"(..., {{N_PAD}}); got {{tuple(x.shape)}}, {{tuple(w.shape)}}, "
                         f"{{None if b is None else tuple(b.shape)}}, {{tuple(out.shape)}}")
    if not all(t.dtype == TORCH_DTYPE for t in (x, w, out) + (() if b is None else (b,))):
        raise ValueError(f"specialised for {{DTYPE}} tensors")
'''

_CUBLAS = '''\

# The columns computed: n padded to a multiple of {pad} (searched per shape), a view of the
# adapter's {n_pad}-wide weight; the output's row stride stays the buffer's.
N_COMPUTE = {n_compute}


def forward(x, w, b=None, *, out, **params) -> None:
    """x: (..., K); w, b: the adapter's weight and bias ({n_pad} columns); out: (..., N), or
    (..., N_PAD) when the caller slices its own padded buffer (nothing copied then)."""
    _check(x, w, b, out, params)
    x = x.reshape(-1, K)
    dst = out.view(-1, out.shape[-1])
    if dst.shape[0] == 0:
        return
    # (K, N_COMPUTE): cuBLAS takes the transposed view as given, no copy
    wt = w[:N_COMPUTE].t() if LAYOUT == "linear" else w[:, :N_COMPUTE]
    wide = dst.shape[1] == N_PAD
    res = dst[:, :N_COMPUTE] if wide else torch.empty((dst.shape[0], N_COMPUTE),
                                                      dtype=dst.dtype, device=dst.device)
    if b is None:
        torch.mm(x, wt, out=res)
    else:
        torch.addmm(b[:N_COMPUTE], x, wt, out=res)
    if not wide:
        dst.copy_(res[:, :N])
'''

_TRITON = '''\

import triton
import triton.language as tl

from codegen.launch import cdiv, launcher

INPUT_PRECISION = {precision!r}  # {why}
BM = {BM}
BN = {BN}
BK = {BK}
GROUP_M = {GROUP_M}
NUM_WARPS = {num_warps}
NUM_STAGES = {num_stages}
N_COL_BLOCKS = {n_col_blocks}


{tile_src}

{kernel_src}

_kernel = launcher(_linear_kernel, K=K, N=N, HAS_BIAS=HAS_BIAS,
                   INPUT_PRECISION=INPUT_PRECISION, BM=BM, BN=BN, BK=BK, GROUP_M=GROUP_M,
                   GELU_TANH=False, num_warps=NUM_WARPS, num_stages=NUM_STAGES)


def forward(x, w, b=None, *, out, **params) -> None:
    """x: (..., K); w, b: the adapter's weight and bias; out: (..., N) or (..., N_PAD) (only
    its first N columns are written)."""
    _check(x, w, b, out, params)
    x = x.reshape(-1, K)
    dst = out.view(-1, out.shape[-1])
    rows = x.shape[0]
    if rows == 0:
        return
    # (n, k) strides of the weight: a Linear's rows are outputs, a Conv1D's columns
    wn, wk = (w.stride(0), w.stride(1)) if LAYOUT == "linear" else (w.stride(1), w.stride(0))
    _kernel((cdiv(rows, BM) * N_COL_BLOCKS,), x, w, w if b is None else b, dst, rows,
            x.stride(0), x.stride(1), wn, wk, dst.stride(0), dst.stride(1))
'''


def render(config: dict, case: Case) -> str:
    impl = config.get("impl", "triton")
    fields = dict(case, case_json=json.dumps(case), config_json=json.dumps(config), impl=impl,
                  t="^T" if case["layout"] == "linear" else "")
    if impl == "cublas":
        pad = config.get("pad", PAD_CHOICES[0])
        fields.update(pad=pad, n_compute=padded(case["n"], pad))
        fields["how"] = (f"torch.mm/addmm on the weight, computed {fields['n_compute']} "
                         f"columns wide (n padded to a multiple of {pad}) where the adapter "
                         "padded it (aligned leading dimension).")
        return _HEADER.format(**fields) + _CUBLAS.format(**fields)
    precision = input_precision(case["dtype"])
    fields.update(config, how=(f"One fp32 accumulator per ({config['BM']} x {config['BN']}) "
                               "tile, bias in the epilogue, one rounding."),
                  precision=precision,
                  why=("torch's fp32 matmul does not use TF32" if precision == "ieee"
                       else "no effect on 16-bit operands"),
                  n_col_blocks=-(-case["n"] // config["BN"]),
                  tile_src=kernel_source(_tile), kernel_src=kernel_source(_linear_kernel))
    return _HEADER.format(**fields) + textwrap.dedent(_TRITON.format(**fields))
