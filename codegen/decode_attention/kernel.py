"""Triton decode attention (one query token per sequence) over a KV cache, GQA without repeat_kv.

Flash-decoding: grid (batch x kv head, SPLITS). Each program takes every query head of one kv
head's group at once (the group's rows padded to BLOCK_G >= 16, tl.dot's smallest M), so each
key and value is read from memory once for the whole group, and streams its chunk of the cache
in BLOCK_N slots with an online softmax. SPLITS == 1 writes the output directly; otherwise each
split writes an fp32 partial (its unnormalised sum, row max and row sum) and the partials are
merged, either by a small combine kernel (one program per (batch, kv head)) or, FUSED, in the
split kernel itself: each split program counts its arrival on a per-(batch, kv head) int32
counter after storing its partial, and the last to arrive merges its group's partials, stores
the output and resets the counter (one launch instead of two; in a CUDA-graphed decode step the
combine is mostly its launch). Both merge with one helper (`_merge_group`), the same math, the
group's query heads at once.
How many splits pay at a given cache size, and whether fusing does, is the search's question
(`search_space`).

The valid length is read on the device (`len_ptr`, the static cache's `cumulative_length` after
the step's update) or, for a dynamic cache, is the keys' own length (`slots`): no host read,
so a CUDA graph captures the launch once and each replay sees the current position. Slots at
or past the length are never loaded; a split whose chunk starts past it stores an empty partial
(max -inf, sum 0) and the combine skips it. An optional boolean mask row per sequence
(HF's [batch or 1, 1, 1, slots] mask) is applied to the slots that are read.

Softmax semantics at the edges, as torch's: -inf scores weigh 0 beside any finite one; a row
whose kept (valid, unmasked) scores are all -inf is NaN (a 0-over-0 softmax), which the kernel
tells apart from a row with no kept slot at all (0, SDPA's fully-masked convention) by a `seen`
flag per row, stored with each split's partial. The verifier's length-1 edge with a huge or
-inf query is that row; scoring masked slots and real -inf alike gave 0 there.

Numerics as in codegen/attention/kernel.py: QK^T on the input dtype with fp32 sums, softmax in
fp32 (exp2, log2(e) folded into the scale), PV on fp32 probabilities times v promoted to fp32
(3xTF32 on the GPU, IEEE for fp32 inputs); no FMA contraction (enable_fp_fusion=False).
"""

from __future__ import annotations

import inspect
import json
import textwrap

import triton
import triton.language as tl

from codegen.attention.kernel import LOG2E, block_d, precisions
from core.family import Case
from core.source import kernel_source

# (SPLITS, BLOCK_N, num_warps, num_stages). The space is small enough that a search with the
# default budget (codegen.strategies.DEFAULT_TRIALS) times all of it at Llama-3.2-1B's b1 case
# (8 kv heads, 1280 slots), and its first configs are the family's guesses (`leads`), timed
# first by a search with fewer trials.
#
# At batch 1 the kernel moves ~2 MB (Llama-3.2-1B, ~1000 valid slots): about what an H100 keeps in
# flight over one DRAM latency (3 TB/s x ~0.7 us), so its time is a chain of latencies (the
# launch, one round of K/V loads, the partials' stores and the arrival, the merge's loads), not
# bandwidth. What pays is each program issuing its loads at once (a chunk of one or two BLOCK_N
# steps, the second prefetched by the pipeliner) over about one program per SM, and a merge that
# is one round of loads: with the group's heads merged at once (`_merge_group`) its cost hardly
# grows with the split count, so fewer, larger splits no longer pay for their loads with serial
# merges. The chunk is the slots (not the length) over the splits, so at 1280 slots 16 splits make
# chunks of 128 slots (72 programs do work at length 1025, 56 stay empty) and 32 splits chunks of
# 64 (136 working, about one per SM of an H100's 132).
#
# FUSED (the last split program merges; one launch, which a graphed step pays for most):
# 1. 16 x 64, 4 warps: half the programs of 32 splits, half the partials to merge and half
#    the arrivals on each counter; its 72 working programs hold 32 KB of K and V each in
#    flight, the whole cache at once.
# 2. 32 x 32, 4 warps: a program per SM at length 1025; 4 warps so that the 32 partials of a
#    group of 4 (64 dims) merge in one chunk (merge_heads).
# 3. 32 x 32, 2 warps: the two-kernel tile below, its merge in two chunks of heads.
# Then 8 splits, for batches whose (batch, kv head) rows fill the GPU by themselves (the
# split-count filter in `search_space` drops the large splits at small caches). 16 x 128, 1's
# chunks in one step, is left out: the filter drops it at 1280 slots, where 6 of its 16 splits
# would never have a slot.
FUSED_CONFIGS = ((16, 64, 4, 2), (32, 32, 4, 2), (32, 32, 2, 2), (8, 64, 4, 2), (8, 32, 2, 2))
# Two kernels (split, then the combine, one program per (batch, kv head)): the tile the b1
# searches picked with a combine (benchmarks/results/graphs-llama-3.2-1b-decode-b1-s1024-1203e/
# report.md) and batch 8's (benchmarks/results/e2e-1207-h100/logs/llama-optimize-call1.log),
# keeping the keys they had and with them their candidates' folder names and remembered
# searches; one split (no partials) last, the fewest programs (what the interpreter runs).
CONFIGS = ((32, 32, 2, 2), (16, 64, 4, 2), (8, 32, 2, 2), (1, 64, 4, 2))
LAUNCH_OPTIONS = {"enable_fp_fusion": False}
# the combine kernel's warps: a group of 4 heads at 32 splits of 64 dims merged in one chunk
# (merge_heads)
COMBINE_WARPS = 4


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, len_ptr, mask_ptr, o_ptr, part_ptr, ml_ptr,
                         count_ptr, slots, chunk, kv_heads, group, qk_scale,
                         q_sb, q_sh, q_sd, k_sb, k_sh, k_ss, k_sd, v_sb, v_sh, v_ss, v_sd,
                         m_sb, m_ss, o_sb, o_sh, o_sd,
                         HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
                         BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
                         LEN_ON_DEVICE: tl.constexpr, HAS_MASK: tl.constexpr,
                         QK_PRECISION: tl.constexpr, PV_PRECISION: tl.constexpr,
                         FUSED: tl.constexpr = False, MERGE_G: tl.constexpr = 1,
                         PDL: tl.constexpr = False):
    # codegen/pdl.py: q, the cache, its length and the mask are all written in the step, and
    # FUSED's counter is the previous call's (every program waits before touching any of them)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    bk = tl.program_id(0)
    split = tl.program_id(1)
    b = (bk // kv_heads).to(tl.int64)
    kv_h = (bk % kv_heads).to(tl.int64)
    if LEN_ON_DEVICE:
        length = tl.minimum(tl.load(len_ptr).to(tl.int32), slots)
    else:
        length = slots
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_ok = offs_g < group
    d_ok = offs_d < HEAD_DIM
    heads = kv_h * group + offs_g
    q = tl.load(q_ptr + b * q_sb + heads[:, None] * q_sh + offs_d[None, :] * q_sd,
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = k_ptr + b * k_sb + kv_h * k_sh
    v_base = v_ptr + b * v_sb + kv_h * v_sh
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    seen = tl.zeros([BLOCK_G], dtype=tl.float32)  # 1 once any slot is kept (unmasked)
    lo = split * chunk
    hi = tl.minimum(lo + chunk, length)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        kv_ok = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + offs_n[:, None] * k_ss + offs_d[None, :] * k_sd, mask=kv_ok,
                    other=0.0)
        v = tl.load(v_base + offs_n[:, None] * v_ss + offs_d[None, :] * v_sd, mask=kv_ok,
                    other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=QK_PRECISION) * qk_scale
        keep = n_ok
        if HAS_MASK:
            keep = keep & (tl.load(mask_ptr + b * m_sb + offs_n * m_ss, mask=n_ok, other=0) != 0)
        s = tl.where(keep[None, :], s, float("-inf"))
        seen = tl.maximum(seen, tl.max(keep.to(tl.float32), 0))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # all -inf so far (masked slots only): subtract 0, not -inf, so no NaN appears
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PV_PRECISION)
        m_i = m_new
    row_ok = g_ok[:, None] & d_ok[None, :]
    if SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        # kept slots whose scores are all -inf: NaN, as softmax gives (no kept slot gives 0)
        out = tl.where(((seen > 0) & (m_i == float("-inf")))[:, None], float("nan"), out)
        tl.store(o_ptr + b * o_sb + heads[:, None] * o_sh + offs_d[None, :] * o_sd,
                 out.to(o_ptr.dtype.element_ty), mask=row_ok)
    else:
        # partials: [batch x kv head, SPLITS, BLOCK_G, BLOCK_D] and [.., SPLITS, 3, BLOCK_G]
        # (row max, row sum, seen), the group's rows only (the padding rows to BLOCK_G are
        # never merged: storing them would write BLOCK_G / group times the bytes)
        row = (bk.to(tl.int64) * SPLITS + split)
        tl.store(part_ptr + row * BLOCK_G * BLOCK_D + offs_g[:, None] * BLOCK_D
                 + offs_d[None, :], acc, mask=g_ok[:, None])
        tl.store(ml_ptr + row * 3 * BLOCK_G + offs_g, m_i, mask=g_ok)
        tl.store(ml_ptr + row * 3 * BLOCK_G + BLOCK_G + offs_g, l_i, mask=g_ok)
        tl.store(ml_ptr + row * 3 * BLOCK_G + 2 * BLOCK_G + offs_g, seen, mask=g_ok)
        if FUSED:
            # every thread's partial stores issued before one thread's release (bar.sync),
            # then the arrival: acq_rel at GPU scope publishes this program's partial to the
            # last one and, in that last one, makes every other program's partial visible
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + bk, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLITS - 1:
                _merge_group(part_ptr, ml_ptr, o_ptr, bk, kv_heads, group, o_sb, o_sh, o_sd,
                             HEAD_DIM, BLOCK_D, BLOCK_G, SPLITS, MERGE_G)
                # every split of this (batch, kv head) has arrived: zero for the next call
                # (or graph replay), which starts only once this launch has ended
                tl.store(count_ptr + bk, 0)


@triton.jit
def _merge_group(part_ptr, ml_ptr, o_ptr, bk, kv_heads, group, o_sb, o_sh, o_sd,
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_G: tl.constexpr,
                 SPLITS: tl.constexpr, MERGE_G: tl.constexpr):
    """The query heads of row `bk`'s group (batch x kv head): their SPLITS partials merged
    and stored, MERGE_G heads at a time (the whole group where its partials fit a program's
    registers: `merge_heads`). A chunk is one [MERGE_G, SPLITS, BLOCK_D] load of the partials
    beside three [MERGE_G, SPLITS] loads of the row maxima, sums and flags, none waiting on
    another, reduced over the split axis, and one masked store of the chunk's output rows: a
    loop over the splits, or over the heads, is a chain of dependent loads, and a loop over
    the splits took longer than the split kernel itself (benchmarks/probes/README.md,
    `decode_kernels.py`). Heads on the first axis and splits on the second, so each head's
    splits reduce as a row of their own would: in the order one head at a time had them (bit
    for bit under the interpreter). Loads bypass L1 (.cg): in the fused kernel the partials
    are other SMs' stores, and L1 is not coherent across SMs."""
    b = (bk // kv_heads).to(tl.int64)
    kv_h = (bk % kv_heads).to(tl.int64)
    offs_s = tl.arange(0, SPLITS)
    offs_g = tl.arange(0, MERGE_G)
    offs_d = tl.arange(0, BLOCK_D)
    rows = bk.to(tl.int64) * SPLITS + offs_s
    for g0 in range(0, group, MERGE_G):
        heads = g0 + offs_g
        g_ok = heads < group  # the group's last chunk may be partial
        # heads first, splits next: each head's splits summed as one head's row was
        ml = ml_ptr + rows[None, :] * 3 * BLOCK_G + heads[:, None]
        m = tl.load(ml, mask=g_ok[:, None], other=float("-inf"), cache_modifier=".cg")
        lsum = tl.load(ml + BLOCK_G, mask=g_ok[:, None], other=0.0, cache_modifier=".cg")
        seen = tl.max(tl.load(ml + 2 * BLOCK_G, mask=g_ok[:, None], other=0.0,
                              cache_modifier=".cg"), 1)
        part = tl.load(part_ptr + (rows[None, :, None] * BLOCK_G + heads[:, None, None])
                       * BLOCK_D + offs_d[None, None, :], mask=g_ok[:, None, None], other=0.0,
                       cache_modifier=".cg")
        m_all = tl.max(m, 1)
        m_sub = tl.where(m_all == float("-inf"), 0.0, m_all)
        w = tl.math.exp2(m - m_sub[:, None])  # empty splits: exp2(-inf) = 0
        denom = tl.sum(lsum * w, 1)
        out = tl.sum(part * w[:, :, None], 1) / tl.where(denom == 0.0, 1.0, denom)[:, None]
        # kept slots whose scores are all -inf: NaN, as softmax gives (no kept slot gives 0)
        out = tl.where(((seen > 0) & (m_all == float("-inf")))[:, None], float("nan"), out)
        tl.store(o_ptr + b * o_sb + (kv_h * group + heads)[:, None] * o_sh
                 + offs_d[None, :] * o_sd, out.to(o_ptr.dtype.element_ty),
                 mask=g_ok[:, None] & (offs_d < HEAD_DIM)[None, :])


@triton.jit
def _decode_combine_kernel(part_ptr, ml_ptr, o_ptr, kv_heads, group, o_sb, o_sh, o_sd,
                           HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_G: tl.constexpr, SPLITS: tl.constexpr,
                           MERGE_G: tl.constexpr, PDL: tl.constexpr = False):
    # one program per (batch, kv head): its group's heads (the split kernel's partials, not
    # FUSED)
    if PDL:  # codegen/pdl.py: the partials are the split kernel's
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    _merge_group(part_ptr, ml_ptr, o_ptr, tl.program_id(0), kv_heads, group, o_sb, o_sh, o_sd,
                 HEAD_DIM, BLOCK_D, BLOCK_G, SPLITS, MERGE_G)


def merge_heads(group: int, splits: int, block_d: int, warps: int) -> int:
    """How many query heads `_merge_group` merges at once: the whole group (a power of two
    at or above it) where its [heads, splits, block_d] fp32 partials come to at most 64 values
    a thread, else the largest power of two of heads that does. Compiled for sm_90, the
    space's heaviest merging kernels spill nothing at this bound and the combine kernel at
    twice it spills with Triton 3.9 (tests/codegen/decode_merge_regs.py); a group of 4 at 32
    splits of 64 dims takes one chunk at 4 warps and two at 2 warps."""
    fit = max(1, 64 * 32 * warps // (splits * block_d))
    return min(triton.next_power_of_2(group), 1 << (fit.bit_length() - 1))


def search_space(case: Case) -> list[dict]:
    """Split counts that leave each split at least one BLOCK_N of slots: the fused ones first
    (the first of them the family's guesses: `leads`), then the two-kernel ones, one split
    last. A config without a "FUSED" key launches the combine kernel."""
    configs = []
    tiles = [(t, True) for t in FUSED_CONFIGS] + [(t, False) for t in CONFIGS]
    for (splits, bn, warps, stages), fused in tiles:
        if splits == 1 or splits * bn <= max(case["slots"], bn):
            configs.append({"SPLITS": splits, "BLOCK_N": bn, "num_warps": warps,
                            "num_stages": stages, **({"FUSED": True} if fused else {})})
    return configs


def leads(case: Case) -> int:
    """How many of the space's first configs are the family's guesses (Family.leads): its
    FUSED configs among the first three (at a small cache the filter leaves fewer)."""
    return min(3, sum(1 for c in search_space(case) if c.get("FUSED")))


_FORWARD = '''\
def forward(q, k, v, length, mask, *, out, scale=SCALE) -> None:
    """q (batch, heads, 1, HEAD_DIM), k and v (batch, kv_heads, slots, HEAD_DIM), any strides,
    heads a multiple of kv_heads; length: a 0-d int64 tensor on q's device (the valid slots,
    read on the device) or None (every slot); mask: None or a bool (batch or 1, 1, 1, slots);
    out (batch, 1, heads, HEAD_DIM), any strides."""
    batch, heads, q_len, head_dim = q.shape
    kv_heads, slots = k.shape[1], k.shape[2]
    if (q_len != 1 or head_dim != HEAD_DIM or k.shape[0] != batch or k.shape[3] != HEAD_DIM
            or v.shape != k.shape or heads % kv_heads
            or tuple(out.shape) != (batch, 1, heads, HEAD_DIM)
            or not (q.dtype == k.dtype == v.dtype == out.dtype)):
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"out {tuple(out.shape)} do not fit head_dim={HEAD_DIM}")
    if mask is not None and (mask.dtype != torch.bool or mask.dim() != 4
                             or mask.shape[1:3] != (1, 1) or mask.shape[3] != slots
                             or mask.shape[0] not in (1, batch)):
        raise ValueError(f"mask {tuple(mask.shape)} {mask.dtype}: want bool (batch or 1, 1, 1, "
                         f"{slots})")
    if str(q.dtype).removeprefix("torch.") != DTYPE:
        raise ValueError(f"specialised for {DTYPE}, called with {q.dtype}")
    if batch == 0 or slots == 0:
        return
    group = heads // kv_heads
    bg, bd = max(16, triton.next_power_of_2(group)), BLOCK_D
    if mask is not None:
        mask_arg = mask.view(torch.int8)
        m_sb, m_ss = (mask_arg.stride(0) if mask_arg.shape[0] > 1 else 0), mask_arg.stride(3)
    else:
        mask_arg, m_sb, m_ss = q, 0, 0
    if SPLITS > 1:
        part = torch.empty((batch * kv_heads * SPLITS, bg, bd), dtype=torch.float32,
                           device=q.device)
        ml = torch.empty((batch * kv_heads * SPLITS, 3, bg), dtype=torch.float32,
                         device=q.device)
    else:
        part = ml = q
    counts = arrival_counters(q.device, batch * kv_heads) if FUSED else q
    o = out.squeeze(1)  # (batch, heads, HEAD_DIM)
    chunk = triton.cdiv(triton.cdiv(slots, SPLITS), BLOCK_N) * BLOCK_N
    # enable_fp_fusion=False: see codegen/attention/kernel.py (FMA next to the row max)
    pdl = pdl_options()  # PDL=True and its launch attribute while codegen.pdl is on
    _decode_split_kernel[(batch * kv_heads, SPLITS)](
        q, k, v, length if length is not None else q, mask_arg, o, part, ml, counts,
        slots, chunk, kv_heads, group, scale * LOG2E,
        q.stride(0), q.stride(1), q.stride(3), *k.stride(), *v.stride(), m_sb, m_ss,
        *o.stride(), HEAD_DIM=HEAD_DIM, BLOCK_D=bd, BLOCK_G=bg, BLOCK_N=BLOCK_N, SPLITS=SPLITS,
        LEN_ON_DEVICE=length is not None, HAS_MASK=mask is not None,
        QK_PRECISION=QK_PRECISION, PV_PRECISION=PV_PRECISION, FUSED=FUSED,
        MERGE_G=merge_heads(group, SPLITS, bd, NUM_WARPS) if FUSED else 1,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES, enable_fp_fusion=False, **pdl)
    if SPLITS > 1 and not FUSED:
        _decode_combine_kernel[(batch * kv_heads,)](
            part, ml, o, kv_heads, group, *o.stride(), HEAD_DIM=HEAD_DIM, BLOCK_D=bd,
            BLOCK_G=bg, SPLITS=SPLITS, MERGE_G=merge_heads(group, SPLITS, bd, COMBINE_WARPS),
            num_warps=COMBINE_WARPS, enable_fp_fusion=False, **pdl)
'''


def render(config: dict, case: Case) -> str:
    d, dtype = case["head_dim"], case["dtype"]
    splits, bn = config["SPLITS"], config["BLOCK_N"]
    warps, stages = config["num_warps"], config["num_stages"]
    qk_prec, pv_prec = precisions(dtype)
    fused = bool(config.get("FUSED", False)) and splits > 1
    split_line = ("one kernel, one program per (batch, kv head), no combine" if splits == 1 else
                  f"one kernel, {splits} splits of the cache per (batch, kv head), the last "
                  "split program to finish merging them (an int32 counter per (batch, kv head))"
                  if fused else
                  f"two kernels, {splits} splits of the cache per (batch, kv head), then a "
                  "combine kernel")
    header = textwrap.dedent(f'''\
        """Decode attention (one query token, GQA, KV cache) candidate: flash-decoding.

        Generated by codegen.decode_attention.kernel.render. Equals HF's sdpa_attention_forward
        for a one-token query (no dropout, the mask a bool row per sequence or none); returns
        HF's (batch, 1, heads, head_dim) layout. Reads the valid length on the device.
        Specialised for head_dim={d}, {dtype}; batch, heads, kv heads and slots are free.
        Tuned for batch {case["batch"]}, heads {case["heads"]}/{case["kv_heads"]}, {case["slots"]}
        slots. Launch: {split_line}; {bn} slots per step, {warps} warps, {stages} stages.
        case:   {json.dumps(case)}
        config: {json.dumps(config)}
        """

        import torch
        import triton
        import triton.language as tl

        from codegen.launch import arrival_counters
        from codegen.launch import pdl_options

        HEAD_DIM = {d}
        BLOCK_D = {block_d(d)}
        DTYPE = "{dtype}"
        SCALE = {case["scale"]!r}
        LOG2E = {LOG2E!r}
        SPLITS = {splits}
        FUSED = {fused}
        BLOCK_N = {bn}
        NUM_WARPS = {warps}
        NUM_STAGES = {stages}
        COMBINE_WARPS = {COMBINE_WARPS}
        QK_PRECISION = "{qk_prec}"
        PV_PRECISION = "{pv_prec}"
        ''')
    return "\n\n".join([header, kernel_source(_decode_split_kernel), kernel_source(_merge_group),
                        kernel_source(_decode_combine_kernel),
                        textwrap.dedent(inspect.getsource(merge_heads)), _FORWARD])
