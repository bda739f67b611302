"""Triton causal flash-attention forward (prefill) with grouped-query heads.

One program takes BLOCK_M queries of one (batch, query head) and streams the keys and values of
its kv head (head // (heads // kv_heads)) in BLOCK_N blocks with an online softmax, so the
seq x seq score matrix never reaches memory and GQA needs no repeat_kv copy. Causality skips
work: key blocks past the query block are never loaded, and only the blocks that straddle the
diagonal pay for the mask. Query blocks go on grid axis 0 (CUDA caps axis 1 at 65535), the
(batch, head) pairs on axis 1; the longest query blocks start first to even out the tail.

q, k, v arrive as transposed views of the projections and `out` in HF's (batch, seq, heads,
head_dim) layout: every tensor is addressed through its own four strides, nothing is copied.

Numerics: QK^T runs on the input dtype with fp32 accumulation, as SDPA's fused kernels do; the
softmax runs in fp32 (exp2 with log2(e) folded into the scale). PV multiplies the fp32
probabilities by v promoted to fp32 rather than rounding the probabilities to bf16/fp16 first:
that rounding costs up to an ulp of the output dtype near zero-crossing outputs, which the
verifier's 2-ulp tolerance does not reliably absorb. On the GPU the PV product uses 3xTF32
(near-fp32 accuracy on tensor cores); fp32 inputs use IEEE fp32 throughout. The Triton CPU
interpreter computes dots in fp32 whatever is asked.
"""

from __future__ import annotations

import json
import textwrap

import triton
import triton.language as tl

from core.family import Case
from core.source import kernel_source

# (BLOCK_M, BLOCK_N, num_warps, num_stages), smallest tiles first. BLOCK_N divides BLOCK_M so
# the unmasked key blocks end exactly where the query block's diagonal blocks begin.
CONFIGS = (
    (16, 16, 1, 2), (32, 16, 2, 2), (32, 32, 2, 2), (64, 32, 4, 2), (64, 64, 4, 2),
    (64, 64, 4, 3), (128, 32, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4),
    (128, 128, 8, 2),
)
SMEM_BYTES = 160 * 1024  # what the pipelined k/v tiles and the q tile may take on the GPU


@triton.jit
def _attn_key_blocks(acc, l_i, m_i, q, k_ptr, v_ptr, k_ss, k_sd, v_ss, v_sd, offs_m, offs_d,
                     d_ok, seq_len, qk_scale, lo, hi,
                     BLOCK_N: tl.constexpr, DIAGONAL: tl.constexpr,
                     QK_PRECISION: tl.constexpr, PV_PRECISION: tl.constexpr):
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        kv_ok = (offs_n < seq_len)[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + offs_n[:, None] * k_ss + offs_d[None, :] * k_sd, mask=kv_ok,
                    other=0.0)
        v = tl.load(v_ptr + offs_n[:, None] * v_ss + offs_d[None, :] * v_sd, mask=kv_ok,
                    other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=QK_PRECISION) * qk_scale
        if DIAGONAL:
            # Keys past the sequence need no mask of their own: a real query row never sees a
            # key beyond itself, and padding query rows are not stored.
            s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row whose scores are all -inf so far subtracts 0 instead of -inf (which would give
        # NaN): it then ends with l == 0 and an output of 0, the fully-masked convention of
        # SDPA's math backend (_safe_softmax) and of FlashAttention. NaN scores still give NaN.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_sub[:, None])
        alpha = tl.math.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=PV_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, seq_len, heads, group, qk_scale,
                     q_sb, q_sh, q_ss, q_sd, k_sb, k_sh, k_ss, k_sd,
                     v_sb, v_sh, v_ss, v_sd, o_sb, o_sh, o_ss, o_sd,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, QK_PRECISION: tl.constexpr,
                     PV_PRECISION: tl.constexpr):
    block_m = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    # int64: batch * stride passes 2**31 at long sequences of wide models.
    b = (bh // heads).to(tl.int64)
    h = (bh % heads).to(tl.int64)
    kv_h = h // group
    start_m = block_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q_ok = (offs_m < seq_len)[:, None] & d_ok[None, :]
    q = tl.load(q_ptr + b * q_sb + h * q_sh + offs_m[:, None] * q_ss + offs_d[None, :] * q_sd,
                mask=q_ok, other=0.0)
    k_base = k_ptr + b * k_sb + kv_h * k_sh
    v_base = v_ptr + b * v_sb + kv_h * v_sh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Key blocks wholly below the diagonal need no mask; those crossing it do; later ones are
    # skipped, which halves the work of a causal pass.
    acc, l_i, m_i = _attn_key_blocks(acc, l_i, m_i, q, k_base, v_base, k_ss, k_sd, v_ss, v_sd,
                                     offs_m, offs_d, d_ok, seq_len, qk_scale, 0, start_m,
                                     BLOCK_N, False, QK_PRECISION, PV_PRECISION)
    acc, l_i, m_i = _attn_key_blocks(acc, l_i, m_i, q, k_base, v_base, k_ss, k_sd, v_ss, v_sd,
                                     offs_m, offs_d, d_ok, seq_len, qk_scale, start_m,
                                     tl.minimum(start_m + BLOCK_M, seq_len), BLOCK_N, True,
                                     QK_PRECISION, PV_PRECISION)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(o_ptr + b * o_sb + h * o_sh + offs_m[:, None] * o_ss + offs_d[None, :] * o_sd,
             out.to(o_ptr.dtype.element_ty), mask=q_ok)


LOG2E = 1.4426950408889634
# No FMA contraction: it would turn `dot * qk_scale - m` into one FMA that subtracts the
# rounded row max from the unrounded product. At |s| ~ 2^67 (the verifier's "mixed" stress,
# magnitudes 2^-32..2^32) that residual is up to half an ulp of 2^67, 2^43, so exp2 of the
# row's own maximum came out inf (NaN after) or 0 (a zero row) on the H200; the interpreter
# never fuses, so it never showed. Separately rounded, s - m is exactly 0 at the max.
LAUNCH_OPTIONS = {"enable_fp_fusion": False}


def block_d(head_dim: int) -> int:
    """The head_dim tile: a power of two, at least 16 (tl.dot's smallest K); dims past head_dim
    load as zeros and are not stored."""
    return max(16, triton.next_power_of_2(head_dim))


def precisions(dtype: str) -> tuple[str, str]:
    """(QK^T, PV) dot precisions; see the module docstring. Triton applies a precision to fp32
    operands only, so on bf16/fp16 q and k the QK^T entry is moot (tensor cores, fp32 sums)."""
    return ("ieee", "ieee") if dtype == "float32" else ("tf32", "tf32x3")


def search_space(case: Case) -> list[dict]:
    """Tiles no taller than the sequence (rounded up to a power of two, 16 at least), whose
    pipelined k/v tiles and q tile fit in shared memory. Tall query blocks reuse each k/v load
    more; short ones give a short sequence more programs."""
    tallest = max(16, triton.next_power_of_2(case["seq"]))
    bd = block_d(case["head_dim"])
    size = 4 if case["dtype"] == "float32" else 2
    configs = []
    for bm, bn, warps, stages in CONFIGS:
        smem = (2 * stages * bn + bm) * bd * size
        if bm <= tallest and smem <= SMEM_BYTES:
            configs.append({"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps,
                            "num_stages": stages})
    return configs[-12:]


def attention_forward(q, k, v, *, out, scale: float, BLOCK_M: int = 64, BLOCK_N: int = 32,
                      num_warps: int = 4, num_stages: int = 2) -> None:
    """Host wrapper: q (batch, heads, seq, d), k/v (batch, kv_heads, seq, d), any strides;
    out (batch, seq, heads, d), any strides."""
    batch, heads, seq, head_dim = q.shape
    o = out.transpose(1, 2)  # addressed like q: (batch, heads, seq, d)
    qk_prec, pv_prec = precisions(str(q.dtype).removeprefix("torch."))
    grid = (triton.cdiv(seq, BLOCK_M), batch * heads)
    _attn_fwd_kernel[grid](
        q, k, v, o, seq, heads, heads // k.shape[1], scale * LOG2E, *q.stride(), *k.stride(),
        *v.stride(), *o.stride(), HEAD_DIM=head_dim, BLOCK_D=block_d(head_dim),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, QK_PRECISION=qk_prec, PV_PRECISION=pv_prec,
        num_warps=num_warps, num_stages=num_stages, **LAUNCH_OPTIONS)



_FORWARD = '''\
def forward(q, k, v, *, out, scale=SCALE) -> None:
    """q (batch, heads, seq, HEAD_DIM), k and v (batch, kv_heads, seq, HEAD_DIM), any strides,
    heads a multiple of kv_heads; out (batch, seq, heads, HEAD_DIM), any strides. Causal, no
    mask, no dropout."""
    batch, heads, seq, head_dim = q.shape
    kv_heads = k.shape[1]
    if (head_dim != HEAD_DIM or tuple(k.shape) != (batch, kv_heads, seq, HEAD_DIM)
            or v.shape != k.shape or heads % kv_heads
            or tuple(out.shape) != (batch, seq, heads, HEAD_DIM)
            or not (q.dtype == k.dtype == v.dtype == out.dtype)):
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
                         f"out {tuple(out.shape)} do not fit head_dim={HEAD_DIM}")
    if str(q.dtype).removeprefix("torch.") != DTYPE:
        raise ValueError(f"specialised for {DTYPE}, called with {q.dtype}")
    if seq == 0 or batch == 0:
        return
    o = out.transpose(1, 2)  # addressed like q: (batch, heads, seq, HEAD_DIM)
    grid = (triton.cdiv(seq, BLOCK_M), batch * heads)
    # enable_fp_fusion=False: an FMA would subtract the row max from the unrounded score, and
    # at |score| ~ 2^67 exp2 of the max itself came out inf or 0 on the GPU
    _attn_fwd_kernel[grid](
        q, k, v, o, seq, heads, heads // kv_heads, scale * LOG2E, *q.stride(), *k.stride(),
        *v.stride(), *o.stride(), HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, QK_PRECISION=QK_PRECISION, PV_PRECISION=PV_PRECISION,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES, enable_fp_fusion=False)
'''


def render(config: dict, case: Case) -> str:
    d, dtype = case["head_dim"], case["dtype"]
    bm, bn = config["BLOCK_M"], config["BLOCK_N"]
    warps, stages = config["num_warps"], config["num_stages"]
    qk_prec, pv_prec = precisions(dtype)
    heads = f'{case["heads"]}/{case["kv_heads"]}'
    dots = ("fp32 IEEE" if dtype == "float32" else
            f"QK^T on {dtype} with fp32 sums, PV in fp32 as 3xTF32")
    header = textwrap.dedent(f'''\
        """Causal attention forward (prefill, GQA) candidate: flash attention, online softmax.

        Generated by codegen.attention.kernel.render. Equals HF's sdpa_attention_forward with
        is_causal, no mask, no dropout; returns HF's (batch, seq, heads, head_dim) layout.
        Specialised for head_dim={d}, {dtype}; batch, seq and head counts are free.
        Tuned for batch {case["batch"]} x seq {case["seq"]}, heads {heads}.
        Launch: one program per ({bm} queries, batch x head), key blocks of {bn}, {warps} warps,
        {stages} pipeline stages. Softmax in fp32; dots: {dots}.
        case:   {json.dumps(case)}
        config: {json.dumps(config)}
        """

        import triton
        import triton.language as tl

        HEAD_DIM = {d}
        BLOCK_D = {block_d(d)}
        DTYPE = "{dtype}"
        SCALE = {case["scale"]!r}
        LOG2E = {LOG2E!r}
        BLOCK_M = {bm}
        BLOCK_N = {bn}
        NUM_WARPS = {warps}
        NUM_STAGES = {stages}
        QK_PRECISION = "{qk_prec}"
        PV_PRECISION = "{pv_prec}"
        ''')
    return "\n\n".join([header, kernel_source(_attn_key_blocks), kernel_source(_attn_fwd_kernel),
                        _FORWARD])
