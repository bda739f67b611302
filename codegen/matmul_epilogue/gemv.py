"""The gated MLP's gate and up projections at a decode step as one GEMV launch with the
activation and the multiply in its epilogue: out = act(x Wg^T) * (x Wu^T), at most MAX_ROWS
rows per launch.

Why it exists: at a decode step the weights are the traffic (Llama-3.2-1B's gate and up: 2 x
32 MiB against 4 KiB of x), and HF runs three launches per MLP there (gate GEMV, up GEMV, the
activation-multiply) where the gemv family still runs three (two GEMVs and gated_act's
kernel). The tile kernels of kernel.py multiply 16-row tiles with tl.dot, 15 of them wrapped
copies at one row; this one streams each weight element once with wide loads along k, as the
gemv family's kernel does (`_rows_times_tile`, the same fp32 step), into two fp32
accumulators that never leave the chip, and writes only the product: one launch where the
graphed step had three, and the two (rows, cols) intermediates neither written nor read back.

Grid: one program per BLOCK_N output columns, each streaming BLOCK_N rows of both weights over
all of k (no K split: Llama's 8192 and Qwen2.5's 4864 columns give 152-2048 programs at the
tiles searched; a split would need a second kernel for the epilogue, the launch this exists to
remove). More than MAX_ROWS rows (a verifier's edge case; the adapter sends a decode step's
rows) run as several launches of MAX_ROWS rows.

From 2 rows the space holds DOT configs too (gemv's tensor-core step, for both weights: at 8
rows the row loop made this kernel 2.7x slower than cuBLAS's chain of four,
benchmarks/results/decode-1207-h100/gemv_table.md); from 4 rows one of them is the guess.

Numerics: every product and sum in fp32 (16-bit values multiply exactly), the activation and
the multiply on the fp32 sums, one rounding; the summation order is the gemv family's, which
the family's order bound allows for.
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
from codegen.gemv.reference import MAX_ROWS
from codegen.launch import cdiv, guessed_tiles
from codegen.matmul_epilogue.epilogue import _gated
from codegen.prefetch import _prefetch_slab
from core.family import Case
from core.source import kernel_source

BLOCK_NS = (4, 8, 16, 32)
BLOCK_KS = (128, 256, 512)
NUM_WARPS, NUM_STAGES = 4, 3
MAX_CONFIGS = 4
DOT_CONFIGS = 3  # from DOT_MIN_ROWS rows, besides MAX_CONFIGS of the row loop
SMS = 132  # the H200's: the ordering aims for about four programs per SM (a guess to order by)
TARGET_PROGRAMS = 4 * SMS
# Weight elements per step (each weight) under which a tile is not searched (as gemv's)
MIN_TILE = 2048


@triton.jit
def _gated_step(acc_gate, acc_up, wg, wu, x_ptr, offs_k, k_ok, offs_m, rows, x_sm, x_sk,
                EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, DOT: tl.constexpr):
    """Both accumulators plus x times one tile of each weight (gemv's step, DOT or not)."""
    # x as `rows` rows of one sequence: (row // seq) * 0 + (row % seq) * x_sm
    acc_gate = _tile_step(acc_gate, wg, x_ptr, offs_k, k_ok, offs_m, rows, rows, 0, x_sm, x_sk,
                          EVEN_K, BLOCK_M, DOT)
    acc_up = _tile_step(acc_up, wu, x_ptr, offs_k, k_ok, offs_m, rows, rows, 0, x_sm, x_sk,
                        EVEN_K, BLOCK_M, DOT)
    return acc_gate, acc_up


@triton.jit
def _gated_gemv_kernel(x_ptr, wg_ptr, wu_ptr, o_ptr, rows, x_sm, x_sk, wg_sn, wg_sk, wu_sn,
                       wu_sk, o_sm, o_sn, HIDDEN: tl.constexpr, COLS: tl.constexpr,
                       EVEN_K: tl.constexpr, GELU_TANH: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr = False,
                       PREFETCH: tl.constexpr = False, PDL: tl.constexpr = False):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < COLS
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < rows
    n64 = offs_n.to(tl.int64)[:, None]
    g_rows = wg_ptr + n64 * wg_sn
    u_rows = wu_ptr + n64 * wu_sn
    acc_gate = _zero_acc(BLOCK_M, BLOCK_N, DOT)
    acc_up = _zero_acc(BLOCK_M, BLOCK_N, DOT)
    if PDL:  # codegen/pdl.py: both weights' first tiles, then the wait, then x (the first step)
        # no kernel of a decode step writes a weight, so the first tiles load while the
        # previous kernel finishes; x and out wait for it
        offs_k = tl.arange(0, BLOCK_K)
        k_ok = offs_k < HIDDEN
        wg = _weight_tile(g_rows, offs_k, k_ok, n_ok, wg_sk, EVEN_K, False)
        wu = _weight_tile(u_rows, offs_k, k_ok, n_ok, wu_sk, EVEN_K, False)
        if PREFETCH:  # the rest of both slabs into L2 while the predecessor finishes
            n0 = tl.program_id(0) * BLOCK_N
            _prefetch_slab(wg_ptr, n0, COLS, wg_sn, wg_sk, BLOCK_K, HIDDEN, BLOCK_N,
                           HIDDEN - BLOCK_K)
            _prefetch_slab(wu_ptr, n0, COLS, wu_sn, wu_sk, BLOCK_K, HIDDEN, BLOCK_N,
                           HIDDEN - BLOCK_K)
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        acc_gate, acc_up = _gated_step(acc_gate, acc_up, wg, wu, x_ptr, offs_k, k_ok, offs_m,
                                       rows, x_sm, x_sk, EVEN_K, BLOCK_M, DOT)
    for k0 in range(PDL * BLOCK_K, HIDDEN, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < HIDDEN
        wg = _weight_tile(g_rows, offs_k, k_ok, n_ok, wg_sk, EVEN_K, False)
        wu = _weight_tile(u_rows, offs_k, k_ok, n_ok, wu_sk, EVEN_K, False)
        acc_gate, acc_up = _gated_step(acc_gate, acc_up, wg, wu, x_ptr, offs_k, k_ok, offs_m,
                                       rows, x_sm, x_sk, EVEN_K, BLOCK_M, DOT)
    y = _gated(_rows_first(acc_gate, DOT), _rows_first(acc_up, DOT), GELU_TANH)
    tl.store(o_ptr + offs_m[:, None] * o_sm + offs_n[None, :] * o_sn,
             y.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _config(bn: int, bk: int, dot: bool = False) -> dict:
    return {"GEMV": True, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": NUM_WARPS,
            "num_stages": NUM_STAGES, **({"DOT": True} if dot else {})}


def search_space(case: Case) -> list[dict]:
    """BLOCK_N x BLOCK_K tiles (BLOCK_K <= hidden where one fits, MIN_TILE elements and more),
    MAX_CONFIGS of them, guessed best first: the widest loads, then grids nearest
    TARGET_PROGRAMS programs. From DOT_MIN_ROWS rows, DOT_CONFIGS tensor-core ones too (gemv's
    `dot_tiles` ranks them), first from DOT_LEAD_ROWS rows: the family's guess (Family.leads).
    Every config carries "GEMV": kernel.render sends it here."""
    hidden, cols = case["hidden"], case["cols"]
    tiles = guessed_tiles(hidden, lambda bn: cdiv(cols, bn), BLOCK_NS, BLOCK_KS, MIN_TILE, SMS,
                          TARGET_PROGRAMS, MAX_CONFIGS, cheapest=False)
    return with_dot_configs([_config(bn, bk) for bn, bk in tiles], case, hidden,
                            lambda bn: cdiv(cols, bn), 2, DOT_CONFIGS,
                            lambda bn, bk: _config(bn, bk, dot=True))


_HOST = '''\
_kernels = {}


def _kernel(block_m):
    """The launcher for a row block of `block_m` (a power of two up to MAX_ROWS)."""
    if block_m not in _kernels:
        _kernels[block_m] = launcher(
            _gated_gemv_kernel, HIDDEN=HIDDEN, COLS=COLS, EVEN_K=EVEN_K, GELU_TANH=GELU_TANH,
            BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT=DOT, num_warps=NUM_WARPS,
            num_stages=NUM_STAGES)
    return _kernels[block_m]


def forward(x, w_gate, w_up, *, out, **params) -> None:
    """x: (..., HIDDEN), any strides; w_gate, w_up: (COLS, HIDDEN), nn.Linear weights read in
    place (they may be views of one packed buffer); out: (..., COLS) with x's leading shape.
    MAX_ROWS rows per launch."""
    _check_params(params)
    _check_inputs(x, w_gate, w_up, out)
    x = x.reshape(-1, HIDDEN)  # a view; copies only when the leading dims cannot be merged
    out = out.view(-1, COLS)
    for r0 in range(0, x.shape[0], MAX_ROWS):
        xs, os_ = x[r0:r0 + MAX_ROWS], out[r0:r0 + MAX_ROWS]
        rows = xs.shape[0]
        _kernel(max(MIN_BLOCK_M, 1 << (rows - 1).bit_length()))(
            (N_BLOCKS,), xs, w_gate, w_up, os_, rows, xs.stride(0), xs.stride(1),
            w_gate.stride(0), w_gate.stride(1), w_up.stride(0), w_up.stride(1),
            os_.stride(0), os_.stride(1))
'''


def render(config: dict, case: Case, helpers: str, formula: str) -> str:
    """The candidate's source; `helpers` and `formula`: kernel.py's input checks and the
    formula's words, shared with its tile kernels."""
    hidden, cols, act, dtype = case["hidden"], case["cols"], case["act"], case["dtype"]
    bn, bk = config["BLOCK_N"], config["BLOCK_K"]
    dot = bool(config.get("DOT", False))
    sums = f"one tensor-core dot per weight, x's rows padded to {DOT_ROWS}, fp32 sums" \
        if dot else "fp32 sums"
    head = textwrap.dedent(f'''\
        """Gated MLP GEMV candidate: out = {formula}.

        Generated by codegen.matmul_epilogue.gemv.render: one launch per {MAX_ROWS} rows of
        {cdiv(cols, bn)} programs, each {bn} rows of both weights x {bk} columns per step
        ({sums}), the activation and the multiply on the sums, one rounding.
        Specialised for hidden={hidden}, cols={cols}, {dtype}; tuned for {case["rows"]} rows.
        {config["num_warps"]} warps, {config["num_stages"]} stages.
        case:   {json.dumps(case)}
        config: {json.dumps(config)}
        """

        import torch
        import triton
        import triton.language as tl

        from codegen.launch import launcher

        HIDDEN = {hidden}
        COLS = {cols}
        DTYPE = {dtype!r}
        TORCH_DTYPE = getattr(torch, DTYPE)
        GELU_TANH = {act == "gelu_tanh"}
        MAX_ROWS = {MAX_ROWS}
        BLOCK_N = {bn}
        BLOCK_K = {bk}
        DOT = {dot}
        MIN_BLOCK_M = {DOT_ROWS if dot else 1}
        EVEN_K = {hidden % bk == 0}
        N_BLOCKS = {cdiv(cols, bn)}
        NUM_WARPS = {config["num_warps"]}
        NUM_STAGES = {config["num_stages"]}
        BAKED_PARAMS = {{"act": {act!r}}}
        ''')
    return "\n\n".join([head, kernel_source(_gated), step_sources(),
                        kernel_source(_gated_step),
                        kernel_source(_gated_gemv_kernel), helpers, _HOST])
