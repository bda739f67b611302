"""Triton kernel for an attention's q, k and v projections at a decode step, in one launch.

One grid covers the three weights' output rows end to end: program p takes BLOCK_N rows of
Wq, or of Wk, or of Wv (p's range decides), streams them over k BLOCK_K columns at a time,
multiplies each row of x (at most MAX_ROWS; re-read from L2 by every program) and writes its
slice of q, k or v, each a contiguous (rows, n) tensor as HF's Linear returns it. So one
launch reads the 12.6 MB of Llama-3.2-1B's three weights where cuBLAS runs three kernels that
reach 0.4-1.5 TB/s (k/v_proj's 2 MB are too few bytes to fill the GPU alone), and a graphed
step has two nodes fewer per layer.

No K split: at one row Llama's 3072 output rows give 96-768 programs at the tiles searched
and Qwen2.5-0.5B's 1152 give 36-288 (the narrow tiles cover the H200's 132 SMs; the search
measures which wins), and a split would add a second kernel per call, what the family exists
to remove. Each step is the gemv family's own (`_tile_step`: fp32 products and sums, one
rounding), with the weights' strides fixed at those of a contiguous (n, k) weight: the
adapter hands the modules' own parameters and runs HF's code for any other layout.

DOT (a config key, searched from gemv's DOT_MIN_ROWS rows, the guess from DOT_LEAD_ROWS): the
step is gemv's tensor-core dot ("swap AB": the weight tile the dot's M side, x's rows padded
with zeros to DOT_ROWS its N side, the fp32 accumulator transposed back for the bias and the
store) instead of the row loop, whose CUDA-core products grow with the rows (at 8 rows the
gated GEMV's made it 2.7x slower than cuBLAS's chain: benchmarks/results/decode-1207-h100/
gemv_table.md). PDL and PREFETCH are as without it: the first weight tile and the slab's
prefetch before the wait, x after. Numerics: the dot multiplies the same dtype values (16-bit
products exact in fp32; an fp32 dot is IEEE, not TF32) and sums them in fp32 in another order,
which the family's order bound (the matmul family's) allows for.
"""

from __future__ import annotations

import json
import textwrap

import triton
import triton.language as tl

from codegen.gemv.kernel import (
    DOT_ROWS,
    _rows_first,
    _tile_step,
    _weight_tile,
    _zero_acc,
    step_sources,
    with_dot_configs,
)
from codegen.launch import cdiv, guessed_tiles
from codegen.prefetch import _prefetch_slab
from codegen.qkv_proj.reference import MAX_ROWS, WIDTHS
from core.family import Case
from core.source import kernel_source

BLOCK_NS = (4, 8, 16, 32)
BLOCK_KS = (128, 256, 512)
NUM_WARPS, NUM_STAGES = 4, 3
MAX_CONFIGS = 6
DOT_CONFIGS = 3  # from gemv's DOT_MIN_ROWS rows, besides MAX_CONFIGS of the row loop
SMS = 132  # the H200's: the ordering aims for about four programs per SM (a guess to order by)
TARGET_PROGRAMS = 4 * SMS
MIN_TILE = 2048  # weight elements per step under which a tile is not searched (as gemv)


@triton.jit
def _qkv_block(x_ptr, w_ptr, b_ptr, o_ptr, n0, rows, seq, x_sb, x_ss, x_sk,
               K: tl.constexpr, N: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               DOT: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < rows
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * K
    acc = _zero_acc(BLOCK_M, BLOCK_N, DOT)
    if PDL:  # codegen/pdl.py: the first weight tile, then the wait, then x (the first step)
        # no kernel of a decode step writes a weight, so its first tile loads while the
        # previous kernel finishes; x and the outputs wait for it
        offs_k = tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        w = _weight_tile(w_rows, offs_k, k_ok, n_ok, 1, EVEN_K, False)
        if PREFETCH:  # the rest of the slab into L2 while the predecessor finishes
            _prefetch_slab(w_ptr, n0, N, K, 1, BLOCK_K, K, BLOCK_N, K - BLOCK_K)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        acc = _tile_step(acc, w, x_ptr, offs_k, k_ok, offs_m, rows, seq, x_sb, x_ss, x_sk,
                         EVEN_K, BLOCK_M, DOT)
    for k0 in range(PDL * BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        w = _weight_tile(w_rows, offs_k, k_ok, n_ok, 1, EVEN_K, False)
        acc = _tile_step(acc, w, x_ptr, offs_k, k_ok, offs_m, rows, seq, x_sb, x_ss, x_sk,
                         EVEN_K, BLOCK_M, DOT)
    acc = _rows_first(acc, DOT)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(o_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(o_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _qkv_kernel(x_ptr, wq_ptr, wk_ptr, wv_ptr, bq_ptr, bk_ptr, bv_ptr, q_ptr, k_ptr, v_ptr,
                rows, seq, x_sb, x_ss, x_sk, K: tl.constexpr, NQ: tl.constexpr,
                NK: tl.constexpr, NV: tl.constexpr, Q_BLOCKS: tl.constexpr,
                K_BLOCKS: tl.constexpr, EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                DOT: tl.constexpr = False, PREFETCH: tl.constexpr = False,
                PDL: tl.constexpr = False):
    pid = tl.program_id(0)
    if pid < Q_BLOCKS:
        _qkv_block(x_ptr, wq_ptr, bq_ptr, q_ptr, pid * BLOCK_N, rows, seq, x_sb, x_ss, x_sk,
                   K, NQ, EVEN_K, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, DOT, PREFETCH, PDL)
    elif pid < Q_BLOCKS + K_BLOCKS:
        _qkv_block(x_ptr, wk_ptr, bk_ptr, k_ptr, (pid - Q_BLOCKS) * BLOCK_N, rows, seq, x_sb,
                   x_ss, x_sk, K, NK, EVEN_K, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K, DOT,
                   PREFETCH, PDL)
    else:
        _qkv_block(x_ptr, wv_ptr, bv_ptr, v_ptr, (pid - Q_BLOCKS - K_BLOCKS) * BLOCK_N, rows,
                   seq, x_sb, x_ss, x_sk, K, NV, EVEN_K, HAS_BIAS, BLOCK_M, BLOCK_N, BLOCK_K,
                   DOT, PREFETCH, PDL)


def programs(case: Case, block_n: int) -> int:
    return sum(cdiv(case[n], block_n) for n in WIDTHS)


def _config(bn: int, bk: int, dot: bool = False) -> dict:
    return {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": NUM_WARPS, "num_stages": NUM_STAGES,
            **({"DOT": True} if dot else {})}


def search_space(case: Case) -> list[dict]:
    """BLOCK_N x BLOCK_K (BLOCK_K <= k where one fits, tiles of MIN_TILE elements and more), at
    most MAX_CONFIGS: the widest BLOCK_K first, then grids nearest TARGET_PROGRAMS programs;
    last the cheapest for the interpreter (the widest tile: fewest programs and steps). From
    gemv's DOT_MIN_ROWS rows, DOT_CONFIGS tensor-core ones too (`with_dot_configs`), first
    from DOT_LEAD_ROWS rows: the family's guess (Family.leads)."""
    tiles = guessed_tiles(case["k"], lambda bn: programs(case, bn), BLOCK_NS, BLOCK_KS,
                          MIN_TILE, SMS, TARGET_PROGRAMS, MAX_CONFIGS)
    return with_dot_configs([_config(bn, bk) for bn, bk in tiles], case, case["k"],
                            lambda bn: programs(case, bn), 1, DOT_CONFIGS,
                            lambda bn, bk: _config(bn, bk, dot=True))


_HOST = '''\
_kernels = {}


def _kernel(block_m):
    """The launcher for a row block of `block_m` (a power of two up to MAX_ROWS)."""
    if block_m not in _kernels:
        _kernels[block_m] = launcher(
            _qkv_kernel, K=K, NQ=NQ, NK=NK, NV=NV, Q_BLOCKS=Q_BLOCKS, K_BLOCKS=K_BLOCKS,
            EVEN_K=EVEN_K, HAS_BIAS=HAS_BIAS, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
            BLOCK_K=BLOCK_K, DOT=DOT, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return _kernels[block_m]


def forward(x, wq, wk, wv, bq=None, bk=None, bv=None, *, out, **params) -> None:
    """x: (rows, K) or (batch, seq, K), any strides, at most MAX_ROWS rows; wq/wk/wv:
    contiguous (NQ, K), (NK, K), (NV, K); biases (n,) where specialised with them; out: the
    three contiguous (.., n) outputs, x's rows each."""
    if params:
        raise ValueError(f"takes no parameters, called with {params}")
    ws, bs = (wq, wk, wv), (bq, bk, bv)
    if x.dim() not in (2, 3) or x.shape[-1] != K:
        raise ValueError(f"expected x (rows, {K}) or (batch, seq, {K}), got {tuple(x.shape)}")
    rows = x.numel() // K
    for w, b, o, n in zip(ws, bs, out, (NQ, NK, NV)):
        if tuple(w.shape) != (n, K) or not w.is_contiguous() or (b is None) == HAS_BIAS \\
                or (b is not None and tuple(b.shape) != (n,)) or not o.is_contiguous() \\
                or o.numel() != rows * n or o.shape[-1] != n:
            raise ValueError(f"expected contiguous weights ({n}, {K}), bias "
                             f"{'given' if HAS_BIAS else 'absent'}, contiguous outputs of "
                             f"{rows} x {n}; got {tuple(w.shape)}, "
                             f"{None if b is None else tuple(b.shape)}, {tuple(o.shape)}")
    if rows > MAX_ROWS:
        raise ValueError(f"at most {MAX_ROWS} rows, got {rows}")
    tensors = (x, *ws, *out, *(b for b in bs if b is not None))
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
    _kernel(block_m)((PROGRAMS,), x, wq, wk, wv, bq, bk, bv, *out, rows, seq, x_sb, x_ss,
                     x.stride(-1))
'''


def render(config: dict, case: Case) -> str:
    k, dtype, bias = case["k"], case["dtype"], case["bias"]
    bn, bk = config["BLOCK_N"], config["BLOCK_K"]
    nq, nk, nv = (case[n] for n in WIDTHS)
    dot = bool(config.get("DOT", False))
    sums = f"One tensor-core dot per step, x's rows padded to {DOT_ROWS}, fp32 sums" if dot \
        else "fp32 sums"
    head = textwrap.dedent(f'''\
        """Grouped q/k/v projection candidate: q, k, v = x @ Wq^T, x @ Wk^T, x @ Wv^T (+ b).

        Generated by codegen.qkv_proj.kernel.render. Specialised for k={k}, nq={nq}, nk={nk},
        nv={nv}, {dtype}, bias={bias}; rows 1 to {MAX_ROWS} (a row block per power of two).
        Tuned for {case["rows"]} rows. One launch of {programs(case, bn)} programs, each
        {bn} weight rows x {bk} columns per step, {config["num_warps"]} warps,
        {config["num_stages"]} stages. {sums}, one rounding.

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
        PROGRAMS = {programs(case, bn)}
        NUM_WARPS = {config["num_warps"]}
        NUM_STAGES = {config["num_stages"]}
        ''')
    return "\n\n".join([head, step_sources(), kernel_source(_qkv_block),
                        kernel_source(_qkv_kernel), _HOST])
