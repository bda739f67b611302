"""Triton rotary embedding: q and k rotated in one launch, read and written in place by stride.

HF runs 10 kernels per call (per tensor: mul, neg, cat, mul, add; plus a cat per tensor for
partial rotary) and materialises rotate_half. Here one program takes BLOCK_S consecutive
(batch, position) rows and one block of BLOCK_H heads on a joint head axis (q's heads, then
k's), so q and k share the launch, the tiles and the cos/sin rows each program loads. Rows
(batch x seq) go on axis 0 since CUDA caps axis 1 at 65535.

q and k arrive as transposed views of the projections; every tensor is addressed through its
own strides, so nothing is copied, and the outputs may have any layout too.

By default all arithmetic runs in fp32 on values converted right after the load and rounded
once before the store. The split layout is also searched with NATIVE=1: arithmetic in the
storage dtype, as HF's own code and Liger-Kernel's kernel do (each product and the sum round
to the dtype). Offline sm_90 PTX of Llama-1B's shape showed the fp32 conversions are where our
kernel spent its extra instructions (297 against Liger's 161 per program); the verifier's
tolerance, which counts the HF code's own rounding as slack, decides whether the result is
acceptable. CI checks NATIVE in fp16 only: Triton's CPU interpreter gets bf16 arithmetic
wrong. NATIVE launches without FMA contraction: contracted, x1 * c1 - x2 * s1 rounds once
where HF rounds twice, and the verifier rejects such candidates (on a stress input the
contracted result lands outside the tolerance HF's own rounding allows).
Uncontracted, each product and the difference round as HF's do. The pass-through dims of
partial rotary are copied without conversion.

Where the case says `equal_halves` (the model's rotary embedding is HF's, which builds each
table row as cat(freqs, freqs)), the kernels read the first half of each cos/sin row and use it
for both halves, as Liger-Kernel's does. The gain is small and near the timing's noise: every
variant is within about 1 us of a same-byte copy, and reading half of each row was the one flag
in the best rows (benchmarks/probes/README.md, `rope_probe.py`). It is not a search axis, since
reading less costs nothing.
"""

from __future__ import annotations

import json
import textwrap

import triton
import triton.language as tl

from core.family import Case
from core.source import kernel_source

HEAD_BLOCKS = (1, 2, 4, 8, 16, 32, 64)
POSITION_BLOCKS = (1, 2, 4, 8, 16)
MAX_TILE = 8192  # elements per [BLOCK_S, BLOCK_H, half] tile before registers spill
MAX_PADDING = 0.25  # head slots of the last block left empty, as a share of all heads


@triton.jit
def _compute_type(x, NATIVE: tl.constexpr):
    """The value to compute with: as loaded (NATIVE), or converted to fp32."""
    if NATIVE:
        return x
    else:
        return x.to(tl.float32)


@triton.jit
def _cos_sin_halves(cos_ptr, sin_ptr, b, s, mask, dims, cos_sb, cos_ss, cos_sd, sin_sb, sin_ss,
                    sin_sd, HALF: tl.constexpr, NATIVE: tl.constexpr = False,
                    HALF_TABLE: tl.constexpr = False):
    """[BLOCK_S, 1, BLOCK_HALF] each: one cos/sin row per position, both halves (the first
    one twice under HALF_TABLE, where the model's rows are cat(freqs, freqs))."""
    cos_rows = cos_ptr + (b * cos_sb + s * cos_ss)[:, None, None]
    sin_rows = sin_ptr + (b * sin_sb + s * sin_ss)[:, None, None]
    c1 = _compute_type(tl.load(cos_rows + dims * cos_sd, mask=mask, other=0.0), NATIVE)
    s1 = _compute_type(tl.load(sin_rows + dims * sin_sd, mask=mask, other=0.0), NATIVE)
    if HALF_TABLE:
        c2, s2 = c1, s1
    else:
        c2 = _compute_type(tl.load(cos_rows + (dims + HALF) * cos_sd, mask=mask, other=0.0),
                           NATIVE)
        s2 = _compute_type(tl.load(sin_rows + (dims + HALF) * sin_sd, mask=mask, other=0.0),
                           NATIVE)
    return c1, c2, s1, s2


@triton.jit
def _rope_forward_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, n_rows, seq_len,
                         q_sb, q_sh, q_ss, q_sd, k_sb, k_sh, k_ss, k_sd,
                         qo_sb, qo_sh, qo_ss, qo_sd, ko_sb, ko_sh, ko_ss, ko_sd,
                         cos_sb, cos_ss, cos_sd, sin_sb, sin_ss, sin_sd,
                         HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                         HALF: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
                         HALF_TABLE: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:  # codegen/pdl.py: q, k and the cos/sin tables are all the step's
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # int64: batch * stride passes 2**31 at long sequences of wide models.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    b = rows // seq_len
    s = rows % seq_len
    # One head axis over q's heads, then k's: heads [0, HEADS) are q, the rest k. A block may
    # straddle the two (Qwen2.5-0.5B's 14 + 2 heads fill one 16-wide block), so no program
    # works on a mostly empty tile of k's few heads, and each loads cos/sin once.
    heads = (tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H))[None, :, None]
    kv = heads - HEADS
    row_ok = (rows < n_rows)[:, None, None]
    q_ok = row_ok & (heads < HEADS)
    k_ok = row_ok & (heads >= HEADS) & (kv < KV_HEADS)
    q_heads = q_ptr + (b * q_sb + s * q_ss)[:, None, None] + heads * q_sh
    k_heads = k_ptr + (b * k_sb + s * k_ss)[:, None, None] + kv * k_sh
    qo_heads = qo_ptr + (b * qo_sb + s * qo_ss)[:, None, None] + heads * qo_sh
    ko_heads = ko_ptr + (b * ko_sb + s * ko_ss)[:, None, None] + kv * ko_sh

    dims = tl.arange(0, BLOCK_HALF)[None, None, :]
    lo = dims < HALF
    # one cos/sin row per position, shared by every head
    c1, c2, s1, s2 = _cos_sin_halves(cos_ptr, sin_ptr, b, s, row_ok & lo, dims, cos_sb, cos_ss,
                                     cos_sd, sin_sb, sin_ss, sin_sd, HALF, False, HALF_TABLE)

    # Two loads with complementary masks instead of one through tl.where(is_q, q, k): a
    # pointer select loses the contiguity the compiler needs for 16-byte accesses (scalar
    # 2-byte loads in the sm_90 PTX), and a masked-off load moves no bytes.
    x1 = (tl.load(q_heads + dims * q_sd, mask=q_ok & lo, other=0.0).to(tl.float32)
          + tl.load(k_heads + dims * k_sd, mask=k_ok & lo, other=0.0).to(tl.float32))
    x2 = (tl.load(q_heads + (dims + HALF) * q_sd, mask=q_ok & lo, other=0.0).to(tl.float32)
          + tl.load(k_heads + (dims + HALF) * k_sd, mask=k_ok & lo, other=0.0).to(tl.float32))
    # rotate_half(x) = cat(-x2, x1), so x * cos + rotate_half(x) * sin splits into two halves.
    y1 = (x1 * c1 - x2 * s1).to(qo_ptr.dtype.element_ty)
    y2 = (x2 * c2 + x1 * s2).to(qo_ptr.dtype.element_ty)
    tl.store(qo_heads + dims * qo_sd, y1, mask=q_ok & lo)
    tl.store(qo_heads + (dims + HALF) * qo_sd, y2, mask=q_ok & lo)
    tl.store(ko_heads + dims * ko_sd, y1, mask=k_ok & lo)
    tl.store(ko_heads + (dims + HALF) * ko_sd, y2, mask=k_ok & lo)
    if BLOCK_PASS > 0:
        rest = (2 * HALF + tl.arange(0, BLOCK_PASS))[None, None, :]
        tail = rest < HEAD_DIM
        tl.store(qo_heads + rest * qo_sd, tl.load(q_heads + rest * q_sd, mask=q_ok & tail),
                 mask=q_ok & tail)
        tl.store(ko_heads + rest * ko_sd, tl.load(k_heads + rest * k_sd, mask=k_ok & tail),
                 mask=k_ok & tail)


@triton.jit
def _rope_heads(x_ptr, o_ptr, b, s, row_ok, c1, c2, s1, s2, x_sb, x_sh, x_ss, x_sd,
                o_sb, o_sh, o_ss, o_sd, NHEADS: tl.constexpr, BLOCK_NH: tl.constexpr,
                HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                BLOCK_PASS: tl.constexpr, NATIVE: tl.constexpr):
    heads = tl.arange(0, BLOCK_NH)[None, :, None]
    ok = row_ok & (heads < NHEADS)
    dims = tl.arange(0, BLOCK_HALF)[None, None, :]
    lo = ok & (dims < HALF)
    x = x_ptr + (b * x_sb + s * x_ss)[:, None, None] + heads * x_sh
    o = o_ptr + (b * o_sb + s * o_ss)[:, None, None] + heads * o_sh
    x1 = _compute_type(tl.load(x + dims * x_sd, mask=lo, other=0.0), NATIVE)
    x2 = _compute_type(tl.load(x + (dims + HALF) * x_sd, mask=lo, other=0.0), NATIVE)
    tl.store(o + dims * o_sd, (x1 * c1 - x2 * s1).to(o_ptr.dtype.element_ty), mask=lo)
    tl.store(o + (dims + HALF) * o_sd, (x2 * c2 + x1 * s2).to(o_ptr.dtype.element_ty), mask=lo)
    if BLOCK_PASS > 0:
        rest = (2 * HALF + tl.arange(0, BLOCK_PASS))[None, None, :]
        tail = ok & (rest < HEAD_DIM)
        tl.store(o + rest * o_sd, tl.load(x + rest * x_sd, mask=tail), mask=tail)


@triton.jit
def _rope_split_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, n_rows, seq_len,
                       q_sb, q_sh, q_ss, q_sd, k_sb, k_sh, k_ss, k_sd,
                       qo_sb, qo_sh, qo_ss, qo_sd, ko_sb, ko_sh, ko_ss, ko_sd,
                       cos_sb, cos_ss, cos_sd, sin_sb, sin_ss, sin_sd,
                       HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       HALF: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_Q: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_HALF: tl.constexpr,
                       BLOCK_PASS: tl.constexpr, NATIVE: tl.constexpr, HALF_TABLE: tl.constexpr,
                       PDL: tl.constexpr = False):
    if PDL:  # codegen/pdl.py: q, k and the cos/sin tables are all the step's
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # Every head of BLOCK_S positions: q's heads and k's as two tiles of their own, each
    # padded to a power of two (no straddling block, no complementary masked loads).
    rows = tl.program_id(0).to(tl.int64) * BLOCK_S + tl.arange(0, BLOCK_S)
    b = rows // seq_len
    s = rows % seq_len
    row_ok = (rows < n_rows)[:, None, None]
    dims = tl.arange(0, BLOCK_HALF)[None, None, :]
    lo = row_ok & (dims < HALF)
    c1, c2, s1, s2 = _cos_sin_halves(cos_ptr, sin_ptr, b, s, lo, dims, cos_sb, cos_ss, cos_sd,
                                     sin_sb, sin_ss, sin_sd, HALF, NATIVE, HALF_TABLE)
    _rope_heads(q_ptr, qo_ptr, b, s, row_ok, c1, c2, s1, s2, q_sb, q_sh, q_ss, q_sd,
                qo_sb, qo_sh, qo_ss, qo_sd, HEADS, BLOCK_Q, HEAD_DIM, HALF, BLOCK_HALF,
                BLOCK_PASS, NATIVE)
    _rope_heads(k_ptr, ko_ptr, b, s, row_ok, c1, c2, s1, s2, k_sb, k_sh, k_ss, k_sd,
                ko_sb, ko_sh, ko_ss, ko_sd, KV_HEADS, BLOCK_K, HEAD_DIM, HALF, BLOCK_HALF,
                BLOCK_PASS, NATIVE)


def block_sizes(head_dim: int, rot_dim: int) -> tuple[int, int]:
    """(BLOCK_HALF, BLOCK_PASS): powers of two covering half the rotated dims and the
    pass-through dims (0 when the rotation covers the whole head)."""
    rest = head_dim - rot_dim
    return triton.next_power_of_2(rot_dim // 2), triton.next_power_of_2(rest) if rest else 0


def _warps(tile: int) -> int:
    """About 8 tile elements per thread, as a power of two between 1 and 8."""
    return min(8, 1 << max(0, (tile // 256).bit_length() - 1))


def search_space(case: Case) -> list[dict]:
    """Two layouts, listed together from small tiles to large.
    Joint: BLOCK_S positions x BLOCK_H heads of one head axis (q's heads, then k's). Few
    positions and heads per program suit decode (parallelism must come from heads); a prefill
    wants big programs (one position per program reaches about a third of the copy ceiling on
    Llama-1B's rotary). Head blocks that leave more than a quarter of the last
    block's slots empty are skipped (Llama's 32 + 8 heads: 8 or 16, not 32).
    Split (SPLIT=1): every head of BLOCK_S positions, q and k as separate power-of-two tiles,
    Liger-Kernel's layout (one position per program there; Liger's kernel was 10 % faster than
    our joint layout's best). Timed side by side, neither layout wins everywhere (within 2 %
    of each other at b8 prefill), so the search measures both."""
    block_half, _ = block_sizes(case["head_dim"], case["rot_dim"])
    total = case["heads"] + case["kv_heads"]
    most = triton.next_power_of_2(total)
    positions = case["batch"] * case["seq"]
    split_heads = (triton.next_power_of_2(case["heads"])
                   + triton.next_power_of_2(case["kv_heads"]))
    configs = []
    for bs in POSITION_BLOCKS:
        if bs > 1 and bs >= 2 * positions:
            continue
        for bh in HEAD_BLOCKS:
            tile = bs * bh * block_half
            padding = triton.cdiv(total, bh) * bh - total
            if bh > most or 8 * bh < most or tile > MAX_TILE or padding > MAX_PADDING * total:
                continue
            configs.append({"BLOCK_S": bs, "BLOCK_H": bh, "num_warps": _warps(tile)})
        tile = bs * split_heads * block_half
        if tile <= MAX_TILE and split_heads - total <= MAX_PADDING * total:
            configs.append({"SPLIT": 1, "BLOCK_S": bs, "num_warps": _warps(tile)})
            if case["dtype"] != "float32":  # in fp32 NATIVE is the default arithmetic
                configs.append({"SPLIT": 1, "BLOCK_S": bs, "num_warps": _warps(tile),
                                "NATIVE": 1})
    configs.sort(key=lambda c: c["BLOCK_S"] * c.get("BLOCK_H", split_heads))
    return configs or [{"BLOCK_S": 1, "BLOCK_H": 1, "num_warps": 1}]


_FORWARD = '''\
def _check_params(params):
    if params and params != BAKED_PARAMS:
        raise ValueError(f"specialised for {BAKED_PARAMS}, called with {params}")


def forward(q, k, cos, sin, *, out, **params) -> None:
    """q (batch, HEADS, seq, HEAD_DIM), k (batch, KV_HEADS, seq, HEAD_DIM), any strides;
    cos, sin (1 or batch, seq, ROT_DIM); out = (q_embed, k_embed) shaped like q and k."""
    _check_params(params)
    q_out, k_out = out
    batch, seq = q.shape[0], q.shape[2]
    if (tuple(q.shape) != (batch, HEADS, seq, HEAD_DIM)
            or tuple(k.shape) != (batch, KV_HEADS, seq, HEAD_DIM)
            or q_out.shape != q.shape or k_out.shape != k.shape
            or cos.shape[0] not in (1, batch) or tuple(cos.shape[1:]) != (seq, ROT_DIM)
            or sin.shape != cos.shape):
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)}"
                         f" do not fit heads={HEADS}/{KV_HEADS}, head_dim={HEAD_DIM}, "
                         f"rot_dim={ROT_DIM}")
    # A batch-1 cos/sin broadcasts over the batch through a zero batch stride, without a
    # copy (and without an expand: one tensor op less per table on the host's hot path).
    cs, ss = cos.stride(), sin.stride()
    if cos.shape[0] != batch:
        cs, ss = (0, cs[1], cs[2]), (0, ss[1], ss[2])
    grid = GRID
    _launch(grid, q, k, cos, sin, q_out, k_out, batch * seq, seq, *q.stride(), *k.stride(),
            *q_out.stride(), *k_out.stride(), *cs, *ss)


_launch = LAUNCH
'''

_JOINT = ("(cdiv(batch * seq, BLOCK_S), cdiv(HEADS + KV_HEADS, BLOCK_H))",
          "launcher(_rope_forward_kernel, HEADS=HEADS, KV_HEADS=KV_HEADS, HEAD_DIM=HEAD_DIM,\n"
          "                   HALF=ROT_DIM // 2, BLOCK_S=BLOCK_S, BLOCK_H=BLOCK_H, "
          "BLOCK_HALF=BLOCK_HALF,\n                   BLOCK_PASS=BLOCK_PASS, "
          "HALF_TABLE=HALF_TABLE, num_warps=NUM_WARPS)")
_SPLIT = ("(cdiv(batch * seq, BLOCK_S),)",
          "launcher(_rope_split_kernel, HEADS=HEADS, KV_HEADS=KV_HEADS, HEAD_DIM=HEAD_DIM,\n"
          "                   HALF=ROT_DIM // 2, BLOCK_S=BLOCK_S, BLOCK_Q=BLOCK_Q, BLOCK_K=BLOCK_K,"
          "\n                   BLOCK_HALF=BLOCK_HALF, BLOCK_PASS=BLOCK_PASS, NATIVE=NATIVE,"
          "\n                   HALF_TABLE=HALF_TABLE, num_warps=NUM_WARPS, "
          "enable_fp_fusion=not NATIVE)")


def render(config: dict, case: Case) -> str:
    heads, kv_heads, d, rot = case["heads"], case["kv_heads"], case["head_dim"], case["rot_dim"]
    block_s, warps, split = config.get("BLOCK_S", 1), config["num_warps"], config.get("SPLIT")
    block_half, block_pass = block_sizes(d, rot)
    native = bool(config.get("NATIVE"))
    arithmetic = (f"computes in {case['dtype']}, rounding each product and sum as HF's code does"
                  if native else "computes in fp32, rounds once to the output dtype")
    kind = "full rotary" if rot == d else f"partial rotary: {rot} of {d} dims, rest copied"
    half_table = bool(case.get("equal_halves"))
    table = ("reads the first half of each cos/sin row only: the model builds them as "
             "cat(freqs, freqs)" if half_table else "reads whole cos/sin rows")
    if split:
        tile = (f"every head: q as a {triton.next_power_of_2(heads)}-head tile, k as a "
                f"{triton.next_power_of_2(kv_heads)}-head tile")
        blocks = (f"BLOCK_Q = {triton.next_power_of_2(heads)}\n"
                  f"BLOCK_K = {triton.next_power_of_2(kv_heads)}\n"
                  f"NATIVE = {native}")
        grid, launch = _SPLIT
        kernels = [kernel_source(_compute_type), kernel_source(_cos_sin_halves),
                   kernel_source(_rope_heads), kernel_source(_rope_split_kernel)]
    else:
        tile = f"{config['BLOCK_H']} heads of q then k"
        blocks = f"BLOCK_H = {config['BLOCK_H']}"
        grid, launch = _JOINT
        kernels = [kernel_source(_compute_type), kernel_source(_cos_sin_halves),
                   kernel_source(_rope_forward_kernel)]
    header = textwrap.dedent(f'''\
        """Rotary embedding candidate: q_embed and k_embed in one launch ({kind}).

        Generated by codegen.rope.kernel.render. HF layout (unsqueeze_dim=1), rotate_half
        convention; {arithmetic}; {table}.
        Specialised for heads={heads}, kv_heads={kv_heads}, head_dim={d}, rot_dim={rot};
        tuned for batch {case["batch"]} x seq {case["seq"]} of {case["dtype"]}.
        Launch: one program per ({block_s} positions, {tile}), {warps} warps.
        case:   {json.dumps(case)}
        config: {json.dumps(config)}
        """

        import triton
        import triton.language as tl

        from codegen.launch import cdiv, launcher

        HEADS = {heads}
        KV_HEADS = {kv_heads}
        HEAD_DIM = {d}
        ROT_DIM = {rot}
        BLOCK_HALF = {block_half}
        BLOCK_PASS = {block_pass}
        BLOCK_S = {block_s}
        HALF_TABLE = {half_table}
        NUM_WARPS = {warps}
        BAKED_PARAMS = {{}}
        ''') + blocks + "\n"
    forward = _FORWARD.replace("GRID", grid).replace("LAUNCH", launch)
    return "\n\n".join([header, *kernels, forward])
