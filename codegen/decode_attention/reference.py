"""One-token (decode) attention as Hugging Face's `sdpa_attention_forward` computes it over a
KV cache, and the case side of the family.

What HF passes at a decode step (transformers 5.x): q (batch, heads, 1, d), a transposed view of
the q projection; k and v (batch, kv_heads, slots, d) as the cache layer's update returned them:
for a StaticLayer its whole static buffers (slots = max_cache_len, contiguous) with a boolean
mask (batch, 1, 1, slots) that is True for the slots up to and including the current position;
for a DynamicLayer the concatenated cache (slots = the length) and no mask (sdpa then attends to
every key). HF returns (batch, 1, heads, d).

Inputs here: (q, k, v, length, mask). `length` is the static layer's `cumulative_length` after
the update (a 0-d int64 tensor on the device: the valid slots) or None for a dynamic cache;
HF's code never reads it (the mask says the same), the kernel reads it to skip the slots past
it. Slots past the length hold stale values, as a static cache's do.
"""

from __future__ import annotations

import torch

from codegen.dtypes import element_size, torch_dtype
from core.family import Case, distinct

SLOT_BUCKET = 256  # see make_case


class _Attention(torch.nn.Module):
    """What sdpa_attention_forward reads of the attention module."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.is_causal = True


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length, mask, *,
                     scale: float) -> torch.Tensor:
    """HF's own sdpa_attention_forward (the baseline the kernel replaces); float64, which only
    the verifier's accuracy reference runs, is spelled out: repeat_kv, masked softmax, PV."""
    groups = q.shape[1] // k.shape[1]
    if q.dtype == torch.float64:
        return _exact(q, k, v, mask, scale, groups)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out, _ = sdpa_attention_forward(_Attention(groups), q, k, v, mask, dropout=0.0,
                                    scaling=scale)
    return out


def _exact(q, k, v, mask, scale: float, groups: int) -> torch.Tensor:
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale  # (batch, heads, 1, slots)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if mask is not None:  # a row with no visible slot gives 0, as the kernel's empty row does
        probs = probs.masked_fill(~mask.any(-1, keepdim=True), 0.0)
    return (probs @ v).transpose(1, 2).contiguous()


def slot_bucket(slots: int) -> int:
    """The cases' cache size: the keys' slots rounded up to a multiple of SLOT_BUCKET, so that
    a dynamic cache at the profiled length and the static caches built for that workload
    (a few slots or a few hundred more) dispatch to the same verified kernel."""
    return -(-max(int(slots), 1) // SLOT_BUCKET) * SLOT_BUCKET


def make_case(batch: int, heads: int, kv_heads: int, head_dim: int, slots: int, dtype: str,
              scale: float | None = None) -> Case:
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    return {"batch": int(batch), "heads": int(heads), "kv_heads": int(kv_heads),
            "head_dim": int(head_dim), "slots": slot_bucket(slots), "dtype": dtype,
            "scale": float(head_dim ** -0.5 if scale is None else scale)}


def params(case: Case) -> dict:
    return {"scale": case["scale"]}


def _mask(case: Case, slots: int, length: int) -> torch.Tensor:
    """(batch, 1, 1, slots) bool: the slots each sequence sees. `padded`: the first `padded`
    slots of every sequence hidden; `pads`: each sequence's own left padding (a left-padded
    batch of different lengths); `holes`: one more slot hidden per sequence (-1: none)."""
    b = case["batch"]
    at = torch.arange(slots)
    pads = torch.tensor(case.get("pads", [case.get("padded", 0)] * b))[:, None]
    holes = torch.tensor(case.get("holes", [-1] * b))[:, None]
    visible = (at < length) & (at >= pads) & (at != holes)
    return visible.view(b, 1, 1, slots)


def make_inputs(case: Case, device="cpu", generator=None) -> tuple:
    """A static cache of the case's `slots` (or `exact_slots`) with `length` valid slots
    (default: all of them, the slowest length the case dispatches), its mask, and q as HF's
    transposed view; `dynamic`: the cache HF concatenates, slots == length, no length, and no
    mask unless the case pads its sequences. Padding (`_mask`): `padded` slots hidden at the
    start of every sequence, or `pads` per sequence, and `holes`."""
    b, h, kv, d = case["batch"], case["heads"], case["kv_heads"], case["head_dim"]
    slots = case.get("exact_slots", case["slots"])
    length = case.get("length", slots)
    dtype = torch_dtype(case["dtype"])
    gen_device = generator.device if generator is not None else "cpu"

    def randn(*shape):
        return torch.randn(shape, generator=generator, device=gen_device)

    q = randn(b, 1, h, d).to(device=device, dtype=dtype).transpose(1, 2)
    if case.get("dynamic"):
        k, v = (randn(b, kv, length, d).to(device=device, dtype=dtype) for _ in range(2))
        padded = "pads" in case or "padded" in case
        return q, k, v, None, _mask(case, length, length).to(device) if padded else None
    k, v = randn(b, kv, slots, d), randn(b, kv, slots, d)
    # stale slots past the length: larger than any valid key, so a kernel that reads them
    # (or ignores the mask) is visibly wrong
    k[:, :, length:] *= 8.0
    v[:, :, length:] += 4.0
    k, v = k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype)
    mask = _mask(case, slots, length).to(device)
    return q, k, v, torch.tensor(length, dtype=torch.long, device=device), mask


def rewind(case: Case, inputs: tuple) -> bool:
    """In place, the static cache one decode step earlier: its last valid slot dropped from
    the length and from every sequence's mask (the slot keeps its keys, stale, as a model's
    do). False for a dynamic cache (HF concatenates a new one each step) or one valid slot."""
    _, _, _, length, mask = inputs
    if length is None or int(length) < 2:
        return False
    last = int(length) - 1
    length.fill_(last)
    mask[..., last] = False
    return True


def grow(case: Case, inputs: tuple, generator=None) -> None:
    """In place, the static cache's next decode step: new keys and values written into the
    slot at the length, which every sequence then sees, and the length advanced by one."""
    _, k, v, length, mask = inputs
    slot = int(length)
    gen_device = generator.device if generator is not None else "cpu"
    for t in (k, v):
        t[:, :, slot] = torch.randn(t[:, :, slot].shape, generator=generator,
                                    device=gen_device).to(device=t.device, dtype=t.dtype)
    mask[..., slot] = True
    length.fill_(slot + 1)


def make_out(case: Case, inputs: tuple) -> torch.Tensor:
    q = inputs[0]
    return torch.empty((case["batch"], 1, case["heads"], case["head_dim"]), dtype=q.dtype,
                       device=q.device)


def edge_cases(case: Case) -> list[Case]:
    """Lengths at the edges: 1 (the first step after a one-token prompt); per-sequence left
    padding, over a static and over a dynamic cache (a left-padded batch of different lengths,
    with a sequence that sees one slot only and one that sees all but one: a kernel that
    applies one sequence's mask row to the whole batch fails it); just past one 64-slot block
    (a chunk boundary of most split configs), the last slot of a static cache whose slots are
    no multiple of a block; the dynamic layout at batch 3; left padding alike in every
    sequence; 7 query heads per kv head (Qwen2.5-0.5B's 14/2); no grouping. The case itself is
    the full cache."""
    slots, heads = case["slots"], case["heads"]
    ragged = min(70, slots)
    cases = [
        {**case, "length": 1},
        {**case, "batch": 3, "length": ragged, "pads": [ragged - 1, 0, 5],
         "holes": [-1, ragged // 2, -1]},
        {**case, "dynamic": True, "batch": 2, "length": min(40, slots), "pads": [0, 13]},
        {**case, "length": min(65, slots)},
        {**case, "exact_slots": slots - 8 if slots > 16 else slots,
         "length": slots - 9 if slots > 16 else slots},
        {**case, "dynamic": True, "batch": 3, "length": min(77, slots)},
        {**case, "padded": 3, "length": min(50, slots)},
        {**case, "heads": 14, "kv_heads": 2, "length": min(40, slots)},
        {**case, "kv_heads": heads, "length": min(33, slots)},
    ]
    return distinct(case, cases)


def min_bytes(case: Case) -> int:
    """Keys and values up to the length read once; q read and the output written once."""
    length = case.get("length", case.get("exact_slots", case["slots"]))
    kv = 2 * case["batch"] * case["kv_heads"] * length * case["head_dim"]
    qo = 2 * case["batch"] * case["heads"] * case["head_dim"]
    return (kv + qo) * element_size(case)


def flops(case: Case) -> int:
    length = case.get("length", case.get("exact_slots", case["slots"]))
    return 4 * case["batch"] * case["heads"] * case["head_dim"] * length
