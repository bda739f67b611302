"""Triton kernel for a decoder layer's input RMSNorm and its attention's q, k and v projections
at a decode step, in one launch.

The grid is the grouped q/k/v projection's (codegen/qkv_proj/kernel.py): program p takes
BLOCK_N rows of Wq, Wk or Wv and streams them over k. Before its GEMV every program sums the
squares of x's rows itself (codegen/norm_prologue.py; at most MAX_ROWS rows of 2-8 KB, read
from L2 after the first program brought them in), so no program waits on another and no
second launch computes the norm; then each BLOCK_K step normalises its slice of x (x * rstd,
scaled by the norm's weight with HF's roundings, `_normed`) and multiplies it with the weight
tile. Program 0 also stores
the normed slices it computes, so `normed`, the norm's own output, is written in the same
launch: the adapter hands the attention a filled tensor.

The extra x reads are what the fusion costs: at one row of Llama-3.2-1B's 2048, 4 KB per
program, 384-768 programs, some 3 MB from L2 against the 12.6 MB of weight from HBM; the
launch it removes (an RMSNorm node in the graphed step, a few microseconds) is what it saves.
The search and the in-model measurement decide whether that pays.

DOT (a config key, searched from gemv's DOT_MIN_ROWS rows, the guess from DOT_LEAD_ROWS; see
codegen/qkv_proj/kernel.py): the rows form one (DOT_ROWS, BLOCK_K) tile, zeros past the last
(`_rows_rstd` sums each row's squares along k as the row loop does; `_normed_rows` normalises
the tile, program 0 storing its real rows), and each step is one tensor-core dot of the
weight tile by it (gemv's `_dot_rows`) instead of a CUDA-core product per row. PDL and
PREFETCH are as without it.

Numerics: the normed element is HF's (fp32 x * rstd, then Llama's cast to the dtype and the
multiply by the weight in the dtype, or Gemma's fp32 multiply by 1 + weight and one cast);
rstd's sum of squares runs in another order than torch's mean, an ulp of fp32 at most. The
GEMV's products and sums are fp32 with one rounding, as the gemv family's; DOT multiplies the
same normed dtype values (16-bit products exact in fp32, the fp32 dot IEEE, not TF32) and sums
in another order, which the family's order bound allows for.
"""

from __future__ import annotations

import json
import textwrap

import triton
import triton.language as tl

from codegen.gemv.kernel import (
    DOT_ROWS,
    _dot_rows,
    _plus_row,
    _rows_first,
    _zero_acc,
    step_sources,
)
from codegen.launch import cdiv
from codegen.norm_prologue import _normed, _normed_rows, _row_rstd, _rows_rstd, sources
from codegen.norm_qkv.reference import MAX_ROWS, WIDTHS
from codegen.prefetch import _prefetch_slab
from codegen.qkv_proj import kernel as qkv_kernel
from core.family import Case
from core.source import kernel_source


@triton.jit
def _norm_qkv_tiles(w_rows, nw_ptr, offs_k, k_ok, n_ok, EVEN_K: tl.constexpr):
    """The (BLOCK_N, BLOCK_K) weight tile at columns offs_k and the norm weight's slice."""
    if EVEN_K:
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None], other=0.0)
        nw = tl.load(nw_ptr + offs_k)
    else:
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        nw = tl.load(nw_ptr + offs_k, mask=k_ok, other=0.0)
    return w, nw


@triton.jit
def _x_starts(x_ptr, offs_m, seq, x_sb, x_ss):
    """Pointers to the starts of x's rows offs_m, x a (batch, seq, K) view of any strides."""
    return x_ptr + (offs_m // seq) * x_sb + (offs_m % seq) * x_ss


@triton.jit
def _norm_qkv_rstd(x_ptr, rows, seq, x_sb, x_ss, x_sk, eps, K: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    """rstd of each of x's rows (at most BLOCK_M): row by row, rows past the last wrapping
    back; DOT, the rows as one tile, those past the last zeros (the dot's padding)."""
    offs_m = tl.arange(0, BLOCK_M)
    if DOT:
        x_rows = _x_starts(x_ptr, offs_m, seq, x_sb, x_ss)
        rstd = _rows_rstd(x_rows, x_rows, offs_m < rows, x_sk, eps, K, BLOCK_M, BLOCK_K, False)
    else:
        rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
        for m in tl.static_range(BLOCK_M):
            row = m % rows
            x_row = x_ptr + (row // seq) * x_sb + (row % seq) * x_ss
            r = _row_rstd(x_row, x_row, x_sk, eps, K, BLOCK_K, False)
            rstd = tl.where(offs_m == m, r, rstd)
    return rstd


@triton.jit
def _norm_qkv_step(acc, w, nw, x_ptr, n_ptr, offs_k, k_ok, offs_m, rstd, normed_rows, rows,
                   seq, x_sb, x_ss, x_sk, K: tl.constexpr, OFFSET: tl.constexpr,
                   CAST_FIRST: tl.constexpr, BLOCK_M: tl.constexpr, DOT: tl.constexpr):
    """acc plus each row of x, normed (program 0 storing it), times the weight tile w: DOT,
    the rows as one tile (zeros past the last) through one tensor-core dot, acc (BLOCK_N,
    BLOCK_M); else row by row on CUDA cores, acc (BLOCK_M, BLOCK_N) (gemv's _tile_step)."""
    if DOT:
        x_rows = _x_starts(x_ptr, offs_m, seq, x_sb, x_ss)
        n_rows = n_ptr + offs_m * K
        mask = (offs_m < rows)[:, None] & k_ok[None, :]
        xn = _normed_rows(x_rows, x_rows, n_rows, n_rows, offs_k, mask,
                          mask & (offs_m < normed_rows)[:, None], x_sk, nw, rstd, False, OFFSET,
                          CAST_FIRST)
        acc = _dot_rows(acc, w, xn)
    else:
        w = w.to(tl.float32)
        for m in tl.static_range(BLOCK_M):
            row = m % rows  # rows past the last wrap back: values nobody stores
            x_ptrs = x_ptr + (row // seq) * x_sb + (row % seq) * x_ss + offs_k * x_sk
            x = tl.load(x_ptrs, mask=k_ok, other=0.0)
            r = tl.sum(tl.where(offs_m == m, rstd, 0.0), axis=0)
            xn = _normed(x, nw, r, OFFSET, CAST_FIRST)
            # a vector compare: the interpreter refuses a scalar bool in a mask
            tl.store(n_ptr + row * K + offs_k, xn, mask=k_ok & (offs_k * 0 + normed_rows > m))
            acc = _plus_row(acc, w, xn, offs_m, m, BLOCK_M)
    return acc


@triton.jit
def _norm_qkv_block(x_ptr, nw_ptr, w_ptr, b_ptr, o_ptr, n_ptr, n0, normed_rows, rows, seq,
                    x_sb, x_ss, x_sk, eps, K: tl.constexpr, N: tl.constexpr,
                    EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, OFFSET: tl.constexpr,
                    CAST_FIRST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT: tl.constexpr, PREFETCH: tl.constexpr,
                    PDL: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < rows
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * K
    acc = _zero_acc(BLOCK_M, BLOCK_N, DOT)
    if PDL:  # codegen/pdl.py: the first weight and norm weight tiles, then the wait, then x
        # no kernel of a decode step writes a weight, so they load while the previous kernel
        # finishes; x (the rstd prologue's first read), normed and the outputs wait for it
        offs_k = tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        w, nw = _norm_qkv_tiles(w_rows, nw_ptr, offs_k, k_ok, n_ok, EVEN_K)
        if PREFETCH:  # the rest of the slab into L2 while the predecessor finishes
            _prefetch_slab(w_ptr, n0, N, K, 1, BLOCK_K, K, BLOCK_N, K - BLOCK_K)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # every program sums the squares of x's rows itself: no program waits on another
    rstd = _norm_qkv_rstd(x_ptr, rows, seq, x_sb, x_ss, x_sk, eps, K, BLOCK_M, BLOCK_K, DOT)
    if PDL:  # the first step, on the tiles loaded before the wait
        acc = _norm_qkv_step(acc, w, nw, x_ptr, n_ptr, offs_k, k_ok, offs_m, rstd, normed_rows,
                             rows, seq, x_sb, x_ss, x_sk, K, OFFSET, CAST_FIRST, BLOCK_M, DOT)
    for k0 in range(PDL * BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        w, nw = _norm_qkv_tiles(w_rows, nw_ptr, offs_k, k_ok, n_ok, EVEN_K)
        acc = _norm_qkv_step(acc, w, nw, x_ptr, n_ptr, offs_k, k_ok, offs_m, rstd, normed_rows,
                             rows, seq, x_sb, x_ss, x_sk, K, OFFSET, CAST_FIRST, BLOCK_M, DOT)
    acc = _rows_first(acc, DOT)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(o_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(o_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _norm_qkv_kernel(x_ptr, nw_ptr, wq_ptr, wk_ptr, wv_ptr, bq_ptr, bk_ptr, bv_ptr, n_ptr,
                     q_ptr, k_ptr, v_ptr, rows, seq, x_sb, x_ss, x_sk, eps,
                     K: tl.constexpr, NQ: tl.constexpr, NK: tl.constexpr, NV: tl.constexpr,
                     Q_BLOCKS: tl.constexpr, K_BLOCKS: tl.constexpr, EVEN_K: tl.constexpr,
                     HAS_BIAS: tl.constexpr, OFFSET: tl.constexpr, CAST_FIRST: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT: tl.constexpr = False, PREFETCH: tl.constexpr = False,
                     PDL: tl.constexpr = False):
    pid = tl.program_id(0)
    # the rows whose normed values this program stores: all for program 0, none for the
    # rest (every program computes the same values)
    normed_rows = tl.where(pid == 0, rows, 0)
    if pid < Q_BLOCKS:
        _norm_qkv_block(x_ptr, nw_ptr, wq_ptr, bq_ptr, q_ptr, n_ptr, pid * BLOCK_N, normed_rows,
                        rows, seq, x_sb, x_ss, x_sk, eps, K, NQ, EVEN_K, HAS_BIAS, OFFSET,
                        CAST_FIRST, BLOCK_M, BLOCK_N, BLOCK_K, DOT, PREFETCH, PDL)
    elif pid < Q_BLOCKS + K_BLOCKS:
        _norm_qkv_block(x_ptr, nw_ptr, wk_ptr, bk_ptr, k_ptr, n_ptr, (pid - Q_BLOCKS) * BLOCK_N,
                        normed_rows, rows, seq, x_sb, x_ss, x_sk, eps, K, NK, EVEN_K, HAS_BIAS,
                        OFFSET, CAST_FIRST, BLOCK_M, BLOCK_N, BLOCK_K, DOT, PREFETCH, PDL)
    else:
        _norm_qkv_block(x_ptr, nw_ptr, wv_ptr, bv_ptr, v_ptr, n_ptr,
                        (pid - Q_BLOCKS - K_BLOCKS) * BLOCK_N, normed_rows, rows, seq, x_sb,
                        x_ss, x_sk, eps, K, NV, EVEN_K, HAS_BIAS, OFFSET, CAST_FIRST, BLOCK_M,
                        BLOCK_N, BLOCK_K, DOT, PREFETCH, PDL)


def search_space(case: Case) -> list[dict]:
    """The grouped q/k/v projection's tiles (same grid, same weight stream; DOT ones from
    gemv's DOT_MIN_ROWS rows, leading from DOT_LEAD_ROWS), last the interpreter's cheapest."""
    return qkv_kernel.search_space(case)


_HOST = '''\
_kernels = {}


def _kernel(block_m):
    """The launcher for a row block of `block_m` (a power of two up to MAX_ROWS)."""
    if block_m not in _kernels:
        _kernels[block_m] = launcher(
            _norm_qkv_kernel, K=K, NQ=NQ, NK=NK, NV=NV, Q_BLOCKS=Q_BLOCKS, K_BLOCKS=K_BLOCKS,
            EVEN_K=EVEN_K, HAS_BIAS=HAS_BIAS, OFFSET=OFFSET, CAST_FIRST=CAST_FIRST,
            BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT=DOT, num_warps=NUM_WARPS,
            num_stages=NUM_STAGES)
    return _kernels[block_m]


def forward(x, norm_weight, wq, wk, wv, bq=None, bk=None, bv=None, *, out, eps, offset,
            cast_first) -> None:
    """x: (rows, K) or (batch, seq, K), any strides, at most MAX_ROWS rows; norm_weight: (K,)
    contiguous; wq/wk/wv: contiguous (NQ, K), (NK, K), (NV, K); biases (n,) where specialised
    with them; out: (normed, q, k, v), contiguous, x's rows each."""
    if (float(offset), bool(cast_first)) != (OFFSET, CAST_FIRST):
        raise ValueError(f"specialised for offset={OFFSET}, cast_first={CAST_FIRST}")
    ws, bs = (wq, wk, wv), (bq, bk, bv)
    if x.dim() not in (2, 3) or x.shape[-1] != K:
        raise ValueError(f"expected x (rows, {K}) or (batch, seq, {K}), got {tuple(x.shape)}")
    rows = x.numel() // K
    normed, outs = out[0], out[1:]
    if tuple(norm_weight.shape) != (K,) or not norm_weight.is_contiguous() \\
            or not normed.is_contiguous() or normed.numel() != rows * K:
        raise ValueError(f"expected a contiguous norm weight ({K},) and normed output of "
                         f"{rows} x {K}; got {tuple(norm_weight.shape)}, {tuple(normed.shape)}")
    for w, b, o, n in zip(ws, bs, outs, (NQ, NK, NV)):
        if tuple(w.shape) != (n, K) or not w.is_contiguous() or (b is None) == HAS_BIAS \\
                or (b is not None and tuple(b.shape) != (n,)) or not o.is_contiguous() \\
                or o.numel() != rows * n or o.shape[-1] != n:
            raise ValueError(f"expected contiguous weights ({n}, {K}), bias "
                             f"{'given' if HAS_BIAS else 'absent'}, contiguous outputs of "
                             f"{rows} x {n}; got {tuple(w.shape)}, "
                             f"{None if b is None else tuple(b.shape)}, {tuple(o.shape)}")
    if rows > MAX_ROWS:
        raise ValueError(f"at most {MAX_ROWS} rows, got {rows}")
    tensors = (x, norm_weight, *ws, *out, *(b for b in bs if b is not None))
    if not all(t.dtype == TORCH_DTYPE for t in tensors):
        raise ValueError(f"specialised for {DTYPE} tensors")
    if rows == 0:
        return
    if x.dim() == 3:
        seq, x_sb, x_ss = x.shape[1], x.stride(0), x.stride(1)
    else:  # one sequence of `rows` tokens
        seq, x_sb, x_ss = rows, 0, x.stride(0)
    bq, bk, bv = (wq, wk, wv) if bq is None else (bq, bk, bv)
    block_m = max(MIN_BLOCK_M, 1 << (rows - 1).bit_length())
    _kernel(block_m)((PROGRAMS,), x, norm_weight, wq, wk, wv, bq, bk, bv, normed, *outs, rows,
                     seq, x_sb, x_ss, x.stride(-1), float(eps))
'''


def render(config: dict, case: Case) -> str:
    k, dtype, bias = case["k"], case["dtype"], case["bias"]
    bn, bk = config["BLOCK_N"], config["BLOCK_K"]
    nq, nk, nv = (case[n] for n in WIDTHS)
    offset, cast_first = float(case["offset"]), bool(case["cast_first"])
    dot = bool(config.get("DOT", False))
    sums = f"One tensor-core dot per step, the normed rows padded to {DOT_ROWS}, fp32 sums" \
        if dot else "fp32 sums"
    head = textwrap.dedent(f'''\
        """RMSNorm + grouped q/k/v projection candidate: normed = rms_norm(x, norm_weight);
        q, k, v = normed @ Wq^T, normed @ Wk^T, normed @ Wv^T (+ b).

        Generated by codegen.norm_qkv.kernel.render. Specialised for k={k}, nq={nq}, nk={nk},
        nv={nv}, {dtype}, bias={bias}, offset={offset}, cast_first={cast_first}; rows 1 to
        {MAX_ROWS} (a row block per power of two). Tuned for {case["rows"]} rows. One launch
        of {qkv_kernel.programs(case, bn)} programs, each {bn} weight rows x {bk} columns per
        step, {config["num_warps"]} warps, {config["num_stages"]} stages. {sums}, one
        rounding.

        case:   {json.dumps(case)}
        config: {json.dumps(config)}
        """

        import torch
        import triton
        import triton.language as tl

        from codegen.launch import launcher

        K = {k}
        NQ = {nq}
        NK = {nk}
        NV = {nv}
        HAS_BIAS = {bias}
        OFFSET = {offset}
        CAST_FIRST = {cast_first}
        DTYPE = "{dtype}"
        TORCH_DTYPE = getattr(torch, DTYPE)
        MAX_ROWS = {MAX_ROWS}
        BLOCK_N = {bn}
        BLOCK_K = {bk}
        DOT = {dot}
        MIN_BLOCK_M = {DOT_ROWS if dot else 1}
        EVEN_K = {k % bk == 0}
        Q_BLOCKS = {cdiv(nq, bn)}
        K_BLOCKS = {cdiv(nk, bn)}
        PROGRAMS = {qkv_kernel.programs(case, bn)}
        NUM_WARPS = {config["num_warps"]}
        NUM_STAGES = {config["num_stages"]}
        ''')
    return "\n\n".join([head, *sources(), step_sources(),
                        *(kernel_source(f) for f in (_norm_qkv_tiles, _x_starts, _norm_qkv_rstd,
                                                     _norm_qkv_step, _norm_qkv_block,
                                                     _norm_qkv_kernel)), _HOST])
