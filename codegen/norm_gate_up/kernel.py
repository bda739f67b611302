"""Triton kernel for a decoder layer's residual add and post-attention RMSNorm and its gated
MLP's gate and up projections with the activation and multiply, at a decode step, in one
launch: normed = rms_norm(residual + x), h = act(normed Wg^T) * (normed Wu^T).

The grid is matmul_epilogue's decode GEMV's (codegen/matmul_epilogue/gemv.py): one program per
BLOCK_N output columns, streaming BLOCK_N rows of both weights over all of hidden into two fp32
accumulators, the activation and the product on the sums, one rounding. Before it every
program forms x's rows (plus the residual's, rounded once as HF's add rounds) and sums their
squares itself (codegen/norm_prologue.py), then normalises each BLOCK_K slice it multiplies;
program 0 also stores the slices of total and normed, so the layer's residual stream and the
norm's output are written in the same launch (at most MAX_ROWS rows of 2-8 KB: x and the
residual are read from L2 by every program, some 2 x 4 KB x 256-2048 programs at one row of
Llama-3.2-1B against its 32 MiB of gate/up weight).

What it saves is the add_rmsnorm kernel's node in the graphed step (a few microseconds);
the search and the in-model measurement decide whether the extra L2 reads cost more.

DOT (a config key, searched from gemv's DOT_MIN_ROWS rows, the guess from DOT_LEAD_ROWS, as in
the gated GEMV it extends): the rows' totals form one (DOT_ROWS, BLOCK_K) tile, zeros past the
last (`_rows_rstd`, `_normed_rows`: program 0 stores the real rows' total and normed), and
each step is one tensor-core dot per weight (gemv's `_dot_rows`; accumulators transposed back
for the activation) instead of the row loop's CUDA-core products, which at 8 rows made the
gated GEMV 2.7x slower than cuBLAS's chain (benchmarks/results/decode-1207-h100/
gemv_table.md). PDL and PREFETCH are as without it.

Numerics: the total is HF's one rounded add, the normed element HF's (codegen/norm_prologue.py,
fp32 as without DOT); the products of the normed dtype values and the weights are exact in the
fp32 sums (the fp32 dot IEEE, not TF32), summed in another order than the row loop's, the
activation and the product on the sums, one rounding: within the family's order bound.
"""

from __future__ import annotations

import json
import textwrap

import triton
import triton.language as tl

from codegen.gemv.kernel import (
    DOT_ROWS,
    _dot_rows,
    _rows_first,
    _zero_acc,
    with_dot_configs,
)
from codegen.launch import cdiv, guessed_tiles
from codegen.matmul_epilogue.epilogue import _gated
from codegen.norm_gate_up.reference import MAX_ROWS
from codegen.norm_prologue import _normed, _normed_rows, _row_rstd, _row_total, _rows_rstd, sources
from codegen.prefetch import _prefetch_slab
from core.family import Case
from core.source import kernel_source

BLOCK_NS = (4, 8, 16, 32)
BLOCK_KS = (128, 256, 512)
NUM_WARPS, NUM_STAGES = 4, 3
MAX_CONFIGS = 4
DOT_CONFIGS = 3  # from gemv's DOT_MIN_ROWS rows, besides MAX_CONFIGS of the row loop
SMS = 132  # the H200's: the ordering aims for about four programs per SM (a guess to order by)
TARGET_PROGRAMS = 4 * SMS
MIN_TILE = 2048  # weight elements per step (each weight) under which a tile is not searched


@triton.jit
def _gate_up_tiles(wg_ptr, wu_ptr, nw_ptr, n64, n_ok, offs_k, k_ok, HIDDEN: tl.constexpr,
                   EVEN_K: tl.constexpr):
    """Both weights' (BLOCK_N, BLOCK_K) tiles at columns offs_k and the norm weight's slice."""
    if EVEN_K:
        mask = n_ok[:, None]
    else:
        mask = n_ok[:, None] & k_ok[None, :]
    wg = tl.load(wg_ptr + n64 * HIDDEN + offs_k[None, :], mask=mask, other=0.0)
    wu = tl.load(wu_ptr + n64 * HIDDEN + offs_k[None, :], mask=mask, other=0.0)
    nw = tl.load(nw_ptr + offs_k, mask=k_ok, other=0.0)
    return wg, wu, nw


@triton.jit
def _gate_up_step(acc_gate, acc_up, wg, wu, nw, x_ptr, r_ptr, n_ptr, t_ptr, offs_k, k_ok,
                  offs_m, rstd, own_rows, rows, x_sm, x_sk, HIDDEN: tl.constexpr,
                  HAS_RESIDUAL: tl.constexpr, OFFSET: tl.constexpr, CAST_FIRST: tl.constexpr,
                  BLOCK_M: tl.constexpr, DOT: tl.constexpr):
    """Both accumulators plus each row's normed total (program 0 storing it and the total)
    times the tiles: DOT, the rows as one tile (zeros past the last) through one tensor-core
    dot per weight, accumulators (BLOCK_N, BLOCK_M); else row by row on CUDA cores."""
    if DOT:
        m_ok = offs_m < rows
        mask = m_ok[:, None] & k_ok[None, :]
        mine = mask & (offs_m < own_rows)[:, None]
        xn = _normed_rows(x_ptr + offs_m * x_sm, r_ptr + offs_m * HIDDEN, n_ptr + offs_m * HIDDEN,
                          t_ptr + offs_m * HIDDEN, offs_k, mask, mine, x_sk, nw, rstd,
                          HAS_RESIDUAL, OFFSET, CAST_FIRST)
        acc_gate = _dot_rows(acc_gate, wg, xn)
        acc_up = _dot_rows(acc_up, wu, xn)
    else:
        wg = wg.to(tl.float32)
        wu = wu.to(tl.float32)
        for m in tl.static_range(BLOCK_M):
            row = m % rows
            t = _row_total(x_ptr + row * x_sm + offs_k * x_sk, r_ptr + row * HIDDEN + offs_k,
                           k_ok, HAS_RESIDUAL)
            rm = tl.sum(tl.where(offs_m == m, rstd, 0.0), axis=0)
            xn = _normed(t, nw, rm, OFFSET, CAST_FIRST)
            # a vector compare: the interpreter refuses a scalar bool in a mask
            mine = k_ok & (offs_k * 0 + own_rows > m)
            tl.store(n_ptr + row * HIDDEN + offs_k, xn, mask=mine)
            if HAS_RESIDUAL:
                tl.store(t_ptr + row * HIDDEN + offs_k, t, mask=mine)
            xf = xn.to(tl.float32)[None, :]
            part_gate = tl.sum(wg * xf, axis=1)
            part_up = tl.sum(wu * xf, axis=1)
            if BLOCK_M == 1:
                acc_gate += part_gate[None, :]
                acc_up += part_up[None, :]
            else:
                here = offs_m[:, None] == m
                acc_gate = tl.where(here, acc_gate + part_gate[None, :], acc_gate)
                acc_up = tl.where(here, acc_up + part_up[None, :], acc_up)
    return acc_gate, acc_up


@triton.jit
def _norm_gate_up_kernel(x_ptr, r_ptr, nw_ptr, wg_ptr, wu_ptr, n_ptr, o_ptr, t_ptr, rows, x_sm,
                         x_sk, eps, HIDDEN: tl.constexpr, COLS: tl.constexpr,
                         EVEN_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                         OFFSET: tl.constexpr, CAST_FIRST: tl.constexpr,
                         GELU_TANH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, DOT: tl.constexpr = False,
                         PREFETCH: tl.constexpr = False, PDL: tl.constexpr = False):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < rows
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < COLS
    n64 = offs_n.to(tl.int64)[:, None]
    if PDL:  # codegen/pdl.py: both weights' and the norm weight's first tiles, then the wait
        # no kernel of a decode step writes a weight, so they load while the previous kernel
        # finishes; x and the residual (the rstd prologue's first reads) and every output
        # wait for it
        offs_k = tl.arange(0, BLOCK_K)
        k_ok = offs_k < HIDDEN
        wg, wu, nw = _gate_up_tiles(wg_ptr, wu_ptr, nw_ptr, n64, n_ok, offs_k, k_ok, HIDDEN,
                                    EVEN_K)
        if PREFETCH:  # the rest of both slabs into L2 while the predecessor finishes
            _prefetch_slab(wg_ptr, pid * BLOCK_N, COLS, HIDDEN, 1, BLOCK_K, HIDDEN, BLOCK_N,
                           HIDDEN - BLOCK_K)
            _prefetch_slab(wu_ptr, pid * BLOCK_N, COLS, HIDDEN, 1, BLOCK_K, HIDDEN, BLOCK_N,
                           HIDDEN - BLOCK_K)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if DOT:  # the rows as one tile, those past the last zeros (the dot's padding)
        rstd = _rows_rstd(x_ptr + offs_m * x_sm, r_ptr + offs_m * HIDDEN, m_ok, x_sk, eps,
                          HIDDEN, BLOCK_M, BLOCK_K, HAS_RESIDUAL)
    else:
        rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
        for m in tl.static_range(BLOCK_M):
            row = m % rows  # rows past the last wrap back: values nobody stores
            r = _row_rstd(x_ptr + row * x_sm, r_ptr + row * HIDDEN, x_sk, eps, HIDDEN, BLOCK_K,
                          HAS_RESIDUAL)
            rstd = tl.where(offs_m == m, r, rstd)
    # the rows whose total and normed this program stores: all for program 0, none for the
    # rest (every program computes the same values)
    own_rows = tl.where(pid == 0, rows, 0)
    acc_gate = _zero_acc(BLOCK_M, BLOCK_N, DOT)
    acc_up = _zero_acc(BLOCK_M, BLOCK_N, DOT)
    if PDL:  # the first step, on the tiles loaded before the wait
        acc_gate, acc_up = _gate_up_step(acc_gate, acc_up, wg, wu, nw, x_ptr, r_ptr, n_ptr,
                                         t_ptr, offs_k, k_ok, offs_m, rstd, own_rows, rows,
                                         x_sm, x_sk, HIDDEN, HAS_RESIDUAL, OFFSET, CAST_FIRST,
                                         BLOCK_M, DOT)
    for k0 in range(PDL * BLOCK_K, HIDDEN, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < HIDDEN
        wg, wu, nw = _gate_up_tiles(wg_ptr, wu_ptr, nw_ptr, n64, n_ok, offs_k, k_ok, HIDDEN,
                                    EVEN_K)
        acc_gate, acc_up = _gate_up_step(acc_gate, acc_up, wg, wu, nw, x_ptr, r_ptr, n_ptr,
                                         t_ptr, offs_k, k_ok, offs_m, rstd, own_rows, rows,
                                         x_sm, x_sk, HIDDEN, HAS_RESIDUAL, OFFSET, CAST_FIRST,
                                         BLOCK_M, DOT)
    y = _gated(_rows_first(acc_gate, DOT), _rows_first(acc_up, DOT), GELU_TANH)
    tl.store(o_ptr + offs_m[:, None] * COLS + offs_n[None, :], y.to(o_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _config(bn: int, bk: int, dot: bool = False) -> dict:
    return {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": NUM_WARPS, "num_stages": NUM_STAGES,
            **({"DOT": True} if dot else {})}


def search_space(case: Case) -> list[dict]:
    """BLOCK_N x BLOCK_K tiles (BLOCK_K <= hidden where one fits, MIN_TILE elements and more),
    at most MAX_CONFIGS, guessed best first (the widest loads, then grids nearest
    TARGET_PROGRAMS programs); last the interpreter's cheapest (the widest tile). From gemv's
    DOT_MIN_ROWS rows, DOT_CONFIGS tensor-core ones too (`with_dot_configs`, both weights'
    tiles staged), first from DOT_LEAD_ROWS rows: the family's guess (Family.leads)."""
    hidden, cols = case["hidden"], case["cols"]
    tiles = guessed_tiles(hidden, lambda bn: cdiv(cols, bn), BLOCK_NS, BLOCK_KS, MIN_TILE, SMS,
                          TARGET_PROGRAMS, MAX_CONFIGS)
    return with_dot_configs([_config(bn, bk) for bn, bk in tiles], case, hidden,
                            lambda bn: cdiv(cols, bn), 2, DOT_CONFIGS,
                            lambda bn, bk: _config(bn, bk, dot=True))


_HOST = '''\
_kernels = {}


def _kernel(block_m):
    """The launcher for a row block of `block_m` (a power of two up to MAX_ROWS)."""
    if block_m not in _kernels:
        _kernels[block_m] = launcher(
            _norm_gate_up_kernel, HIDDEN=HIDDEN, COLS=COLS, EVEN_K=EVEN_K,
            HAS_RESIDUAL=HAS_RESIDUAL, OFFSET=OFFSET, CAST_FIRST=CAST_FIRST,
            GELU_TANH=GELU_TANH, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT=DOT,
            num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return _kernels[block_m]


def forward(x, norm_weight, w_gate, w_up, residual=None, *, out, eps, offset, cast_first,
            act) -> None:
    """x: (rows, HIDDEN), any strides, at most MAX_ROWS rows; norm_weight: (HIDDEN,); w_gate,
    w_up: contiguous (COLS, HIDDEN); residual: contiguous (rows, HIDDEN) where specialised
    with one; out: contiguous (normed (rows, HIDDEN), h (rows, COLS)[, total (rows, HIDDEN)])."""
    if (float(offset), bool(cast_first), act) != (OFFSET, CAST_FIRST, ACT):
        raise ValueError(f"specialised for offset={OFFSET}, cast_first={CAST_FIRST}, "
                         f"act={ACT}")
    if x.dim() != 2 or x.shape[1] != HIDDEN:
        raise ValueError(f"expected x (rows, {HIDDEN}), got {tuple(x.shape)}")
    rows = x.shape[0]
    if rows > MAX_ROWS:
        raise ValueError(f"at most {MAX_ROWS} rows, got {rows}")
    if (residual is None) == HAS_RESIDUAL or len(out) != 2 + HAS_RESIDUAL:
        raise ValueError(f"specialised {'with' if HAS_RESIDUAL else 'without'} a residual")
    shapes = [(norm_weight, (HIDDEN,)), (w_gate, (COLS, HIDDEN)), (w_up, (COLS, HIDDEN)),
              (out[0], (rows, HIDDEN)), (out[1], (rows, COLS))]
    if HAS_RESIDUAL:
        shapes += [(residual, (rows, HIDDEN)), (out[2], (rows, HIDDEN))]
    for t, shape in shapes:
        if tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"expected a contiguous {shape}, got {tuple(t.shape)}")
        if t.dtype != TORCH_DTYPE or x.dtype != TORCH_DTYPE:
            raise ValueError(f"specialised for {DTYPE} tensors")
    if rows == 0:
        return
    normed, h = out[0], out[1]
    r, total = (residual, out[2]) if HAS_RESIDUAL else (x, normed)
    _kernel(max(MIN_BLOCK_M, 1 << (rows - 1).bit_length()))(
        (N_BLOCKS,), x, r, norm_weight, w_gate, w_up, normed, h, total, rows, x.stride(0),
        x.stride(1), float(eps))
'''


def render(config: dict, case: Case) -> str:
    hidden, cols, act, dtype = case["hidden"], case["cols"], case["act"], case["dtype"]
    bn, bk = config["BLOCK_N"], config["BLOCK_K"]
    offset, cast_first, residual = float(case["offset"]), bool(case["cast_first"]), \
        bool(case["residual"])
    dot = bool(config.get("DOT", False))
    sums = f"one tensor-core dot per weight and step, the normed rows padded to {DOT_ROWS}, " \
        "fp32 sums" if dot else "fp32 sums"
    head = textwrap.dedent(f'''\
        """Residual add + RMSNorm + gated gate/up GEMV candidate: total = residual + x
        (where specialised with a residual), normed = rms_norm(total), h = act(normed Wg^T) *
        (normed Wu^T).

        Generated by codegen.norm_gate_up.kernel.render. Specialised for hidden={hidden},
        cols={cols}, {dtype}, act={act}, residual={residual}, offset={offset},
        cast_first={cast_first}; rows 1 to {MAX_ROWS}; tuned for {case["rows"]} rows. One
        launch of {cdiv(cols, bn)} programs, each {bn} rows of both weights x {bk} columns
        per step, {config["num_warps"]} warps, {config["num_stages"]} stages. {sums}, the
        activation and the product on them, one rounding.

        case:   {json.dumps(case)}
        config: {json.dumps(config)}
        """

        import torch
        import triton
        import triton.language as tl

        from codegen.launch import launcher

        HIDDEN = {hidden}
        COLS = {cols}
        DTYPE = "{dtype}"
        TORCH_DTYPE = getattr(torch, DTYPE)
        ACT = "{act}"
        GELU_TANH = {act == "gelu_tanh"}
        HAS_RESIDUAL = {residual}
        OFFSET = {offset}
        CAST_FIRST = {cast_first}
        MAX_ROWS = {MAX_ROWS}
        BLOCK_N = {bn}
        BLOCK_K = {bk}
        DOT = {dot}
        MIN_BLOCK_M = {DOT_ROWS if dot else 1}
        EVEN_K = {hidden % bk == 0}
        N_BLOCKS = {cdiv(cols, bn)}
        NUM_WARPS = {config["num_warps"]}
        NUM_STAGES = {config["num_stages"]}
        ''')
    return "\n\n".join([head, *sources(), kernel_source(_gated), kernel_source(_prefetch_slab),
                        *(kernel_source(f) for f in (_dot_rows, _zero_acc, _rows_first,
                                                     _gate_up_tiles, _gate_up_step,
                                                     _norm_gate_up_kernel)), _HOST])
