"""Triton dual GEMM with the gated activation in its epilogue: out = act(x Wg^T) * (x Wu^T).

HF (and gated_act after it) writes gate and up, two (rows, cols) tensors, to memory and reads
them back for the activation; here each program computes one (BM, BN) tile of both products
in two fp32 accumulators that never leave the chip, applies the activation, multiplies, rounds
once to the output dtype and stores the product: x and both weights are read once (per tile),
the product written once, and one launch replaces three.

Two kernels. The pointer kernel: one program per output tile, numbered in grouped order
(GROUP_M row blocks share a column block before moving on), so programs running together reuse
the same weight tiles from L2; the benchmarks/probes/epilogue_probe.py kernel, specialised; it
is the faster one at few rows. The TMA kernel (configs with "TMA"; prefill rows): tiles arrive
through tensor descriptors made on the device, and one program per SM walks the tiles in the
same order; on the H200 it beat cuBLAS's projections plus gated_act by 7-10 %.

HIDDEN and COLS are constexpr: the K loop's trip count is known, and the pointer kernel's
masked tail exists only where BK does not divide HIDDEN. Its loads wrap rows and columns past
the edge back into the tensor (`% n_rows`, `% COLS`) instead of masking them: those lanes
compute values nobody stores, and the loads need no row or column mask; the store is masked.

Precision: both tl.dot calls accumulate in fp32 (the accumulator's dtype). For fp32 inputs
the dot runs with input_precision="ieee", since torch does not use TF32 for fp32 matmuls by
default and the verifier compares with what torch computes; for 16-bit inputs the setting has
no effect (the tensor cores multiply them exactly and accumulate in fp32). Under the CPU
interpreter tl.dot is numpy's matmul with an fp32 result type, which converts 16-bit operands
to fp32 first: the same fp32 accumulation, so the kernel is unchanged there. bf16 is the one
dtype the interpreter gets wrong (its bf16 values are not numpy floats), so bf16 checks run on
a GPU.
"""

from __future__ import annotations

import json
import textwrap

import triton
import triton.language as tl

from codegen.dtypes import element_size
from codegen.matmul.reference import GEMV_MAX_ROWS
from codegen.matmul_epilogue.epilogue import _gated
from codegen.matmul_epilogue.reference import MAX_BLOCK_M
from core.family import Case
from core.source import kernel_source


@triton.jit
def _tile(tile, n_rows, COLS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
          GROUP_M: tl.constexpr):
    """(row block, column block) of output tile number `tile` in grouped order: GROUP_M row
    blocks walk one column block together, so programs running at once share weight tiles
    in L2."""
    n_row_blocks = tl.cdiv(n_rows, BM)
    n_col_blocks = (COLS + BN - 1) // BN
    first_row_block = tile // (GROUP_M * n_col_blocks) * GROUP_M
    group_rows = tl.minimum(n_row_blocks - first_row_block, GROUP_M)
    row_block = first_row_block + (tile % (GROUP_M * n_col_blocks)) % group_rows
    col_block = (tile % (GROUP_M * n_col_blocks)) // group_rows
    return row_block, col_block


@triton.jit
def _gated_gemm_kernel(x_ptr, wg_ptr, wu_ptr, out_ptr, n_rows,
                       x_row_stride, x_col_stride, wg_row_stride, wg_col_stride,
                       wu_row_stride, wu_col_stride, out_row_stride, out_col_stride,
                       HIDDEN: tl.constexpr, COLS: tl.constexpr, GELU_TANH: tl.constexpr,
                       INPUT_PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, GROUP_M: tl.constexpr):
    row_block, col_block = _tile(tl.program_id(0), n_rows, COLS, BM, BN, GROUP_M)
    # int64: the output's row * stride passes 2**31 at 150k tokens of Llama-3.1-8B's 14336.
    rows = row_block.to(tl.int64) * BM + tl.arange(0, BM)
    cols = col_block.to(tl.int64) * BN + tl.arange(0, BN)
    ks = tl.arange(0, BK)
    # Past-the-edge rows and columns load real data (wrapped) and are never stored.
    x_ptrs = x_ptr + (rows % n_rows)[:, None] * x_row_stride + ks[None, :] * x_col_stride
    wg_ptrs = wg_ptr + (cols % COLS)[None, :] * wg_row_stride + ks[:, None] * wg_col_stride
    wu_ptrs = wu_ptr + (cols % COLS)[None, :] * wu_row_stride + ks[:, None] * wu_col_stride

    acc_gate = tl.zeros((BM, BN), dtype=tl.float32)
    acc_up = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, HIDDEN, BK):
        if HIDDEN % BK == 0:  # decided at compile time: every step is a full BK
            x = tl.load(x_ptrs)
            wg = tl.load(wg_ptrs)
            wu = tl.load(wu_ptrs)
        else:  # the last step is partial: zeros past HIDDEN add nothing to the dots
            k_in = ks < HIDDEN - k
            x = tl.load(x_ptrs, mask=k_in[None, :], other=0.0)
            wg = tl.load(wg_ptrs, mask=k_in[:, None], other=0.0)
            wu = tl.load(wu_ptrs, mask=k_in[:, None], other=0.0)
        acc_gate = tl.dot(x, wg, acc_gate, input_precision=INPUT_PRECISION)
        acc_up = tl.dot(x, wu, acc_up, input_precision=INPUT_PRECISION)
        x_ptrs += BK * x_col_stride
        wg_ptrs += BK * wg_col_stride
        wu_ptrs += BK * wu_col_stride

    out_ptrs = out_ptr + rows[:, None] * out_row_stride + cols[None, :] * out_col_stride
    mask = (rows[:, None] < n_rows) & (cols[None, :] < COLS)
    tl.store(out_ptrs, _gated(acc_gate, acc_up, GELU_TANH).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _gated_gemm_tma_kernel(x_ptr, wg_ptr, wu_ptr, out_ptr, n_rows, x_row_stride, wg_row_stride,
                           wu_row_stride, out_row_stride, programs,
                           HIDDEN: tl.constexpr, COLS: tl.constexpr, GELU_TANH: tl.constexpr,
                           INPUT_PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                           BK: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr,
                           SUBTILE: tl.constexpr = False):
    # Tiles arrive through TMA descriptors (Hopper's bulk copies into shared memory: no address
    # arithmetic in the loop, and the copy engine zero-fills past the edges, so no masks); the
    # store is clipped at the edges the same way. The descriptors are made here, on the device,
    # so the host launches plain pointers through codegen.launch (host-made descriptors went
    # through Triton's JIT on every call, about a hundred microseconds of host per MLP call:
    # enough to make a faster kernel slow the model). `programs` programs (one per SM) walk the
    # output tiles in grouped order (`_tile`), which beats cuBLAS's gate and up GEMMs plus
    # gated_act at prefill shapes (benchmarks/probes/README.md, `epilogue_probe.py`).
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[n_rows, HIDDEN], strides=[x_row_stride, 1],
                                       block_shape=[BM, BK])
    wg_desc = tl.make_tensor_descriptor(wg_ptr, shape=[COLS, HIDDEN],
                                        strides=[wg_row_stride, 1], block_shape=[BN, BK])
    wu_desc = tl.make_tensor_descriptor(wu_ptr, shape=[COLS, HIDDEN],
                                        strides=[wu_row_stride, 1], block_shape=[BN, BK])
    out_desc = tl.make_tensor_descriptor(out_ptr, shape=[n_rows, COLS],
                                         strides=[out_row_stride, 1],
                                         block_shape=[BM, BN // 2 if SUBTILE else BN])
    tiles = tl.cdiv(n_rows, BM) * ((COLS + BN - 1) // BN)
    for tile in tl.range(tl.program_id(0), tiles, programs):
        row_block, col_block = _tile(tile, n_rows, COLS, BM, BN, GROUP_M)
        off_m, off_n = row_block * BM, col_block * BN
        acc_gate = tl.zeros((BM, BN), dtype=tl.float32)
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)
        for k in tl.range(0, HIDDEN, BK, num_stages=STAGES):
            x = x_desc.load([off_m, k])
            acc_gate = tl.dot(x, wg_desc.load([off_n, k]).T, acc_gate,
                              input_precision=INPUT_PRECISION)
            acc_up = tl.dot(x, wu_desc.load([off_n, k]).T, acc_up,
                            input_precision=INPUT_PRECISION)
        y = _gated(acc_gate, acc_up, GELU_TANH).to(out_desc.dtype)
        if SUBTILE:  # two half-width stores: half the shared memory staging the output tile
            y0, y1 = tl.split(tl.permute(tl.reshape(y, (BM, 2, BN // 2)), (0, 2, 1)))
            out_desc.store([off_m, off_n], y0)
            out_desc.store([off_m, off_n + BN // 2], y1)
        else:
            out_desc.store([off_m, off_n], y)


@triton.jit
def _gated_gemm_wide_kernel(x_ptr, w_ptr, out_ptr, n_rows, x_row_stride, pair_stride,
                            w_row_stride, out_row_stride, programs, HIDDEN: tl.constexpr,
                            COLS: tl.constexpr, UP_FIRST: tl.constexpr,
                            GELU_TANH: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                            BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                            GROUP_M: tl.constexpr, STAGES: tl.constexpr):
    # The TMA kernel's loop with one dot per K step instead of two: gate's and up's tiles
    # arrive as one (2, BN, BK) box of a three-dimensional descriptor whose leading stride is
    # the distance between the two weights (no copy, no packed buffer: TMA reads only the
    # boxes), viewed as (2 BN, BK), into one (BM, 2 BN) accumulator, the n = 256 wgmma of
    # cuBLAS's widest tiles. Each warpgroup reads its x rows from shared memory once per step,
    # not twice; the registers per thread are the two accumulators' (benchmarks/probes/
    # dual_gemm_wide.py). w_ptr is the lower-addressed weight (TMA strides are positive):
    # UP_FIRST says which of the two it is.
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[n_rows, HIDDEN], strides=[x_row_stride, 1],
                                       block_shape=[BM, BK])
    w_desc = tl.make_tensor_descriptor(w_ptr, shape=[2, COLS, HIDDEN],
                                       strides=[pair_stride, w_row_stride, 1],
                                       block_shape=[2, BN, BK])
    out_desc = tl.make_tensor_descriptor(out_ptr, shape=[n_rows, COLS],
                                         strides=[out_row_stride, 1], block_shape=[BM, BN])
    tiles = tl.cdiv(n_rows, BM) * ((COLS + BN - 1) // BN)
    for tile in tl.range(tl.program_id(0), tiles, programs):
        row_block, col_block = _tile(tile, n_rows, COLS, BM, BN, GROUP_M)
        off_m, off_n = row_block * BM, col_block * BN
        acc = tl.zeros((BM, 2 * BN), dtype=tl.float32)
        for k in tl.range(0, HIDDEN, BK, num_stages=STAGES):
            w = tl.reshape(w_desc.load([0, off_n, k]), (2 * BN, BK))
            acc = tl.dot(x_desc.load([off_m, k]), w.T, acc, input_precision=INPUT_PRECISION)
        first, second = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN)), (0, 2, 1)))
        if UP_FIRST:
            y = _gated(second, first, GELU_TANH)
        else:
            y = _gated(first, second, GELU_TANH)
        out_desc.store([off_m, off_n], y.to(out_desc.dtype))


# (BM, BN, BK, num_warps, num_stages, GROUP_M), small tiles to large. Prefill rows: the probe's
# tiles (probes/epilogue_probe.py: 128 x 128 x 64 with 8 warps was its best on the H200 for
# both models, 3 stages for Llama, 4 for Qwen; 128 x 64 and 64 x 128 were 20-25 % slower) and
# their neighbours. Two accumulators per tile make 128 x 128 the
# widest worth trying: 2 x 64 KiB of fp32 already fill half the register file of 8 warps.
PREFILL_TILES = (
    (64, 64, 64, 4, 4, 8),
    (64, 128, 32, 4, 4, 8),
    (64, 128, 64, 4, 3, 8),
    (128, 64, 32, 4, 4, 8),
    (128, 64, 64, 4, 3, 8),
    (128, 64, 64, 8, 4, 8),
    (128, 128, 32, 8, 3, 8),
    (128, 128, 32, 8, 4, 8),
    (128, 128, 64, 8, 4, 8),
    (128, 128, 64, 8, 3, 8),
)
# Few rows (decode, batch-1 prefill of a short prompt): the weights are the traffic, and a
# 128-row tile would mostly multiply the wrapped copies of the same rows. Narrow column blocks
# give enough programs to cover the SMs (cols / BN of them), long K steps keep loads wide.
FEW_ROWS_TILES = (
    (16, 32, 128, 4, 4, 8),
    (16, 64, 128, 4, 4, 8),
    (32, 32, 128, 4, 4, 8),
    (16, 128, 64, 4, 4, 8),
    (32, 64, 128, 4, 4, 8),
    (32, 128, 64, 4, 3, 8),
    (64, 64, 128, 4, 3, 8),
)
FEW_ROWS = 64
# Shared memory of the pipelined loads: num_stages copies of one x tile and two weight tiles.
# BK above counts 16-bit elements; an fp32 case takes half as many per step, so every dtype
# moves the same bytes per stage and the deepest pipeline (128 x 128 x 64, 4 stages: 192 KiB)
# stays within an H100/H200's 227 KiB per block (an A100's 164 KiB rejects it at compile time,
# which the search records as a failed config).
SMEM_LIMIT = 227 * 1024

assert max(t[0] for t in PREFILL_TILES + FEW_ROWS_TILES) == MAX_BLOCK_M


def _config(tile: tuple, elem_bytes: int) -> dict:
    bm, bn, bk, warps, stages, group_m = tile
    return {"BM": bm, "BN": bn, "BK": max(16, bk * 2 // elem_bytes), "num_warps": warps,
            "num_stages": stages, "GROUP_M": group_m}


def smem_bytes(config: dict, case: Case) -> int:
    c = config
    return c["num_stages"] * (c["BM"] * c["BK"] + 2 * c["BK"] * c["BN"]) * element_size(case)


# The TMA kernel's tiles, persistent (one program per SM): the probe's two best at both models'
# prefill shapes; at 128 rows or fewer the pointer kernel was faster (30 against 54 us).
# Each also with its output tile stored in two halves (SUBTILE): half the shared memory staging
# it. On the H200 (benchmarks/kernel_table.py, every config side by side) that was 806 and
# 803 us against 833 and 817 at Llama-3.2-1B b8, and even (236-237 us) at Qwen2.5-0.5B's.
# Measured and left out, on the same shapes (Triton 3.6):
# - the tile loop flattened into the K loop (`tl.range(..., flatten=True)`, as Triton's
#   persistent matmul tutorial does on Hopper): 1.026 and 1.029 ms against 0.845 and 0.842 ms;
# - the tile loop warp-specialized (`tl.range(..., warp_specialize=True)`, a loading and a
#   computing partition): 830 and 823 us against 833 and 817 (Llama), 236 and 235 against 236
#   and 235 (Qwen); with SUBTILE, 836 and 825. Nothing gained, so not searched.
TMA_TILES = ((128, 128, 64, 8, 4, 8), (128, 128, 64, 8, 3, 8))
TMA_VARIANTS = ({}, {"SUBTILE": True})
# The wide kernel ("WIDE") is searched at the same tiles (BN per weight, so its accumulator is
# BM x 2 BN). On an H100 at 8192 rows (benchmarks/probes/dual_gemm_wide.py) they were
# 0.8-2.6 % faster than the two-dot kernel's best at all four b8 models' shapes, 4 stages best
# on Qwen's and Phi-3's, 3 on Llama's and Gemma's; 64 x 2*128 on 4 warps (cuBLAS's 64 x 256
# per warpgroup) and 128 x 2*64 were 12-20 % slower, so not searched.
TMA_MIN_ROWS = 256


def tma_ok(case: Case) -> bool:
    """TMA descriptors need 16-byte row strides: x's and the weights' (hidden) and out's (cols)."""
    size = element_size(case)
    return case["hidden"] * size % 16 == 0 and case["cols"] * size % 16 == 0


def search_space(case: Case) -> list[dict]:
    """Tile configs ordered by tile area, smallest first; the last is the widest tile (the one
    a CPU run uses: the fewest programs for the interpreter). Up to FEW_ROWS rows, the
    few-rows tiles and the widest prefill tile; above, the prefill tiles, and from TMA_MIN_ROWS
    rows the TMA kernel's where the strides allow it. At a decode step's rows (at most
    GEMV_MAX_ROWS) the GEMV kernel's configs come first (gemv.py), guessed best first: the
    search's `spread` takes the first and the last of the list."""
    tiles = FEW_ROWS_TILES + PREFILL_TILES[-1:] if case["rows"] <= FEW_ROWS else PREFILL_TILES
    configs = [_config(t, element_size(case)) for t in tiles]
    if case["rows"] <= GEMV_MAX_ROWS:  # a decode step: the GEMV kernel (gemv.py) first
        from codegen.matmul_epilogue.gemv import search_space as gemv_space

        return gemv_space(case) + sorted(configs, key=lambda c: c["BM"] * c["BN"])
    if case["rows"] >= TMA_MIN_ROWS and tma_ok(case):
        configs += [{**_config(t, element_size(case)), "TMA": True, **v} for t in TMA_TILES
                    for v in TMA_VARIANTS]
        configs += [{**_config(t, element_size(case)), "TMA": True, "WIDE": True}
                    for t in TMA_TILES]
    # stable: among tiles of one area the listed order stays (the probe's best comes last,
    # then the wide kernel's)
    return sorted(configs, key=lambda c: c["BM"] * c["BN"])


def input_precision(dtype: str) -> str:
    return "ieee" if dtype == "float32" else "tf32"


_FORMULA = {"silu": "silu(x @ w_gate^T) * (x @ w_up^T)",
            "gelu_tanh": "gelu_tanh(x @ w_gate^T) * (x @ w_up^T)"}

_HELPERS = '''\
def _check_params(params):
    if params and params != BAKED_PARAMS:
        raise ValueError(f"specialised for {BAKED_PARAMS}, called with {params}")


def _check_inputs(x, w_gate, w_up, out):
    if (x.shape[-1] != HIDDEN or out.shape[-1] != COLS or x.shape[:-1] != out.shape[:-1]
            or w_gate.shape != (COLS, HIDDEN) or w_up.shape != (COLS, HIDDEN)):
        raise ValueError(f"expected x (..., {HIDDEN}), weights ({COLS}, {HIDDEN}), out "
                         f"(..., {COLS}) with x's leading shape; got {tuple(x.shape)}, "
                         f"{tuple(w_gate.shape)}, {tuple(w_up.shape)}, {tuple(out.shape)}")
    if not x.dtype == w_gate.dtype == w_up.dtype == out.dtype == TORCH_DTYPE:
        # INPUT_PRECISION was chosen for DTYPE, and tl.dot takes one operand dtype
        raise ValueError(f"specialised for {DTYPE} tensors, got {x.dtype}, {w_gate.dtype}, "
                         f"{w_up.dtype}, {out.dtype}")
'''

_FORWARD = '''\
def forward(x, w_gate, w_up, *, out, **params) -> None:
    """x: (..., HIDDEN); w_gate, w_up: (COLS, HIDDEN), nn.Linear weights, read in place (they
    may be views of one packed buffer); out: (..., COLS) with x's leading shape."""
    _check_params(params)
    _check_inputs(x, w_gate, w_up, out)
    x = x.reshape(-1, HIDDEN)  # a view; copies only when the leading dims cannot be merged
    out = out.view(-1, COLS)
    rows = x.shape[0]
    if rows == 0:
        return
    _kernel((cdiv(rows, BM) * N_COL_BLOCKS,), x, w_gate, w_up, out, rows, x.stride(0),
            x.stride(1), w_gate.stride(0), w_gate.stride(1), w_up.stride(0), w_up.stride(1),
            out.stride(0), out.stride(1))
'''


_TMA_HELPERS = '''\
def _aligned(t):
    """What a TMA descriptor needs: unit last stride, 16-byte row stride and base address."""
    return (t.stride(-1) == 1 and t.stride(0) * ELEMENT_SIZE % 16 == 0
            and t.data_ptr() % 16 == 0)


def _fresh(t):
    """A copy in a new (aligned) buffer: `contiguous()` returns a contiguous view as it is,
    misaligned offset and all."""
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


_SMS = {}


def _programs(tiles, device):
    """One program per SM, looping over the tiles (one per tile under the CPU interpreter).
    On a GPU, also makes sure Triton has an allocator for the descriptors' scratch memory in
    this thread."""
    if device.type != "cuda":
        return tiles
    ensure_allocator()
    if device.index not in _SMS:
        _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return min(tiles, _SMS[device.index])
'''

# Both TMA kernels' forward: @...@ marks what differs (not str.format: the body has braces)
_TMA_FORWARD = '''\
def forward(x, w_gate, w_up, *, out, **params) -> None:
    """x: (..., HIDDEN); w_gate, w_up: (COLS, HIDDEN), nn.Linear weights, read in place (they
    may be views of one packed buffer); out: (..., COLS) with x's leading shape. A tensor TMA
    cannot address (a column slice, an odd offset) goes through an aligned copy@UNREACHABLE@."""
    _check_params(params)
    _check_inputs(x, w_gate, w_up, out)
    x = x.reshape(-1, HIDDEN)
    dst = out.view(-1, COLS)
    rows = x.shape[0]
    if rows == 0:
        return
    # spelled out: a generator over the three costs the host about 1 us more per call
    x = x if _aligned(x) else _fresh(x)
@WEIGHTS@
    res = dst if _aligned(dst) else torch.empty(dst.shape, dtype=dst.dtype, device=dst.device)
    programs = _programs(cdiv(rows, BM) * N_COL_BLOCKS, x.device)
@LAUNCH@
    if res is not dst:
        dst.copy_(res)
'''

_FORWARD_TMA = _TMA_HELPERS + "\n\n" + _TMA_FORWARD.replace("@UNREACHABLE@", "").replace(
    "@WEIGHTS@", """\
    w_gate = w_gate if _aligned(w_gate) else _fresh(w_gate)
    w_up = w_up if _aligned(w_up) else _fresh(w_up)""").replace("@LAUNCH@", """\
    _kernel((programs,), x, w_gate, w_up, res, rows, x.stride(0), w_gate.stride(0),
            w_up.stride(0), res.stride(0), programs)""")

_FORWARD_WIDE = _TMA_HELPERS + '''

def _pairable(w_gate, w_up):
    """Whether one descriptor reaches both weights: equal strides, a 16-byte distance."""
    return (w_gate.stride() == w_up.stride()
            and (w_gate.data_ptr() - w_up.data_ptr()) % 16 == 0)


''' + _TMA_FORWARD.replace(
    "@UNREACHABLE@", "; so do both\n    weights where one descriptor cannot reach the two").replace(
    "@WEIGHTS@", """\
    if not (_aligned(w_gate) and _aligned(w_up) and _pairable(w_gate, w_up)):
        w_gate, w_up = _fresh(w_gate), _fresh(w_up)
    up_first = w_up.data_ptr() < w_gate.data_ptr()
    lo, hi = (w_up, w_gate) if up_first else (w_gate, w_up)
    pair = (hi.data_ptr() - lo.data_ptr()) // ELEMENT_SIZE""").replace("@LAUNCH@", """\
    (_kernel_up_first if up_first else _kernel)(
        (programs,), x, lo, res, rows, x.stride(0), pair, lo.stride(0), res.stride(0),
        programs)""")


def render(config: dict, case: Case) -> str:
    if config.get("GEMV"):
        from codegen.matmul_epilogue.gemv import render as render_gemv

        return render_gemv(config, case, _HELPERS, _FORMULA[case["act"]])
    hidden, cols, act, dtype = case["hidden"], case["cols"], case["act"], case["dtype"]
    bm, bn, bk = config["BM"], config["BN"], config["BK"]
    warps, stages, group_m = config["num_warps"], config["num_stages"], config["GROUP_M"]
    precision = input_precision(dtype)
    why = ("torch's fp32 matmul does not use TF32" if precision == "ieee"
           else "no effect on 16-bit operands")
    tma = bool(config.get("TMA"))
    wide = tma and bool(config.get("WIDE"))
    launch = ("one program per SM walking the tiles, loads and stores through TMA "
              "descriptors" if tma else "one program per tile")
    accumulators = (f"One fp32 ({bm} x {2 * bn}) accumulator over both weights (one dot per K "
                    f"step) per ({bm} x {bn}) output tile" if wide
                    else f"Two fp32 accumulators per ({bm} x {bn}) output tile")
    imports = "cdiv, ensure_allocator, launcher" if tma else "cdiv, launcher"
    header = textwrap.dedent(f'''\
        """Gated MLP GEMM candidate: out = {_FORMULA[act]}.

        Generated by codegen.matmul_epilogue.kernel.render. {accumulators}, the
        activation and the multiply in the epilogue, one rounding to the output dtype.
        Specialised for hidden={hidden}, cols={cols}, {dtype}; tuned for {case["rows"]} rows.
        Launch: {launch} in groups of {group_m} row blocks, K in steps of {bk}, {warps} warps,
        {stages} stages.
        case:   {json.dumps(case)}
        config: {json.dumps(config)}
        """

        import torch
        import triton
        import triton.language as tl

        from codegen.launch import {imports}

        HIDDEN = {hidden}
        COLS = {cols}
        DTYPE = {dtype!r}
        TORCH_DTYPE = getattr(torch, DTYPE)
        ELEMENT_SIZE = TORCH_DTYPE.itemsize  # every tensor's, once _check_inputs passed
        GELU_TANH = {act == "gelu_tanh"}
        INPUT_PRECISION = {precision!r}  # {why}
        BM = {bm}
        BN = {bn}
        BK = {bk}
        GROUP_M = {group_m}
        NUM_WARPS = {warps}
        NUM_STAGES = {stages}
        N_COL_BLOCKS = {-(-cols // bn)}
        BAKED_PARAMS = {{"act": {act!r}}}
        ''')
    kernel = (_gated_gemm_wide_kernel if wide else _gated_gemm_tma_kernel if tma
              else _gated_gemm_kernel)
    # the TMA kernels pipeline their K loop themselves (tl.range's num_stages), the other via
    # the launch option
    pipelining = "STAGES=NUM_STAGES" if tma else "num_stages=NUM_STAGES"
    if tma and not wide:  # bound even at its default: codegen.launch's direct path binds
        pipelining += f", SUBTILE={bool(config.get('SUBTILE'))}"  # trailing ones
    options = ("HIDDEN=HIDDEN, COLS=COLS, GELU_TANH=GELU_TANH,\n                   "
               "INPUT_PRECISION=INPUT_PRECISION, BM=BM, BN=BN, BK=BK, GROUP_M=GROUP_M,\n"
               f"                   num_warps=NUM_WARPS, {pipelining}")
    name = kernel.fn.__name__
    if wide:  # which weight lies first in memory is a compile-time choice of the epilogue
        bind = (f"_kernel = launcher({name}, UP_FIRST=False, {options})\n"
                f"_kernel_up_first = launcher({name}, UP_FIRST=True, {options})\n")
    else:
        bind = f"_kernel = launcher({name}, {options})\n"
    forward = _FORWARD_WIDE if wide else _FORWARD_TMA if tma else _FORWARD
    return "\n\n".join([header, kernel_source(_gated), kernel_source(_tile),
                         kernel_source(kernel), bind, _HELPERS, forward])
