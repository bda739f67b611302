"""Triton fused experts: routing, sorting by expert, grouped GEMMs, the top-k sum.

HF's grouped_mm path (its default) runs about twenty aten ops per layer: the router's GEMM,
softmax, top-k and normalisation, a sort, gathers of the hidden states and the routing weights,
a histogram and a cumulative sum, two grouped GEMMs with the activation and multiply between
them (writing and reading the (pairs, 2 x inter) product), the weighting, an inverse
permutation and the sum. Here, as vLLM's fused_moe does it:

    route    one program per BT tokens: the router GEMM in fp32, softmax and top-k as the model
             orders them (ties to the lower expert), the weights normalised; for the grouped
             path also each program's count per expert and each pair's rank among them
    align    the (token, expert) pairs sorted by expert into slots padded to the row block BM,
             and each row block's expert (deterministic: counts and ranks, no atomics)
    gate_up  one grouped GEMM launch: per row block, both accumulators of its expert's gate and
             up tiles on chip, the activation in the epilogue; writes (slots, inter)
    down     one grouped GEMM launch: the expert's down tile, times each pair's router weight
    sum      each token's k weighted rows summed in fp32, rounded once

That is the prefill path (many tokens per expert). At decode (a few tokens, PATH "gemv") the
weight reads decide: no sorting, one program per (pair, column block) streams its expert's rows
once, multiplies in fp32 (no tensor-core tile to fill with one row), and the down kernel sums a
token's k experts in the same program (or per pair, then `sum`, where that gives more programs:
SPLIT). Intermediates stay fp32 there.

Precision: every GEMM accumulates in fp32 (input_precision "ieee" for fp32 inputs: torch does
not use TF32 for fp32 matmuls by default); the router's logits stay fp32 (HF rounds them to the
model's dtype before its fp32 softmax, which flips near-ties); the grouped path rounds the
intermediate and each weighted expert row once to the model's dtype (HF rounds gate, up, the
activation, the product and the weighted row). Under the CPU interpreter fp32 and fp16 are
right; bf16 is checked on a GPU.
"""

from __future__ import annotations

import json
import textwrap

import triton
import triton.language as tl

from codegen.moe_experts.reference import BIASED, TOPK_FIRST
from core.family import Case
from core.source import kernel_source


@triton.jit
def _moe_route_kernel(x_ptr, wr_ptr, br_ptr, ids_ptr, wts_ptr, rank_ptr, counts_ptr, n_tokens,
                      x_stride, wr_stride,
                      HIDDEN: tl.constexpr, E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr,
                      KP: tl.constexpr, TOPK_FIRST: tl.constexpr, NORM: tl.constexpr,
                      HAS_BIAS: tl.constexpr, COUNT: tl.constexpr,
                      INPUT_PRECISION: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BT + tl.arange(0, BT)
    row_ok = rows < n_tokens
    ex = tl.arange(0, EP)
    e_ok = ex < E
    ks = tl.arange(0, BK)
    acc = tl.zeros((BT, EP), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BK):
        kk = k0 + ks
        k_ok = kk < HIDDEN
        xt = tl.load(x_ptr + rows.to(tl.int64)[:, None] * x_stride + kk[None, :],
                     mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        wt = tl.load(wr_ptr + ex[None, :] * wr_stride + kk[:, None],
                     mask=e_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(xt, wt, acc, input_precision=INPUT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(br_ptr + ex, mask=e_ok, other=0.0).to(tl.float32)[None, :]
    if TOPK_FIRST:
        score = acc
    else:  # the model's fp32 softmax over its experts, then the top k of the probabilities
        top = tl.max(tl.where(e_ok[None, :], acc, float("-inf")), axis=1)
        p = tl.where(e_ok[None, :], tl.exp(acc - top[:, None]), 0.0)
        score = p / tl.sum(p, axis=1)[:, None]
    # torch.topk ranks NaN above everything: a NaN row picks some expert and stays NaN
    key = tl.where(score != score, float("inf"), score)
    avail = e_ok[None, :] & (rows >= 0)[:, None]
    kcol = tl.arange(0, KP)
    idxs = tl.zeros((BT, KP), dtype=tl.int32)
    vals = tl.zeros((BT, KP), dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.max(tl.where(avail, key, float("-inf")), axis=1)
        cand = avail & (key == best[:, None])
        idx = tl.min(tl.where(cand, ex[None, :], EP), axis=1)  # ties: the lower expert
        idx = tl.where(idx < E, idx, 0)
        sel = ex[None, :] == idx[:, None]
        val = tl.sum(tl.where(sel, score, 0.0), axis=1)
        avail = avail & ~sel
        idxs = tl.where(kcol[None, :] == j, idx[:, None], idxs)
        vals = tl.where(kcol[None, :] == j, val[:, None], vals)
    k_ok = kcol < K
    if TOPK_FIRST:  # softmax over the k chosen logits
        top = tl.max(tl.where(k_ok[None, :], vals, float("-inf")), axis=1)
        p = tl.where(k_ok[None, :], tl.exp(vals - top[:, None]), 0.0)
        vals = p / tl.sum(p, axis=1)[:, None]
    elif NORM:
        vals = vals / tl.sum(tl.where(k_ok[None, :], vals, 0.0), axis=1)[:, None]
    pair = rows.to(tl.int64)[:, None] * K + kcol[None, :]
    store = row_ok[:, None] & k_ok[None, :]
    tl.store(ids_ptr + pair, idxs, mask=store)
    tl.store(wts_ptr + pair, vals, mask=store)
    if COUNT:
        # tokens of this program per expert, and each pair's rank among its expert's pairs
        # here (a token takes an expert once, so rank = tokens above it that took it too)
        taken = (e_ok[None, :] & ~avail & row_ok[:, None]).to(tl.int32)
        tl.store(counts_ptr + pid * EP + ex, tl.sum(taken, axis=0))
        before = tl.cumsum(taken, axis=0) - taken
        ranks = tl.zeros((BT, KP), dtype=tl.int32)
        for j in tl.static_range(K):
            idx = tl.sum(tl.where(kcol[None, :] == j, idxs, 0), axis=1)
            r = tl.sum(tl.where(ex[None, :] == idx[:, None], before, 0), axis=1)
            ranks = tl.where(kcol[None, :] == j, r[:, None], ranks)
        tl.store(rank_ptr + pair, ranks, mask=store)


@triton.jit
def _moe_align_kernel(ids_ptr, rank_ptr, counts_ptr, sorted_ptr, block_expert_ptr, n_tokens,
                      n_route, max_blocks,
                      E: tl.constexpr, EP: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                      BM: tl.constexpr, QB: tl.constexpr, BB: tl.constexpr):
    # one program per routing program: its pairs go to slot offset[e] + (pairs of e in the
    # programs before it) + rank; program 0 also fills the padding and the block -> expert map
    pid = tl.program_id(0)
    ex = tl.arange(0, EP)
    e_ok = ex < E
    total = tl.zeros((EP,), dtype=tl.int32)
    before = tl.zeros((EP,), dtype=tl.int32)
    for q0 in range(0, n_route, QB):
        qs = q0 + tl.arange(0, QB)
        c = tl.load(counts_ptr + qs[:, None] * EP + ex[None, :], mask=(qs < n_route)[:, None],
                    other=0)
        total += tl.sum(c, axis=0)
        before += tl.sum(tl.where((qs < pid)[:, None], c, 0), axis=0)
    padded = tl.where(e_ok, (total + BM - 1) // BM * BM, 0)
    end = tl.cumsum(padded, axis=0)
    start = end - padded
    base = start + before
    rows = pid * BT + tl.arange(0, BT)
    row_ok = rows < n_tokens
    for j in tl.static_range(K):
        pair = rows.to(tl.int64) * K + j
        e = tl.load(ids_ptr + pair, mask=row_ok, other=0)
        r = tl.load(rank_ptr + pair, mask=row_ok, other=0)
        slot = tl.sum(tl.where(ex[None, :] == e[:, None], base[None, :], 0), axis=1) + r
        tl.store(sorted_ptr + slot, pair.to(tl.int32), mask=row_ok)
    if pid == 0:
        n_pairs = n_tokens * K
        pads = tl.arange(0, BM)
        # its own name: a variable of the loop above reassigned inside an `if` with another
        # shape fails to compile on Triton 3.6 (then and else blocks must agree on its type)
        pad_slot = (start + total)[:, None] + pads[None, :]
        tl.store(sorted_ptr + pad_slot, tl.zeros((EP, BM), dtype=tl.int32) + n_pairs,
                 mask=e_ok[:, None] & (pads[None, :] < (padded - total)[:, None]))
        used = tl.sum(padded, axis=0)
        for b0 in range(0, max_blocks, BB):
            bs = b0 + tl.arange(0, BB)
            first = bs * BM
            owner = tl.sum(tl.where(e_ok[None, :] & (end[None, :] <= first[:, None]), 1, 0),
                           axis=1)
            tl.store(block_expert_ptr + bs, tl.where(first < used, owner, -1),
                     mask=bs < max_blocks)


@triton.jit
def _activate(g, u, ACT: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr):
    """act(gate) * up on fp32 accumulators: SwiGLU (ACT 0), or gpt-oss's clamped form (ACT 1:
    gate clamped above, up both ways, gate * sigmoid(alpha gate) * (up + 1)). Clamps as
    `where` so a NaN stays NaN, as torch.clamp keeps it."""
    if ACT == 1:
        g = tl.where(g > LIMIT, LIMIT, g)
        u = tl.where(u > LIMIT, LIMIT, tl.where(u < -LIMIT, -LIMIT, u))
        return g * tl.sigmoid(g * ALPHA) * (u + 1.0)
    return g * tl.sigmoid(g) * u


@triton.jit
def _block_tile(pid, n_blocks, N_COL: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column block) of program `pid`: GROUP_M row blocks walk one column block
    together, so programs running at once share their expert's weight tiles in L2."""
    width = GROUP_M * N_COL
    first = pid // width * GROUP_M
    size = tl.minimum(n_blocks - first, GROUP_M)
    return first + (pid % width) % size, (pid % width) // size


@triton.jit
def _moe_gate_up_kernel(x_ptr, w_ptr, b_ptr, sorted_ptr, block_expert_ptr, h_ptr, n_pairs,
                        n_blocks, x_stride, w_se, w_sn, w_sk, up_off, b_se, b_sn, b_up,
                        h_stride,
                        HIDDEN: tl.constexpr, INTER: tl.constexpr, K: tl.constexpr,
                        ACT: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr,
                        HAS_BIAS: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        GROUP_M: tl.constexpr):
    blk, cb = _block_tile(tl.program_id(0), n_blocks, (INTER + BN - 1) // BN, GROUP_M)
    e = tl.load(block_expert_ptr + blk)
    if e >= 0:
        slots = blk.to(tl.int64) * BM + tl.arange(0, BM)
        pair = tl.load(sorted_ptr + slots)
        ok = pair < n_pairs
        tok = (pair // K).to(tl.int64)
        cols = cb * BN + tl.arange(0, BN)
        col_ok = cols < INTER
        ks = tl.arange(0, BK)
        wg_ptrs = w_ptr + e.to(tl.int64) * w_se + cols[None, :] * w_sn + ks[:, None] * w_sk
        x_ptrs = x_ptr + tok[:, None] * x_stride + ks[None, :]
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, HIDDEN, BK):
            k_ok = ks < HIDDEN - k0
            xt = tl.load(x_ptrs, mask=ok[:, None] & k_ok[None, :], other=0.0)
            wg = tl.load(wg_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            wu = tl.load(wg_ptrs + up_off, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc_g = tl.dot(xt, wg, acc_g, input_precision=INPUT_PRECISION)
            acc_u = tl.dot(xt, wu, acc_u, input_precision=INPUT_PRECISION)
            x_ptrs += BK
            wg_ptrs += BK * w_sk
        if HAS_BIAS:
            bg = b_ptr + e.to(tl.int64) * b_se + cols * b_sn
            acc_g += tl.load(bg, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(bg + b_up, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        h = _activate(acc_g, acc_u, ACT, LIMIT, ALPHA)
        tl.store(h_ptr + slots[:, None] * h_stride + cols[None, :],
                 h.to(h_ptr.dtype.element_ty), mask=ok[:, None] & col_ok[None, :])


@triton.jit
def _moe_down_kernel(h_ptr, w_ptr, b_ptr, sorted_ptr, block_expert_ptr, wts_ptr, y_ptr,
                     n_pairs, n_blocks, h_stride, w_se, w_sn, w_sk, b_se, y_stride,
                     HIDDEN: tl.constexpr, INTER: tl.constexpr, HAS_BIAS: tl.constexpr,
                     INPUT_PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, GROUP_M: tl.constexpr):
    blk, cb = _block_tile(tl.program_id(0), n_blocks, (HIDDEN + BN - 1) // BN, GROUP_M)
    e = tl.load(block_expert_ptr + blk)
    if e >= 0:
        slots = blk.to(tl.int64) * BM + tl.arange(0, BM)
        pair = tl.load(sorted_ptr + slots)
        ok = pair < n_pairs
        cols = cb * BN + tl.arange(0, BN)
        col_ok = cols < HIDDEN
        ks = tl.arange(0, BK)
        h_ptrs = h_ptr + slots[:, None] * h_stride + ks[None, :]
        w_ptrs = w_ptr + e.to(tl.int64) * w_se + cols[None, :] * w_sn + ks[:, None] * w_sk
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, INTER, BK):
            k_ok = ks < INTER - k0
            ht = tl.load(h_ptrs, mask=ok[:, None] & k_ok[None, :], other=0.0)
            wt = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(ht, wt, acc, input_precision=INPUT_PRECISION)
            h_ptrs += BK
            w_ptrs += BK * w_sk
        if HAS_BIAS:
            acc += tl.load(b_ptr + e.to(tl.int64) * b_se + cols, mask=col_ok,
                           other=0.0).to(tl.float32)[None, :]
        wt = tl.load(wts_ptr + pair, mask=ok, other=0.0)
        tl.store(y_ptr + pair.to(tl.int64)[:, None] * y_stride + cols[None, :],
                 (acc * wt[:, None]).to(y_ptr.dtype.element_ty),
                 mask=ok[:, None] & col_ok[None, :])


@triton.jit
def _moe_sum_kernel(y_ptr, out_ptr, n_tokens, y_stride, out_stride, HIDDEN: tl.constexpr,
                    K: tl.constexpr, ST: tl.constexpr, BH: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ST + tl.arange(0, ST)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    ok = (rows < n_tokens)[:, None] & (cols < HIDDEN)[None, :]
    acc = tl.zeros((ST, BH), dtype=tl.float32)
    for j in tl.static_range(K):
        acc += tl.load(y_ptr + (rows * K + j)[:, None] * y_stride + cols[None, :], mask=ok,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * out_stride + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _moe_gemv_gate_up_kernel(x_ptr, w_ptr, b_ptr, ids_ptr, h_ptr, x_stride, w_se, w_sn, w_sk,
                             up_off, b_se, b_sn, b_up, h_stride,
                             HIDDEN: tl.constexpr, INTER: tl.constexpr, K: tl.constexpr,
                             ACT: tl.constexpr, LIMIT: tl.constexpr, ALPHA: tl.constexpr,
                             HAS_BIAS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    col_ok = cols < INTER
    e = tl.load(ids_ptr + p).to(tl.int64)
    ks = tl.arange(0, BK)
    x_ptrs = x_ptr + (p // K) * x_stride + ks
    wg_ptrs = w_ptr + e * w_se + cols[:, None] * w_sn + ks[None, :] * w_sk
    acc_g = tl.zeros((BN,), dtype=tl.float32)
    acc_u = tl.zeros((BN,), dtype=tl.float32)
    for k0 in range(0, HIDDEN, BK):
        k_ok = ks < HIDDEN - k0
        xv = tl.load(x_ptrs, mask=k_ok, other=0.0).to(tl.float32)
        wg = tl.load(wg_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        wu = tl.load(wg_ptrs + up_off, mask=col_ok[:, None] & k_ok[None, :],
                     other=0.0).to(tl.float32)
        acc_g += tl.sum(wg * xv[None, :], axis=1)
        acc_u += tl.sum(wu * xv[None, :], axis=1)
        x_ptrs += BK
        wg_ptrs += BK * w_sk
    if HAS_BIAS:
        bg = b_ptr + e * b_se + cols * b_sn
        acc_g += tl.load(bg, mask=col_ok, other=0.0).to(tl.float32)
        acc_u += tl.load(bg + b_up, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(h_ptr + p * h_stride + cols, _activate(acc_g, acc_u, ACT, LIMIT, ALPHA),
             mask=col_ok)


@triton.jit
def _gemv_row(h_ptr, w_ptr, b_ptr, p, e, cols, col_ok, h_stride, w_se, w_sn, w_sk, b_se,
              HIDDEN: tl.constexpr, INTER: tl.constexpr, HAS_BIAS: tl.constexpr,
              BN: tl.constexpr, BK: tl.constexpr):
    """Expert e's down rows `cols` against pair p's intermediate, fp32 (+ its bias)."""
    ks = tl.arange(0, BK)
    h_ptrs = h_ptr + p * h_stride + ks
    w_ptrs = w_ptr + e * w_se + cols[:, None] * w_sn + ks[None, :] * w_sk
    acc = tl.zeros((BN,), dtype=tl.float32)
    for k0 in range(0, INTER, BK):
        k_ok = ks < INTER - k0
        hv = tl.load(h_ptrs, mask=k_ok, other=0.0)
        wt = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(wt * hv[None, :], axis=1)
        h_ptrs += BK
        w_ptrs += BK * w_sk
    if HAS_BIAS:
        acc += tl.load(b_ptr + e * b_se + cols, mask=col_ok, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _moe_gemv_down_kernel(h_ptr, w_ptr, b_ptr, ids_ptr, wts_ptr, out_ptr, h_stride, w_se,
                          w_sn, w_sk, b_se, out_stride,
                          HIDDEN: tl.constexpr, INTER: tl.constexpr, K: tl.constexpr,
                          HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BN: tl.constexpr,
                          BK: tl.constexpr):
    # SPLIT: one program per (pair, column block) writes the pair's weighted row (then
    # `_moe_sum_kernel`); else one per (token, column block) sums its k experts itself
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    col_ok = cols < HIDDEN
    if SPLIT:
        e = tl.load(ids_ptr + row).to(tl.int64)
        acc = tl.load(wts_ptr + row) * _gemv_row(h_ptr, w_ptr, b_ptr, row, e, cols, col_ok,
                                                 h_stride, w_se, w_sn, w_sk, b_se, HIDDEN,
                                                 INTER, HAS_BIAS, BN, BK)
    else:
        acc = tl.zeros((BN,), dtype=tl.float32)
        for j in tl.static_range(K):
            p = row * K + j
            e = tl.load(ids_ptr + p).to(tl.int64)
            acc += tl.load(wts_ptr + p) * _gemv_row(h_ptr, w_ptr, b_ptr, p, e, cols, col_ok,
                                                    h_stride, w_se, w_sn, w_sk, b_se, HIDDEN,
                                                    INTER, HAS_BIAS, BN, BK)
    tl.store(out_ptr + row * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


# Decode (PATH "gemv"): (BN, BK, SPLIT). Prefill ("grouped"): (BM, BN, BK, warps, stages),
# from small row blocks (a few tokens per expert) to the 128 x 128 tiles of a long prefill;
# vLLM's untuned default is BM 64, BN 64, BK 32, GROUP_M 8 (fused_moe.get_default_config).
GEMV = ((16, 128, False), (32, 128, False), (32, 256, True), (64, 128, True))
GROUPED = ((16, 64, 64, 4, 3), (32, 64, 64, 4, 3), (64, 64, 32, 4, 3), (64, 128, 64, 4, 3),
           (128, 64, 64, 4, 3), (128, 128, 64, 8, 3))
# at most this many (token, expert) pairs take the decode path; past it every expert of a
# model gets a few tokens and sorting them into row blocks pays
GEMV_MAX_PAIRS = 64
ROUTE_BT = 16  # tokens per routing program (the router GEMM's row tile, tl.dot's minimum)


def search_space(case: Case) -> list[dict]:
    """The decode path's configs where a call has at most GEMV_MAX_PAIRS pairs, then the
    grouped path's, row blocks no taller than needed for the pairs per expert (x4)."""
    pairs = case["rows"] * case["top_k"]
    per_expert = -(-pairs // case["experts"])
    configs = []
    if pairs <= GEMV_MAX_PAIRS:
        configs += [{"PATH": "gemv", "BN": bn, "BK": bk, "SPLIT": split, "num_warps": 4}
                    for bn, bk, split in GEMV]
    if pairs >= 16:
        tallest = max(16, triton.next_power_of_2(4 * per_expert))
        configs += [{"PATH": "grouped", "BM": bm, "BN": bn, "BK": bk, "GROUP_M": 8,
                     "num_warps": w, "num_stages": s}
                    for bm, bn, bk, w, s in GROUPED if bm <= tallest]
    return configs


def input_precision(dtype: str) -> str:
    return "ieee" if dtype == "float32" else "tf32"


_HELPERS = '''\
def _check(x, router_weight, gate_up, down, biases, out, params):
    if params and params != BAKED_PARAMS:
        raise ValueError(f"specialised for {BAKED_PARAMS}, called with {params}")
    if (x.dim() != 2 or x.shape[1] != HIDDEN or out.shape != x.shape or x.stride(1) != 1
            or out.stride(1) != 1 or tuple(router_weight.shape) != (E, HIDDEN)
            or router_weight.stride(1) != 1 or tuple(gate_up.shape) != GATE_UP_SHAPE
            or tuple(down.shape) != DOWN_SHAPE or len(biases) != (3 if BIASED else 0)):
        raise ValueError(f"expected x and out ({HIDDEN} wide rows), router ({E}, {HIDDEN}), "
                         f"gate_up {GATE_UP_SHAPE}, down {DOWN_SHAPE}"
                         f"{', three biases' if BIASED else ''}; got {tuple(x.shape)}, "
                         f"{tuple(out.shape)}, {tuple(router_weight.shape)}, "
                         f"{tuple(gate_up.shape)}, {tuple(down.shape)}, {len(biases)} biases")
    if not all(t.dtype == TORCH_DTYPE for t in (x, router_weight, gate_up, down, out, *biases)):
        raise ValueError(f"specialised for {DTYPE} tensors")


def _strides(gate_up, down, biases):
    """(gate's expert, column and k strides, the up half's offset; down's expert, column and k
    strides; the gate/up bias's expert and column strides and the up bias's offset)."""
    # gate_up (E, HIDDEN, 2 INTER), columns gate0, up0, gate1, ...; down (E, INTER, HIDDEN)
    if BIASED:
        s0, s1, s2 = gate_up.stride()
        gate = (s0, 2 * s2, s1, s2)
        d0, d1, d2 = down.stride()
        dn = (d0, d2, d1)
        b = biases[1].stride()
        bias = (b[0], 2 * b[1], b[1], biases[2].stride(0))
    else:  # gate_up (E, 2 INTER, HIDDEN), the up rows after the gate rows; down (E, HIDDEN, INTER)
        s0, s1, s2 = gate_up.stride()
        gate = (s0, s1, s2, INTER * s1)
        dn = down.stride()
        bias = (0, 0, 0, 0)
    return gate, dn, bias
'''

_ROUTE = '''\
def _route(x, router_weight, router_bias, count):
    tokens = x.shape[0]
    programs = cdiv(tokens, ROUTE_BT)
    ids = torch.empty(tokens * K, dtype=torch.int32, device=x.device)
    wts = torch.empty(tokens * K, dtype=torch.float32, device=x.device)
    rank = torch.empty(tokens * K if count else 1, dtype=torch.int32, device=x.device)
    counts = torch.empty(programs * EP if count else 1, dtype=torch.int32, device=x.device)
    _route_kernel((programs,), x, router_weight, router_bias, ids, wts, rank, counts, tokens,
                  x.stride(0), router_weight.stride(0))
    return ids, wts, rank, counts, programs
'''

# both forwards' opening: the checks, an empty batch, the biases and the weights' strides
_FORWARD_HEAD = '''\
def forward(x, router_weight, gate_up, down, *biases, out, **params) -> None:
    """x, out: (T, HIDDEN); the model's router weight and expert weights, read in place."""
    _check(x, router_weight, gate_up, down, biases, out, params)
    tokens = x.shape[0]
    if tokens == 0:
        return
    router_bias, gate_up_bias, down_bias = biases if BIASED else (x, x, x)
    gate, dn, bias = _strides(gate_up, down, biases)
'''

_FORWARD_GEMV = _FORWARD_HEAD + '''\
    ids, wts, _, _, _ = _route(x, router_weight, router_bias, False)
    pairs = tokens * K
    h = torch.empty((pairs, INTER), dtype=torch.float32, device=x.device)
    _gate_up_kernel((pairs, cdiv(INTER, BN)), x, gate_up, gate_up_bias, ids, h, x.stride(0),
                    *gate, *bias[:3], h.stride(0))
    if SPLIT:
        y = torch.empty((pairs, HIDDEN), dtype=torch.float32, device=x.device)
        _down_kernel((pairs, cdiv(HIDDEN, BN)), h, down, down_bias, ids, wts, y, h.stride(0),
                     *dn, bias[3], y.stride(0))
        _sum_kernel((cdiv(tokens, SUM_ST), cdiv(HIDDEN, SUM_BH)), y, out, tokens, y.stride(0),
                    out.stride(0))
    else:
        _down_kernel((tokens, cdiv(HIDDEN, BN)), h, down, down_bias, ids, wts, out,
                     h.stride(0), *dn, bias[3], out.stride(0))
'''

_FORWARD_GROUPED = _FORWARD_HEAD + '''\
    ids, wts, rank, counts, programs = _route(x, router_weight, router_bias, True)
    pairs = tokens * K
    # every expert's pairs padded to BM: at most one partial block per expert that has any
    blocks = cdiv(pairs, BM) + min(E, pairs)
    sorted_ids = torch.empty(blocks * BM, dtype=torch.int32, device=x.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=x.device)
    _align_kernel((programs,), ids, rank, counts, sorted_ids, block_expert, tokens, programs,
                  blocks)
    h = torch.empty((blocks * BM, INTER), dtype=x.dtype, device=x.device)
    _gate_up_kernel((blocks * cdiv(INTER, BN),), x, gate_up, gate_up_bias, sorted_ids,
                    block_expert, h, pairs, blocks, x.stride(0), *gate, *bias[:3], h.stride(0))
    y = torch.empty((pairs, HIDDEN), dtype=x.dtype, device=x.device)
    _down_kernel((blocks * cdiv(HIDDEN, BN),), h, down, down_bias, sorted_ids, block_expert,
                 wts, y, pairs, blocks, h.stride(0), *dn, bias[3], y.stride(0))
    _sum_kernel((cdiv(tokens, SUM_ST), cdiv(HIDDEN, SUM_BH)), y, out, tokens, y.stride(0),
                    out.stride(0))
'''


def _shapes(case: Case) -> tuple[tuple, tuple]:
    h, i, e = case["hidden"], case["inter"], case["experts"]
    if case["model_type"] in BIASED:
        return (e, h, 2 * i), (e, i, h)
    return (e, 2 * i, h), (e, h, i)


SUM_ST, SUM_BH = 8, 256  # tokens and columns per program of the top-k sum (streaming)


def render(config: dict, case: Case) -> str:
    from codegen.moe_experts.reference import params

    path = config["PATH"]
    h, i, e, k, dtype = (case["hidden"], case["inter"], case["experts"], case["top_k"],
                         case["dtype"])
    mt = case["model_type"]
    gate_up_shape, down_shape = _shapes(case)
    biased = mt in BIASED
    act = 1 if biased else 0
    limit, alpha = float(case.get("limit", 0.0)), float(case.get("alpha", 0.0))
    precision = input_precision(dtype)
    ep = max(16, triton.next_power_of_2(e))
    route = (f"topk of the logits, softmax over the {k}" if mt in TOPK_FIRST else
             f"softmax, top {k}" + (", renormalised" if case["norm_topk"] or mt == "mixtral"
                                    else ""))
    if path == "gemv":
        launch = (f"decode path: one program per (pair, {config['BN']} columns), K in steps of "
                  f"{config['BK']}, the k experts summed "
                  + ("by a separate kernel" if config["SPLIT"] else "in the down kernel"))
    else:
        launch = (f"grouped path: row blocks of {config['BM']} sorted pairs, {config['BN']}-"
                  f"column tiles, K in steps of {config['BK']}, {config['num_warps']} warps, "
                  f"{config['num_stages']} stages, groups of {config['GROUP_M']} blocks")
    header = textwrap.dedent(f'''\
        """Fused MoE experts candidate ({mt}): route ({route}), experts, top-k sum.

        Generated by codegen.moe_experts.kernel.render. The router GEMM and every expert GEMM
        accumulate in fp32; {launch}.
        Specialised for hidden={h}, inter={i}, {e} experts, top {k}, {dtype}; tuned for
        {case["rows"]} tokens.
        case:   {json.dumps(case)}
        config: {json.dumps(config)}
        """

        import torch
        import triton
        import triton.language as tl

        from codegen.launch import cdiv, launcher

        HIDDEN = {h}
        INTER = {i}
        E = {e}
        EP = {ep}
        K = {k}
        KP = {triton.next_power_of_2(k)}
        DTYPE = {dtype!r}
        TORCH_DTYPE = getattr(torch, DTYPE)
        BIASED = {biased}
        GATE_UP_SHAPE = {gate_up_shape}
        DOWN_SHAPE = {down_shape}
        INPUT_PRECISION = {precision!r}
        ROUTE_BT = {ROUTE_BT}
        SUM_ST = {SUM_ST}
        SUM_BH = {SUM_BH}
        BAKED_PARAMS = {params(case)!r}
        ''')
    route_bind = (f"_route_kernel = launcher(_moe_route_kernel, HIDDEN=HIDDEN, E=E, EP=EP, K=K, "
                  f"KP=KP,\n    TOPK_FIRST={mt in TOPK_FIRST}, "
                  f"NORM={bool(case['norm_topk'] or mt == 'mixtral')}, HAS_BIAS=BIASED,\n"
                  f"    COUNT={path == 'grouped'}, INPUT_PRECISION=INPUT_PRECISION, "
                  f"BT=ROUTE_BT, BK=64)\n")
    sum_bind = ("_sum_kernel = launcher(_moe_sum_kernel, HIDDEN=HIDDEN, K=K, ST=SUM_ST, "
                "BH=SUM_BH)\n")
    act_args = f"ACT={act}, LIMIT={limit!r}, ALPHA={alpha!r}, HAS_BIAS=BIASED"
    parts = [header, kernel_source(_moe_route_kernel), kernel_source(_activate)]
    if path == "gemv":
        bn, bk, split = config["BN"], config["BK"], config["SPLIT"]
        parts += [kernel_source(_moe_gemv_gate_up_kernel), kernel_source(_gemv_row),
                  kernel_source(_moe_gemv_down_kernel), kernel_source(_moe_sum_kernel)]
        consts = f"BN = {bn}\nBK = {bk}\nSPLIT = {split}\n"
        binds = (route_bind + sum_bind
                 + f"_gate_up_kernel = launcher(_moe_gemv_gate_up_kernel, HIDDEN=HIDDEN, "
                   f"INTER=INTER, K=K,\n    {act_args}, BN=BN, BK=BK, "
                   f"num_warps={config['num_warps']})\n"
                 + "_down_kernel = launcher(_moe_gemv_down_kernel, HIDDEN=HIDDEN, INTER=INTER, "
                   "K=K,\n    HAS_BIAS=BIASED, SPLIT=SPLIT, BN=BN, BK=BK, "
                   f"num_warps={config['num_warps']})\n")
        forward = _FORWARD_GEMV
    else:
        bm, bn, bk = config["BM"], config["BN"], config["BK"]
        opts = (f"GROUP_M={config['GROUP_M']}, num_warps={config['num_warps']}, "
                f"num_stages={config['num_stages']}")
        parts += [kernel_source(_moe_align_kernel), kernel_source(_block_tile),
                  kernel_source(_moe_gate_up_kernel), kernel_source(_moe_down_kernel),
                  kernel_source(_moe_sum_kernel)]
        consts = f"BM = {bm}\nBN = {bn}\nBK = {bk}\n"
        binds = (route_bind + sum_bind
                 + "_align_kernel = launcher(_moe_align_kernel, E=E, EP=EP, K=K, BT=ROUTE_BT, "
                   "BM=BM, QB=64,\n    BB=64)\n"
                 + f"_gate_up_kernel = launcher(_moe_gate_up_kernel, HIDDEN=HIDDEN, "
                   f"INTER=INTER, K=K,\n    {act_args}, INPUT_PRECISION=INPUT_PRECISION, "
                   f"BM=BM, BN=BN, BK=BK,\n    {opts})\n"
                 + "_down_kernel = launcher(_moe_down_kernel, HIDDEN=HIDDEN, INTER=INTER, "
                   "HAS_BIAS=BIASED,\n    INPUT_PRECISION=INPUT_PRECISION, BM=BM, BN=BN, "
                   f"BK=BK, {opts})\n")
        forward = _FORWARD_GROUPED
    return "\n\n".join(parts + [consts + binds, _HELPERS, _ROUTE, forward])
