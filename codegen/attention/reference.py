"""Causal prefill attention as Hugging Face's `sdpa_attention_forward` computes it, and the case
side of the family.

What HF does for an unpadded prefill with SDPA (transformers 5.x, integrations/sdpa_attention.py):
attention_mask is None (the mask builder drops an all-ones padding mask), so it calls
`scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, scale=scaling,
is_causal=q_len > 1, enable_gqa=True)` (enable_gqa only when heads != kv_heads) and returns
`out.transpose(1, 2).contiguous()`: (batch, seq, heads, head_dim), not SDPA's layout.

Inputs: q (batch, heads, seq, head_dim), k and v (batch, kv_heads, seq, head_dim). Query head h
reads kv head h // (heads // kv_heads), as repeat_interleave / enable_gqa do. Their memory
layouts (`HEAD_LAYOUTS`) differ by model, and the case records them (`layouts`, q/k/v): "bshd",
a transposed view of a (batch, seq, heads, head_dim) projection (Llama's q after the rotary);
"bhsd", contiguous (k and v out of a KV-cache update, Phi-3's q out of its rotary's cat); "qkv",
a transposed view of one column block of a fused (batch, seq, (heads + 2 kv_heads) head_dim)
q/k/v projection (GPT-2's c_attn).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from codegen.dtypes import element_size, random_heads, torch_dtype
from codegen.shapes import canonical, strides
from core.family import Case, distinct


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              scale: float) -> torch.Tensor:
    if q.dtype == torch.float64:
        return _exact_attention(q, k, v, scale)
    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, scale=scale,
                                         is_causal=q.shape[2] > 1, **gqa)
    return out.transpose(1, 2).contiguous()


def _exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """The same attention spelled out, for float64, which only the verifier's accuracy
    reference runs (no model does). SDPA's float64 paths disagree on non-finite inputs: the math
    backend adds its causal mask, so a masked-out key whose score is +inf turns the row NaN
    (inf + -inf), and the CPU's fused kernel zeroes rows whose scores are all NaN. Here a masked
    key is replaced by -inf, so it never counts; a NaN or +inf score among the visible keys makes
    the row NaN; a row whose visible scores are all -inf gives 0 (SDPA's and FlashAttention's
    fully-masked convention). That is what a causal kernel which skips masked keys computes."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    masked = ~torch.ones((q.shape[2], q.shape[2]), dtype=torch.bool, device=q.device).tril()
    out = torch.empty_like(q)
    for b in range(q.shape[0]):  # one sequence at a time: heads x seq x seq float64 scores
        scores = (q[b] @ k[b].transpose(-1, -2)).mul_(scale).masked_fill_(masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        probs.masked_fill_((scores == float("-inf")).all(-1, keepdim=True), 0.0)
        out[b] = probs @ v[b]
    return out.transpose(1, 2).contiguous()


HEAD_LAYOUTS = ("bshd", "bhsd", "qkv")
DEFAULT_LAYOUTS = ("bshd", "bshd", "bshd")


def make_case(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, dtype: str,
              scale: float | None = None, layouts: tuple[str, str, str] = DEFAULT_LAYOUTS
              ) -> Case:
    """`layouts`: q's, k's and v's memory layout (HEAD_LAYOUTS), as the adapter hands them;
    the key is present only where they differ from three transposed views, so those cases
    keep their earlier keys."""
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    if len(layouts) != 3 or any(x not in HEAD_LAYOUTS for x in layouts):
        raise ValueError(f"layouts must be three of {HEAD_LAYOUTS}, got {layouts}")
    case = {"batch": int(batch), "seq": int(seq), "heads": int(heads), "kv_heads": int(kv_heads),
            "head_dim": int(head_dim), "dtype": dtype,
            "scale": float(head_dim ** -0.5 if scale is None else scale)}
    # one name per addressing: a layout equal to an earlier one of HEAD_LAYOUTS but for the
    # strides of size-1 dims (one kv head, one token) takes that one's name
    layouts = tuple(next(x for x in HEAD_LAYOUTS if _same(x, layout, role, case))
                    for role, layout in enumerate(layouts))
    if tuple(layouts) != DEFAULT_LAYOUTS:
        case["layouts"] = ",".join(layouts)
    return case


def _strides(layout: str, role: int, case: Case) -> tuple[tuple, int]:
    """(strides, storage offset) of q (role 0), k (1) or v (2) in `layout`."""
    s, d, h, kv = case["seq"], case["head_dim"], case["heads"], case["kv_heads"]
    n = (h, kv, kv)[role]
    if layout == "bhsd":
        return (n * s * d, s * d, d, 1), 0
    if layout == "bshd":
        return (s * n * d, d, n * d, 1), 0
    width = (h + 2 * kv) * d
    return (s * width, d, width, 1), (0, h * d, (h + kv) * d)[role]


def _same(a: str, b: str, role: int, case: Case) -> bool:
    n = (case["heads"], case["kv_heads"], case["kv_heads"])[role]
    shape = (case["batch"], n, case["seq"], case["head_dim"])
    (sa, oa), (sb, ob) = _strides(a, role, case), _strides(b, role, case)
    return canonical(shape, sa) == canonical(shape, sb) and oa == ob


def head_layout(t: torch.Tensor, role: int, case: Case) -> str | None:
    """Which of HEAD_LAYOUTS `t` (q, k or v by `role`) has, or None for any other layout."""
    got = (strides(t), t.storage_offset())

    def want(layout: str) -> tuple:
        stride, offset = _strides(layout, role, case)
        return canonical(t.shape, stride), offset

    return next((x for x in HEAD_LAYOUTS if want(x) == got), None)


def layouts_of(case: Case) -> tuple[str, ...]:
    if case.get("contiguous"):
        return ("bhsd",) * 3
    return tuple(case["layouts"].split(",")) if "layouts" in case else DEFAULT_LAYOUTS


def params(case: Case) -> dict:
    return {"scale": case["scale"]}


def make_inputs(case: Case, device="cpu", generator=None) -> tuple:
    """q, k, v in the case's layouts (`layouts_of`; all contiguous where it says
    `contiguous`); those in "qkv" are column blocks of one fused projection."""
    b, s, d, h, kv = case["batch"], case["seq"], case["head_dim"], case["heads"], case["kv_heads"]
    layouts = layouts_of(case)
    gen_device = generator.device if generator is not None else "cpu"
    fused = None
    if "qkv" in layouts:
        fused = torch.randn((b, s, (h + 2 * kv) * d), generator=generator, device=gen_device)
        fused = fused.to(device=device, dtype=torch_dtype(case["dtype"]))
    out = []
    for role, (layout, n) in enumerate(zip(layouts, (h, kv, kv))):
        if layout == "qkv":
            strides, offset = _strides("qkv", role, case)
            out.append(fused.as_strided((b, n, s, d), strides, offset))
        else:
            out.append(random_heads({**case, "contiguous": layout == "bhsd"}, n, device,
                                    generator))
    return tuple(out)


def make_out(case: Case, inputs: tuple) -> torch.Tensor:
    q = inputs[0]
    return torch.empty((case["batch"], case["seq"], case["heads"], case["head_dim"]),
                       dtype=q.dtype, device=q.device)


def edge_cases(case: Case) -> list[Case]:
    """Variations a candidate rendered for `case` must survive. head_dim (and the scale that
    goes with it) is baked into a candidate; batch, seq and head counts stay free at run time,
    so edges vary those: one token; a sequence spanning several blocks and a multiple of none;
    a prime sequence; kv_heads == heads (no grouping); 7 query heads per kv head (Qwen2.5-0.5B's
    14/2); contiguous inputs instead of HF's transposed views."""
    heads = case["heads"]
    cases = [
        {**case, "batch": 1, "seq": 1},
        {**case, "batch": 1, "seq": 200},
        {**case, "batch": 3, "seq": 37},
        {**case, "batch": 1, "seq": 19, "kv_heads": heads},
        {**case, "batch": 1, "seq": 23, "heads": 14, "kv_heads": 2},
        {**case, "batch": 2, "seq": 17, "contiguous": True},
    ]
    return distinct(case, cases)


def min_bytes(case: Case) -> int:
    """Read q, k, v once; write the output once."""
    tokens = case["batch"] * case["seq"] * case["head_dim"]
    return 2 * tokens * (case["heads"] + case["kv_heads"]) * element_size(case)


def flops(case: Case) -> int:
    """QK^T and PV over the causal triangle: s(s+1)/2 (query, key) pairs per head, 2 * head_dim
    flops each per matmul."""
    b, s, h, d = case["batch"], case["seq"], case["heads"], case["head_dim"]
    return 2 * b * h * d * s * (s + 1)
