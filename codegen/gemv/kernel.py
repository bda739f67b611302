"""Triton GEMV for few-row projections: out = x @ W^T (+ b), W the module's (n, k) weight.

At a decode step the weight is the traffic (Llama-3.2-1B's k/v projection: 2 MB of weight
against 4 KB of x and 1 KB of output), so the kernel streams each weight element once and
keeps enough programs in flight to cover the GPU: grid (n / BLOCK_N, SPLIT_K), each program
one BLOCK_N-row slab of W over its K chunk, loaded BLOCK_K columns at a time (contiguous along
k: wide vector loads) and multiplied with every row of x (at most MAX_ROWS; x is re-read from
L2 by each program, which costs nothing next to the weight). The design is the lead's probe's
(benchmarks/probes/gemv.py), with x taken through (batch, seq, k) strides instead of a copy.

SPLIT_K == 1 stores the output directly, with the bias added and one rounding. With
`accumulate=True` the output's own values are added before that rounding (out += x @ W^T: a
decoder layer's residual add folded into down_proj, codegen/add_rmsnorm/residual_gemm.py).
SPLIT_K > 1 writes fp32 partials into a (SPLIT_K, rows, n) workspace and a second kernel sums
them in split order, adds the bias and rounds once; or, FUSED, the split kernel does that
itself: each program counts its arrival on its column block's int32 counter after storing
its partial, and the last to arrive sums the block's partials (the same helpers, the same
order: the two-kernel result bit for bit), stores the output and resets the counter (one
launch instead of two; at batch 1 a graphed decode step is bound by its launches, and
cuBLAS runs Llama-3.2-1B's down projection as two, a split-K GEMV and cublasLt's
splitKreduce: benchmarks/results/decode-1207-h100/decode-step-llama-3.2-1b.md). The
workspace is a torch.empty inside forward: under CUDA graph capture it comes from the graph's
pool, and nothing is read back to the host, so a graph captures the call as it is.

DOT (a config key, searched from DOT_MIN_ROWS rows): each step is one tensor-core dot instead
of the row loop's CUDA-core products ("swap AB": the (BLOCK_N, BLOCK_K) weight tile is the M
side, x's rows, padded with zeros to DOT_ROWS, the N side; the fp32 accumulator is transposed
back for the epilogue, so every path above is the same). The row loop multiplies the weight
tile once per row, which at 8 rows made the gated GEMV 2.7x slower than cuBLAS's chain
(benchmarks/results/decode-1207-h100/gemv_table.md); the dot's work does not grow with the
rows up to 16, and its pipelined loads stage the tiles in shared memory.

Numerics: every product and sum in fp32 (16-bit inputs multiply exactly; DOT's fp32 dot is
IEEE, not TF32), one rounding to the output dtype; the summation order (BLOCK_K-wide partial
dot products, then chunk by chunk) is not cuBLAS's, which the matmul family's order bound
allows for.

`search_space` starts with cuBLAS itself (torch.mm/addmm on the weight's transposed view, as
F.linear runs it), so a case no GEMV config beats keeps cuBLAS's time, then orders the GEMV
configs by a guess at what wins at one row (the widest loads, about four programs per SM of an
H200, fewer splits; FUSED splits first where k is several times n); the search's measurement
decides.
"""

from __future__ import annotations

import itertools
import json
import math
import textwrap

import triton
import triton.language as tl

from codegen.gemv.reference import MAX_ROWS
from codegen.launch import cdiv
from codegen.prefetch import _prefetch_slab
from core.family import Case
from core.source import kernel_source

BLOCK_NS = (4, 8, 16, 32)
BLOCK_KS = (128, 256, 512)
SPLIT_KS = (1, 2, 4, 8)
NUM_WARPS, NUM_STAGES = 4, 3
# cuBLAS, five unfused guesses, three FUSED split ones, the cheapest: `--max-configs 10`
# searches them all, as "auto" does with no budget named (codegen.strategies.DEFAULT_TRIALS)
MAX_CONFIGS = 10
FUSED_GUESSES = 3
# k over n from which a case's guess is a FUSED split config: the down projections
# (8192x2048, 14336x4096, 4864x896) and the k/v ones, where the graphed H100 table's winners
# were split configs even with a sum kernel (benchmarks/results/decode-1207-h100/
# gemv_table.json); q/o, gate/up and the LM heads won unsplit there
TALL = 3
# Tile (weight elements per step) the fused ranking prefers where grids tie: the gate/up
# projection's winner there (16 x 512 over k=2048 in 4 steps, 512 programs: 85 % of the copy
# bandwidth), which Llama-3.2-1B's down projection matches at SPLIT_K 4 step for step
FUSED_TILE = 16 * 512
# Programs the ordering aims for: four per SM of an H200 (132 SMs), enough weight loads in
# flight to cover the memory latency with one row of x. A guess to order by, not a filter.
SMS = 132
TARGET_PROGRAMS = 4 * SMS
# Weight elements per step under which a tile is not searched: fewer than 16 per thread of 4
# warps is under two 16-byte loads of bf16 in flight per thread, too little to hide latency.
MIN_TILE = 2048
# The split sum: columns per program (fp32: 16-byte loads per thread at 4 warps x 32 threads).
SUM_BLOCK = 512
# DOT ("swap AB", _tile_step): the rows padded to the N side of a tensor-core dot, whose
# smallest side is 16; the weight tile is its M side, so BLOCK_N is 16 at least. Offered from
# DOT_MIN_ROWS rows; from DOT_LEAD_ROWS the family's guess is a DOT config: the row loop's
# CUDA-core products grow with the rows (at 8 rows the gated GEMV, which runs it twice, took
# 2.7x cuBLAS's chain: benchmarks/results/decode-1207-h100/gemv_table.md), the dot's do not.
DOT_ROWS = 16
DOT_MIN_ROWS = 2
DOT_LEAD_ROWS = 4
DOT_BLOCK_NS = (16, 32, 64)
# Shared memory a DOT tile may take: Triton's pipeliner stages the weight and x tiles in shared
# memory (cp.async, up to num_stages buffers of each); 160 KiB leaves an H100 or H200 SM (227
# KiB) room for the epilogue and keeps the widest tiles compilable
DOT_SMEM = 160 * 1024
# Programs the DOT ordering aims for: two per SM. A staged tile takes shared memory the row
# loop does not, so fewer programs fit an SM; a guess to order by, not a filter.
DOT_TARGET = 2 * SMS
# (unfused, FUSED, DOT) configs kept between cuBLAS and the cheapest: MAX_CONFIGS in all
SHARES = {False: (MAX_CONFIGS - 2 - FUSED_GUESSES, FUSED_GUESSES, 0), True: (2, 2, 4)}


@triton.jit
def _rows_times_tile(acc, w, x_ptr, offs_k, k_ok, offs_m, rows, seq, x_sb, x_ss, x_sk,
                     EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr):
    """acc (BLOCK_M, BLOCK_N) plus each row of x (at most BLOCK_M) times the fp32 weight tile w
    (BLOCK_N, BLOCK_K) over columns offs_k: the step the gemv and qkv_proj kernels share."""
    for m in tl.static_range(BLOCK_M):
        # row m of x as a (batch, seq, K) view, (m // seq, m % seq), any strides; rows
        # past the last wrap back into x: values nobody stores
        row = m % rows
        x_ptrs = x_ptr + (row // seq) * x_sb + (row % seq) * x_ss + offs_k * x_sk
        if EVEN_K:
            x = tl.load(x_ptrs)
        else:
            x = tl.load(x_ptrs, mask=k_ok, other=0.0)
        acc = _plus_row(acc, w, x, offs_m, m, BLOCK_M)
    return acc


@triton.jit
def _plus_row(acc, w, x, offs_m, m, BLOCK_M: tl.constexpr):
    """acc (BLOCK_M, BLOCK_N) with row m plus the fp32 weight tile w times x, one row's
    BLOCK_K slice (fp32 products, summed along k)."""
    part = tl.sum(w * x.to(tl.float32)[None, :], axis=1)
    if BLOCK_M == 1:
        acc += part[None, :]
    else:
        acc = tl.where(offs_m[:, None] == m, acc + part[None, :], acc)
    return acc


@triton.jit
def _weight_tile(w_rows, offs_k, k_ok, n_ok, w_sk, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr):
    """The (BLOCK_N, BLOCK_K) weight tile at columns offs_k of rows w_rows. EVEN_K (decided
    at compile time): every split is whole BLOCK_K steps inside K, so only rows past N (if
    any) are masked and the loads stay unmasked along k."""
    w_ptrs = w_rows + offs_k[None, :] * w_sk
    if EVEN_K and EVEN_N:
        w = tl.load(w_ptrs)
    elif EVEN_K:
        w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
    else:
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
    return w


@triton.jit
def _x_rows(x_ptr, offs_k, k_ok, offs_m, rows, seq, x_sb, x_ss, x_sk, EVEN_K: tl.constexpr):
    """The (BLOCK_M, BLOCK_K) tile of x's rows offs_m (found as _rows_times_tile finds them)
    at columns offs_k, in x's dtype: zeros past `rows` (the dot's padding, which no store
    keeps)."""
    x_ptrs = x_ptr + ((offs_m // seq) * x_sb + (offs_m % seq) * x_ss)[:, None] \
        + offs_k[None, :] * x_sk
    if EVEN_K:
        x = tl.load(x_ptrs, mask=(offs_m < rows)[:, None], other=0.0)
    else:
        x = tl.load(x_ptrs, mask=(offs_m < rows)[:, None] & k_ok[None, :], other=0.0)
    return x


@triton.jit
def _dot_rows(acc, w, x):
    """acc (BLOCK_N, BLOCK_M) plus the weight tile w (BLOCK_N, BLOCK_K) times x's rows (BLOCK_M,
    BLOCK_K, w's dtype) transposed: one tensor-core dot ("swap AB"), fp32 sums."""
    if w.dtype == tl.float32:  # IEEE, not TF32: the verifier's fp32 tolerances
        acc = tl.dot(w, tl.trans(x), acc, input_precision="ieee")
    else:  # 16-bit products are exact in the fp32 sums (a precision is for fp32 only)
        acc = tl.dot(w, tl.trans(x), acc)
    return acc


@triton.jit
def _tile_step(acc, w, x_ptr, offs_k, k_ok, offs_m, rows, seq, x_sb, x_ss, x_sk,
               EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, DOT: tl.constexpr):
    """acc plus x's rows times the weight tile w (BLOCK_N, BLOCK_K, in the weight's dtype).
    DOT ("swap AB": the weight tile is the dot's M side, the rows padded to BLOCK_M >= 16 its
    N side): acc (BLOCK_N, BLOCK_M), one tensor-core dot per step; else acc (BLOCK_M,
    BLOCK_N), row by row on CUDA cores (_rows_times_tile). Both sum fp32 products in fp32."""
    if DOT:
        x = _x_rows(x_ptr, offs_k, k_ok, offs_m, rows, seq, x_sb, x_ss, x_sk, EVEN_K)
        acc = _dot_rows(acc, w, x)
    else:
        acc = _rows_times_tile(acc, w.to(tl.float32), x_ptr, offs_k, k_ok, offs_m, rows, seq,
                               x_sb, x_ss, x_sk, EVEN_K, BLOCK_M)
    return acc


@triton.jit
def _zero_acc(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr):
    """The fp32 accumulator _tile_step takes: (BLOCK_N, BLOCK_M) with DOT, else (BLOCK_M,
    BLOCK_N)."""
    if DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    return acc


@triton.jit
def _rows_first(acc, DOT: tl.constexpr):
    """_tile_step's accumulator as (BLOCK_M, BLOCK_N), the epilogues' orientation."""
    if DOT:
        acc = tl.trans(acc)
    return acc


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, o_ptr, ws_ptr, count_ptr, rows, seq, x_sb, x_ss, x_sk,
                 w_sn, w_sk, o_sm, K: tl.constexpr, N: tl.constexpr, K_CHUNK: tl.constexpr,
                 EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, HAS_BIAS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, ACCUMULATE: tl.constexpr, FUSED: tl.constexpr = False,
                 DOT: tl.constexpr = False, PREFETCH: tl.constexpr = False,
                 PDL: tl.constexpr = False):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < rows
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * w_sn
    acc = _zero_acc(BLOCK_M, BLOCK_N, DOT)
    lo = split * K_CHUNK
    if PDL:  # codegen/pdl.py: the first weight tile, then the wait, then x (the first step)
        # no kernel of a decode step writes a weight, so its first tile loads while the
        # previous kernel finishes; x, the bias' sum, out, the workspace and FUSED's
        # counters (the previous call's) wait for it
        offs_k = lo + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        w = _weight_tile(w_rows, offs_k, k_ok, n_ok, w_sk, EVEN_K, EVEN_N)
        if PREFETCH:  # the rest of the slab into L2 while the predecessor finishes
            _prefetch_slab(w_ptr, pid_n * BLOCK_N, N, w_sn, w_sk, lo + BLOCK_K,
                           tl.minimum(lo + K_CHUNK, K), BLOCK_N, K_CHUNK - BLOCK_K)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        acc = _tile_step(acc, w, x_ptr, offs_k, k_ok, offs_m, rows, seq, x_sb, x_ss, x_sk,
                         EVEN_K, BLOCK_M, DOT)
    for k0 in range(PDL * BLOCK_K, K_CHUNK, BLOCK_K):
        offs_k = lo + k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        w = _weight_tile(w_rows, offs_k, k_ok, n_ok, w_sk, EVEN_K, EVEN_N)
        acc = _tile_step(acc, w, x_ptr, offs_k, k_ok, offs_m, rows, seq, x_sb, x_ss, x_sk,
                         EVEN_K, BLOCK_M, DOT)
    acc = _rows_first(acc, DOT)
    m2, n2 = offs_m[:, None], offs_n[None, :]
    ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        _finish(acc, b_ptr, o_ptr + m2 * o_sm + n2, n2, ok, n_ok[None, :], HAS_BIAS, ACCUMULATE)
    else:
        tl.store(ws_ptr + (split * rows + m2) * N + n2, acc, mask=ok)
        if FUSED:
            # as codegen/decode_attention/kernel.py's FUSED: every thread's partial stores
            # issued before one thread's release (bar.sync), then the arrival on this column
            # block's counter: acq_rel at GPU scope publishes this program's partial to the
            # last one and, in that last one, makes every other split's partial visible
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                # the sum kernel's helpers, in split order: the same bits as the two kernels
                acc = _split_total(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), ws_ptr,
                                   rows, m2, n2, ok, N, SPLIT_K)
                _finish(acc, b_ptr, o_ptr + m2 * o_sm + n2, n2, ok, n_ok[None, :], HAS_BIAS,
                        ACCUMULATE)
                # every split of this column block has arrived: zero for the next call (or
                # graph replay), which starts only once this launch has ended
                tl.store(count_ptr + pid_n, 0)


@triton.jit
def _split_total(acc, ws_ptr, rows, m, offs_n, ok, N: tl.constexpr, SPLIT_K: tl.constexpr):
    """acc (zeros of the output tile's shape) plus the SPLIT_K fp32 partials of rows m,
    columns offs_n, in split order: a fixed summation order. Loads bypass L1 (.cg): in the
    FUSED kernel the partials are other SMs' stores, and L1 is not coherent across SMs."""
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(ws_ptr + (s * rows + m) * N + offs_n, mask=ok, other=0.0,
                       cache_modifier=".cg")
    return acc


@triton.jit
def _finish(acc, b_ptr, o_ptrs, offs_n, ok, n_ok, HAS_BIAS: tl.constexpr,
            ACCUMULATE: tl.constexpr):
    """The fp32 sum acc plus the bias and, ACCUMULATE, out's own values (out += x @ W^T: the
    residual add in the epilogue), rounded once into out."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    if ACCUMULATE:
        acc += tl.load(o_ptrs, mask=ok, other=0.0).to(tl.float32)
    tl.store(o_ptrs, acc.to(o_ptrs.dtype.element_ty), mask=ok)


@triton.jit
def _split_sum_kernel(ws_ptr, b_ptr, o_ptr, rows, o_sm, N: tl.constexpr,
                      HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, SPLIT_K: tl.constexpr,
                      ACCUMULATE: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # codegen/pdl.py: everything it reads but the bias is the step's activations
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs_n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    n_ok = offs_n < N
    for m in range(0, rows):
        acc = _split_total(tl.zeros([BLOCK], dtype=tl.float32), ws_ptr, rows, m, offs_n, n_ok,
                           N, SPLIT_K)
        _finish(acc, b_ptr, o_ptr + m * o_sm + offs_n, offs_n, n_ok, n_ok, HAS_BIAS,
                ACCUMULATE)


def block_ks(k: int) -> list[int]:
    """The BLOCK_K choices no wider than k; the narrowest where k is under all of them."""
    fit = [b for b in BLOCK_KS if b <= k]
    return fit or [BLOCK_KS[0]]


def k_chunk(k: int, block_k: int, split_k: int) -> int:
    """Each split's share of k, whole BLOCK_K steps (the last split may hold fewer of k)."""
    return cdiv(cdiv(k, split_k), block_k) * block_k


# cuBLAS itself, as F.linear runs it: first, so every search budget of two or more measures it
# (codegen.search.spread keeps both ends) and a case no GEMV config beats keeps cuBLAS's
# speed (with cold weights a GEMV lost to cuBLAS on the wide projections and the LM heads:
# benchmarks/probes/README.md, `gemv.py`)
CUBLAS = {"impl": "cublas"}


def _config(bn: int, bk: int, sk: int, fused: bool = False, dot: bool = False) -> dict:
    return {"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk, "num_warps": NUM_WARPS,
            "num_stages": NUM_STAGES, **({"FUSED": True} if fused else {}),
            **({"DOT": True} if dot else {})}


def dot_smem(bn: int, bk: int, item: int, weights: int = 1) -> int:
    """Shared memory a DOT program's staged tiles may take: NUM_STAGES buffers of `weights`
    (bn, bk) weight tiles and the (DOT_ROWS, bk) x tile, `item` bytes an element."""
    return NUM_STAGES * (weights * bn + DOT_ROWS) * bk * item


def dot_tiles(tiles: list[tuple], programs, smem, keep: int) -> list[tuple]:
    """At most `keep` of `tiles` ((BLOCK_N, BLOCK_K, ...) tuples, BLOCK_N from DOT_BLOCK_NS)
    for the DOT kernel, guessed best first: those whose staged tiles (`smem(tile)`) fit
    DOT_SMEM, by grids of `programs(tile)` programs nearest DOT_TARGET (fewer than SMS after),
    then the rest of the tuple (fewer splits), the wider BLOCK_N (x is read once per column
    block: rows / BLOCK_N of the weight's traffic), the wider BLOCK_K. The best of each
    BLOCK_N first, so a short list still spans the widths."""
    def guess(t):
        p = programs(t)
        return (p < SMS, abs(math.log2(p / DOT_TARGET)), *t[2:], -t[0], -t[1])

    fit = sorted((t for t in tiles if smem(t) <= DOT_SMEM), key=guess)
    firsts = [next(t for t in fit if t[0] == bn) for bn in DOT_BLOCK_NS
              if any(t[0] == bn for t in fit)]
    return (sorted(firsts, key=guess) + [t for t in fit if t not in firsts])[:keep]


def with_dot_configs(space: list[dict], case: Case, width: int, programs, weights: int,
                     keep: int, config) -> list[dict]:
    """A one-launch few-row kernel's `space` (its row-loop configs, the family's guess first)
    with, from DOT_MIN_ROWS rows, `keep` DOT configs `config(BLOCK_N, BLOCK_K)` ranked by
    `dot_tiles`: BLOCK_N from DOT_BLOCK_NS, BLOCK_K from BLOCK_KS (those <= `width`, the loads'
    length, where one fits), grids of `programs(BLOCK_N)` programs, `weights` weight tiles staged
    per step. From DOT_LEAD_ROWS rows they lead (the first is the family's guess), below they
    follow the row loop's guess; the rest of `space` (its last, the interpreter's cheapest)
    after them."""
    if case["rows"] < DOT_MIN_ROWS:
        return space
    item = 4 if case["dtype"] == "float32" else 2
    dot = [config(bn, bk) for bn, bk in dot_tiles(
        [(bn, bk) for bn in DOT_BLOCK_NS for bk in block_ks(width)], lambda t: programs(t[0]),
        lambda t: dot_smem(t[0], t[1], item, weights), keep)]
    lead = 0 if case["rows"] >= DOT_LEAD_ROWS else 1
    return space[:lead] + dot + space[lead:]


def busy_programs(n: int, k: int, bn: int, bk: int, sk: int) -> int:
    """Programs with k to stream: a split whose chunk starts past k (k_chunk rounds up to
    whole BLOCK_K steps) launches but reads nothing."""
    return cdiv(n, bn) * cdiv(k, k_chunk(k, bk, sk))


def search_space(case: Case) -> list[dict]:
    """cuBLAS (CUBLAS), then BLOCK_N x BLOCK_K x SPLIT_K (SPLIT_K * BLOCK_K <= k; tiles of
    MIN_TILE elements and more where any are), at most MAX_CONFIGS in all; last the cheapest
    for the interpreter (the widest slabs and steps, no split: the fewest programs and
    iterations), which CPU runs use.

    Two rankings, interleaved. The unfused (no "FUSED" key: the dicts, and with them their
    candidates' folder names and remembered searches, are what they were): the widest BLOCK_K
    first (every winner of the lead's probe, cold and warm, used 512), then grids that fill
    the GPU, nearest TARGET_PROGRAMS programs, fewer splits (no sum kernel). The FUSED split
    ones (the sum in the last split program: no second launch, so a split costs little): the
    widest BLOCK_K, programs that stream k nearest TARGET_PROGRAMS, then tiles nearest
    FUSED_TILE. A tall case (k at least TALL x n) starts with the fused guess where it loads as
    wide as the unfused one, every other with the unfused guess: the second entry is the
    family's guess (Family.leads). From DOT_MIN_ROWS rows, DOT configs too (tensor-core dots,
    unsplit or FUSED; `dot_tiles` ranks them), fewer of the others (SHARES); from
    DOT_LEAD_ROWS rows the guess is the first DOT config."""
    k, n = case["k"], case["n"]
    configs = [(bn, bk, sk) for bn in BLOCK_NS for bk in block_ks(k) for sk in SPLIT_KS
               if sk == 1 or sk * bk <= k]
    configs = [c for c in configs if c[0] * c[1] >= MIN_TILE] or configs

    def guess(c):
        bn, bk, sk = c
        programs = cdiv(n, bn) * sk
        return (-bk, programs < SMS, abs(math.log2(programs / TARGET_PROGRAMS)), sk, bn)

    def fused_guess(c):
        bn, bk, sk = c
        programs = busy_programs(n, k, bn, bk, sk)
        return (-bk, programs < SMS, abs(math.log2(programs / TARGET_PROGRAMS)),
                abs(math.log2(bn * bk / FUSED_TILE)), sk, bn)

    offers_dot = case["rows"] >= DOT_MIN_ROWS
    n_ranked, n_fused, n_dot = SHARES[offers_dot]
    cheapest = (BLOCK_NS[-1], block_ks(k)[-1], 1)
    ranked = [_config(*c) for c in sorted(configs, key=guess) if c != cheapest][:n_ranked]
    fused = [_config(*c, fused=True) for c in sorted(configs, key=fused_guess) if c[2] > 1]
    fused = fused[:n_fused]
    # the widest loads first holds across both: a fused guess of narrower BLOCK_K (k too short
    # to split at 512) does not lead
    tall = k >= TALL * n and fused and (not ranked or fused[0]["BLOCK_K"] >= ranked[0]["BLOCK_K"])
    first, second = (fused, ranked) if tall else (ranked, fused)
    mixed = [c for pair in itertools.zip_longest(first, second) for c in pair if c is not None]
    if not offers_dot:
        return [CUBLAS] + mixed + [_config(*cheapest)]
    # DOT: unsplit or FUSED (a split costs no second launch)
    item = 4 if case["dtype"] == "float32" else 2
    tiles = [(bn, bk, sk) for bn in DOT_BLOCK_NS for bk in block_ks(k) for sk in SPLIT_KS
             if sk == 1 or sk * bk <= k]
    dot = [_config(bn, bk, sk, fused=sk > 1, dot=True) for bn, bk, sk in dot_tiles(
        tiles, lambda t: busy_programs(n, k, *t), lambda t: dot_smem(t[0], t[1], item), n_dot)]
    # the family's guess (the second entry, Family.leads): DOT from DOT_LEAD_ROWS rows; at
    # fewer, the row loop's few products may still keep up, and its guess leads
    lead = 0 if case["rows"] >= DOT_LEAD_ROWS else 1
    return [CUBLAS] + mixed[:lead] + dot + mixed[lead:] + [_config(*cheapest)]


_CHECK = '''\
_BAKED_PARAMS = {"n": N, "layout": "linear"}


def _rows(x, w, b, out, params) -> int:
    """x's rows, after checking every argument against what this file is specialised for."""
    if params and params != _BAKED_PARAMS:
        raise ValueError(f"specialised for {_BAKED_PARAMS}, called with {params}")
    if x.dim() not in (2, 3) or x.shape[-1] != K or tuple(w.shape) != (N, K) \\
            or (b is None) == HAS_BIAS or (b is not None and tuple(b.shape) != (N,)):
        raise ValueError(f"expected x (rows, {K}) or (batch, seq, {K}), weight ({N}, {K}), "
                         f"bias ({N},) {'given' if HAS_BIAS else 'absent'}; got "
                         f"{tuple(x.shape)}, {tuple(w.shape)}, "
                         f"{None if b is None else tuple(b.shape)}")
    rows = x.numel() // K
    if rows > MAX_ROWS or out.numel() != rows * N or out.shape[-1] != N \\
            or not out.is_contiguous():
        raise ValueError(f"expected at most {MAX_ROWS} rows and a contiguous out of {rows} x "
                         f"{N}; got x {tuple(x.shape)}, out {tuple(out.shape)}")
    if not all(t.dtype == TORCH_DTYPE for t in (x, w, out) + (() if b is None else (b,))):
        raise ValueError(f"specialised for {DTYPE} tensors")
    return rows


def _check_accumulate(accumulate) -> None:
    if accumulate and HAS_BIAS:
        raise ValueError("accumulate (out += x @ w^T) is for projections without a bias")
'''

_CUBLAS = '''\


def forward(x, w, b=None, *, out, accumulate=False, **params) -> None:
    """x: (rows, K) or (batch, seq, K), at most MAX_ROWS rows; w: (N, K); b: (N,) where
    specialised with a bias; out: contiguous, N wide, x's rows. cuBLAS on the transposed view
    of w, as F.linear runs it. accumulate: out += x @ w^T (a residual add; no bias)."""
    rows = _rows(x, w, b, out, params)
    _check_accumulate(accumulate)
    if rows == 0:
        return
    x2, o = x.reshape(rows, K), out.view(rows, N)
    if accumulate:
        o.addmm_(x2, w.t())
    elif b is None:
        torch.mm(x2, w.t(), out=o)
    else:
        torch.addmm(b, x2, w.t(), out=o)
'''

_TRITON = '''\
_kernels = {}
_sums = {}


def _kernel(block_m, accumulate):
    """The GEMV launcher for a row block of `block_m` (a power of two up to MAX_ROWS)."""
    key = (block_m, accumulate)
    if key not in _kernels:
        _kernels[key] = launcher(
            _gemv_kernel, K=K, N=N, K_CHUNK=K_CHUNK, EVEN_K=EVEN_K, EVEN_N=EVEN_N,
            HAS_BIAS=HAS_BIAS, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            SPLIT_K=SPLIT_K, ACCUMULATE=accumulate and (SPLIT_K == 1 or FUSED), FUSED=FUSED,
            DOT=DOT, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return _kernels[key]


def _sum(accumulate):
    if accumulate not in _sums:
        _sums[accumulate] = launcher(_split_sum_kernel, N=N, HAS_BIAS=HAS_BIAS, BLOCK=SUM_BLOCK,
                                     SPLIT_K=SPLIT_K, ACCUMULATE=accumulate, num_warps=4)
    return _sums[accumulate]


def forward(x, w, b=None, *, out, accumulate=False, **params) -> None:
    """x: (rows, K) or (batch, seq, K), any strides, at most MAX_ROWS rows; w: (N, K), any
    strides; b: (N,) where specialised with a bias; out: contiguous, N wide, x's rows.
    accumulate: out += x @ w^T, in the epilogue (a residual add; no bias)."""
    rows = _rows(x, w, b, out, params)
    _check_accumulate(accumulate)
    accumulate = bool(accumulate)
    if rows == 0:
        return
    if x.dim() == 3:
        seq, x_sb, x_ss = x.shape[1], x.stride(0), x.stride(1)
    else:  # one sequence of `rows` tokens
        seq, x_sb, x_ss = rows, 0, x.stride(0)
    o = out.view(rows, N)
    bias = w if b is None else b
    ws = o if SPLIT_K == 1 else torch.empty((SPLIT_K, rows, N), dtype=torch.float32,
                                            device=x.device)
    counts = arrival_counters(x.device, N_BLOCKS) if FUSED else ws
    block_m = max(MIN_BLOCK_M, 1 << (rows - 1).bit_length())
    _kernel(block_m, accumulate)((N_BLOCKS, SPLIT_K), x, w, bias, o, ws, counts, rows, seq,
                                 x_sb, x_ss, x.stride(-1), w.stride(0), w.stride(1),
                                 o.stride(0))
    if SPLIT_K > 1 and not FUSED:
        _sum(accumulate)((SUM_PROGRAMS,), ws, bias, o, rows, o.stride(0))
'''


def step_sources() -> str:
    """The source of the weight-streaming step's helpers, which the gemv, gated GEMV, qkv_proj
    and norm-fused candidates' kernels call (_tile_step and what it calls, the weight tile,
    the prefetch)."""
    return "\n\n".join(kernel_source(f) for f in (
        _plus_row, _rows_times_tile, _x_rows, _dot_rows, _tile_step, _zero_acc, _rows_first,
        _weight_tile, _prefetch_slab))


def render(config: dict, case: Case) -> str:
    k, n, dtype, bias = case["k"], case["n"], case["dtype"], case["bias"]
    common = textwrap.dedent(f'''\
        case:   {json.dumps(case)}
        config: {json.dumps(config)}
        """

        import torch

        K = {k}
        N = {n}
        HAS_BIAS = {bias}
        DTYPE = "{dtype}"
        TORCH_DTYPE = getattr(torch, DTYPE)
        MAX_ROWS = {MAX_ROWS}
        ''')
    if config.get("impl") == "cublas":
        header = textwrap.dedent(f'''\
            """Few-row projection candidate (cuBLAS): out = x @ W^T (+ b), W an nn.Linear's (n, k).

            Generated by codegen.gemv.kernel.render: torch.mm / torch.addmm on the transposed
            view of the weight, what F.linear runs, so the search keeps cuBLAS where no GEMV
            config beats it. Specialised for k={k}, n={n}, {dtype}, bias={bias}; rows 1 to
            {MAX_ROWS}. Tuned for {case["rows"]} rows.
            ''')
        return header + common + "\n\n" + _CHECK + _CUBLAS
    bn, bk, sk = config["BLOCK_N"], config["BLOCK_K"], config["SPLIT_K"]
    fused = bool(config.get("FUSED", False)) and sk > 1
    dot = bool(config.get("DOT", False))
    chunk = k_chunk(k, bk, sk)
    launch = ("one program per BLOCK_N rows of W, output stored directly" if sk == 1 else
              f"one kernel, {sk} K splits per BLOCK_N rows of W into an fp32 workspace, "
              "summed by the last split to arrive (an int32 counter per BLOCK_N rows)"
              if fused else
              f"{sk} K splits per BLOCK_N rows of W into an fp32 workspace, then a sum kernel")
    steps = (f"Each step one tensor-core dot of the weight tile by x's rows padded to "
             f"{DOT_ROWS} (fp32 sums)," if dot else "fp32 sums,") + " one rounding."
    header = textwrap.dedent(f'''\
        """Few-row projection candidate (GEMV): out = x @ W^T (+ b), W an nn.Linear's (n, k).

        Generated by codegen.gemv.kernel.render. Specialised for k={k}, n={n}, {dtype},
        bias={bias}; rows 1 to {MAX_ROWS} (a row block per power of two). Tuned for
        {case["rows"]} rows. Launch: {launch}; {bn} weight rows x {bk} columns per step,
        {config["num_warps"]} warps, {config["num_stages"]} stages. {steps}
        ''')
    consts = textwrap.dedent(f'''\
        import triton
        import triton.language as tl

        from codegen.launch import arrival_counters, launcher

        BLOCK_N = {bn}
        BLOCK_K = {bk}
        SPLIT_K = {sk}
        FUSED = {fused}
        DOT = {dot}
        MIN_BLOCK_M = {DOT_ROWS if dot else 1}
        K_CHUNK = {chunk}
        EVEN_K = {k % (sk * bk) == 0}
        EVEN_N = {n % bn == 0}
        N_BLOCKS = {cdiv(n, bn)}
        SUM_BLOCK = {SUM_BLOCK}
        SUM_PROGRAMS = {cdiv(n, SUM_BLOCK)}
        NUM_WARPS = {config["num_warps"]}
        NUM_STAGES = {config["num_stages"]}
        ''')
    return "\n\n".join([header + common + consts, step_sources(),
                        kernel_source(_gemv_kernel),
                        kernel_source(_split_total), kernel_source(_finish),
                        kernel_source(_split_sum_kernel), _CHECK + "\n\n" + _TRITON])
