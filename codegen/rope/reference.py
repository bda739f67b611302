"""Rotary position embedding as Hugging Face applies it, and the case side of the family.

Layout (HF, `unsqueeze_dim=1`): q (batch, heads, seq, head_dim) and k (batch, kv_heads, seq,
head_dim) are transposed views of the projections' (batch, seq, heads, head_dim) outputs, so
they are not contiguous; cos and sin are (cos_batch, seq, rot_dim), with cos_batch 1 when the
model builds position ids itself. Convention `rotate_half`: the first and second halves of the
rotated dims pair up (not even/odd lanes).

Two HF forms: Llama's rotates all of head_dim; Phi-3's rotates the first rot_dim = cos.shape[-1]
dims and passes the rest through (partial rotary). `apply_rotary` repeats whichever form the
shapes call for literally, so it is bitwise identical to both functions (tests check it).
"""

from __future__ import annotations

import torch

from codegen.dtypes import element_size, random_heads, torch_dtype
from core.family import Case, distinct


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    rotary_dim = cos.shape[-1]
    if rotary_dim == q.shape[-1]:
        q_embed = (q * cos) + (rotate_half(q) * sin)
        k_embed = (k * cos) + (rotate_half(k) * sin)
        return q_embed, k_embed
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = torch.cat([(q_rot * cos) + (rotate_half(q_rot) * sin), q_pass], dim=-1)
    k_embed = torch.cat([(k_rot * cos) + (rotate_half(k_rot) * sin), k_pass], dim=-1)
    return q_embed, k_embed


def make_case(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, rot_dim: int,
              dtype: str, cos_batch: int = 1, equal_halves: bool = False,
              qkv: bool = False, head_width: int | None = None,
              interleaved: bool = False) -> Case:
    """`equal_halves`: the model's cos/sin rows are cat(freqs, freqs) by construction (see
    patch.tables_have_equal_halves), so a kernel may read only their first half. `qkv`: q and
    k are column slices of one fused q/k/v projection (Phi-3's qkv_proj), as the adapter hands
    them (row stride (heads + 2 kv_heads) head_dim, k at storage offset heads head_dim); with
    `interleaved`, as GPT-NeoX's query_key_value hands them instead: each head's q, k and v
    side by side (row stride 3 heads head_dim, k at offset head_dim). `head_width`: q and k are
    the first head_dim columns of heads head_width wide (Phi-2 and StableLM slice their partial
    rotary's part before calling Llama's function). Each key is present only when true, so
    other cases keep their earlier keys."""
    if rot_dim % 2 or not 0 < rot_dim <= head_dim:
        raise ValueError(f"rot_dim must be even and in (0, head_dim], got {rot_dim}/{head_dim}")
    case = {"batch": int(batch), "seq": int(seq), "heads": int(heads), "kv_heads": int(kv_heads),
            "head_dim": int(head_dim), "rot_dim": int(rot_dim), "cos_batch": int(cos_batch),
            "dtype": dtype}
    if equal_halves:
        case["equal_halves"] = True
    if qkv:
        case["qkv"] = True
        if interleaved:
            case["interleaved"] = True
    if head_width and head_width != head_dim:
        case["head_width"] = int(head_width)
    return case


def params(case: Case) -> dict:
    """Rotary has no scalar params (unsqueeze_dim=1 is the layout itself)."""
    return {}




def make_inputs(case: Case, device="cpu", generator=None) -> tuple:
    """q, k as HF makes them (transposed views; contiguous when the case says `contiguous`),
    cos/sin from real angles at random positions. The two halves of a table row are HF's
    cat(freqs, freqs) only where the case says `equal_halves`; otherwise the second half's
    angles differ, so a kernel that reads one half and uses it twice fails verification."""
    s, rot = case["seq"], case["rot_dim"]
    dtype = torch_dtype(case["dtype"])
    gen_device = generator.device if generator is not None else "cpu"
    if case.get("qkv"):
        q, k = _fused_qk(case, device, generator)
    elif case.get("head_width"):
        q, k = (random_heads({**case, "head_dim": case["head_width"]}, n, device,
                             generator)[..., :case["head_dim"]]
                for n in (case["heads"], case["kv_heads"]))
    else:
        q = random_heads(case, case["heads"], device, generator)
        k = random_heads(case, case["kv_heads"], device, generator)
    start = torch.randint(0, 4096, (case["cos_batch"], 1), generator=generator,
                          device=gen_device)
    positions = (start + torch.arange(s, device=gen_device)).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, device=gen_device).float() / rot))
    freqs = positions[..., None] * inv_freq
    emb = torch.cat((freqs, freqs if case.get("equal_halves") else freqs * 1.5 + 0.25), dim=-1)
    cos = emb.cos().to(device=device, dtype=dtype)
    sin = emb.sin().to(device=device, dtype=dtype)
    return q, k, cos, sin


def _fused_qk(case: Case, device, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k as Phi-3's attention makes them: head views of the first two column blocks of
    one (batch, seq, (heads + 2 kv_heads) head_dim) projection, transposed."""
    b, s, d, h, kv = case["batch"], case["seq"], case["head_dim"], case["heads"], case["kv_heads"]
    gen_device = generator.device if generator is not None else "cpu"
    if case.get("interleaved"):  # GPT-NeoX: (batch, seq, heads, [q | k | v])
        qkv = torch.randn((b, s, h, 3 * d), generator=generator, device=gen_device)
        qkv = qkv.to(device=device, dtype=torch_dtype(case["dtype"])).transpose(1, 2)
        return qkv[..., :d], qkv[..., d:2 * d]
    qkv = torch.randn((b, s, (h + 2 * kv) * d), generator=generator, device=gen_device)
    qkv = qkv.to(device=device, dtype=torch_dtype(case["dtype"]))
    q = qkv[..., :h * d].view(b, s, h, d).transpose(1, 2)
    k = qkv[..., h * d:(h + kv) * d].view(b, s, kv, d).transpose(1, 2)
    return q, k


def make_out(case: Case, inputs: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """Outputs in q's and k's own memory order, as the patch adapter allocates them (and as
    HF's elementwise result comes out): a (batch, heads, seq, dim) buffer written from HF's
    (batch, seq, heads, dim) views would time a transposing write the model never does."""
    return torch.empty_like(inputs[0]), torch.empty_like(inputs[1])


def edge_cases(case: Case) -> list[Case]:
    """Variations a candidate rendered for `case` must survive: head counts and dims are baked
    into it (the dispatcher only sends it those), so edges vary what stays free at run time:
    one token (a decode step); an odd batch and a prime sequence with cos/sin given per
    sequence; contiguous q/k instead of HF's transposed views."""
    per_row = case["cos_batch"] > 1  # cos/sin per sequence stay so at the edges' batches
    cases = [
        {**case, "batch": 1, "seq": 1, "cos_batch": 1},
        {**case, "batch": 3, "seq": 7, "cos_batch": 3},
        {**{k: v for k, v in case.items() if k not in ("qkv", "interleaved", "head_width")},
         "batch": 2, "seq": 5, "cos_batch": 2 if per_row else 1, "contiguous": True},
    ]
    return distinct(case, cases)



def min_bytes(case: Case) -> int:
    """Read q, k, cos, sin once; write q_embed and k_embed once."""
    qk = case["batch"] * case["seq"] * (case["heads"] + case["kv_heads"]) * case["head_dim"]
    cos_sin = 2 * case["cos_batch"] * case["seq"] * case["rot_dim"]
    return (2 * qk + cos_sin) * element_size(case)


def flops(case: Case) -> int:
    """Two multiplies and an add per rotated element."""
    rows = case["batch"] * case["seq"] * (case["heads"] + case["kv_heads"])
    return 3 * rows * case["rot_dim"]
