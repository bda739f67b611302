"""Decode attention: one query token per sequence over a KV cache, GQA, as HF runs it through
SDPA (repeat_kv or pack_gqa, the mask, SDPA, the output copy), in one kernel (or two, where a
split configuration merges its splits in a combine kernel rather than in its last split
program) that reads each key and value once and only up to the valid length.

A family of its own rather than a case of `attention`: its inputs (a cache of `slots`, the
on-device length, the mask), reference, cases, cost and kernel have nothing in common with the
causal square that family computes, and that family is declined everywhere (SDPA beats it at
prefill) while this one is not; one family holding both would branch on the case in every
contract function. The two patterns share their scope (sdpa_attention_forward) and op (one SDPA
call) and are told apart by the query's shape (`one_token_query`).

Recognition: one call of `sdpa_attention_forward` whose one compute op is
aten::scaled_dot_product_attention with a one-token query; repeat_kv's expand/reshape (views,
whose copies it claims with them), aten::to and aten::repeat_interleave may come with it.

Case keys: batch, heads, kv_heads, head_dim, slots (the keys' slots rounded up to 256: see
reference.slot_bucket), dtype, scale; edge cases add length, exact_slots, dynamic, padded,
and pads and holes (per-sequence masks).
Params: scale.

Patch: per attention instance, through the modeling module's ALL_ATTENTION_FUNCTIONS during the
instance's own call (patch.py); only one-token queries reach the kernel.

The kernel module is imported lazily: importing it applies `@triton.jit`, which fixes the
interpreter-or-compiled choice (TRITON_INTERPRET) for the process.
"""

from __future__ import annotations

from codegen.attention import FAMILY as _ATTENTION
from codegen.attention import SDPA, one_token_query
from codegen.decode_attention.patch import cases_from_model, patch
from codegen.decode_attention.reference import (
    decode_attention,
    edge_cases,
    flops,
    grow,
    make_case,
    make_inputs,
    make_out,
    min_bytes,
    params,
    rewind,
)
from core.family import Cache, Family, Pattern, VerifyHooks, lazy


def _cost(ops: list[dict]) -> tuple[int, int]:
    """Keys and values of the kv heads read once over every slot SDPA was given (the profile
    does not know a static cache's valid length; a dynamic cache's slots are its length), q read
    and the output written once. Behind repeat_kv the SDPA sees the keys widened to the query
    heads; the kv heads are then read from repeat_kv's 5-d expand."""
    from profiling.roofline import ELEM_BYTES

    sdpa = next((o for o in ops if o["name"] == SDPA), None)
    shapes = (sdpa or {}).get("shapes", [])
    dtypes = (sdpa or {}).get("dtypes", [])
    if len(shapes) < 3 or any(len(s) != 4 for s in shapes[:2]):
        return 0, 0
    q, k = shapes[0], shapes[1]
    b, kv_width, slots, d = k
    widened = [o["shapes"][0] for o in ops if o["name"] in ("aten::reshape", "aten::expand")
               and o.get("shapes") and isinstance(o["shapes"][0], list)
               and len(o["shapes"][0]) == 5 and o["shapes"][0][3] == slots]
    kv_heads = widened[0][1] if widened else kv_width
    heads = q[1] * q[2]  # (b, heads, 1, d), or pack_gqa's (b, kv_heads, group, d)
    elem = ELEM_BYTES.get(dtypes[0] if dtypes else "", 2)
    moved = (2 * b * kv_heads * slots * d + 2 * b * heads * d) * elem
    return moved, 4 * b * heads * d * slots


PATTERNS = (
    Pattern(name="decode_attention", family="decode_attention",
            function=r"^sdpa_attention_forward$",
            description="one-token (decode) attention over the KV cache (SDPA)",
            ops={SDPA: 1}, extra_ok=("aten::to", "aten::repeat_interleave"),
            cost=_cost, accepts=one_token_query),
)


FAMILY = Family(
    name="decode_attention",
    patterns=PATTERNS,
    reference=decode_attention,
    make_inputs=make_inputs,
    make_out=make_out,
    edge_cases=edge_cases,
    min_bytes=min_bytes,
    flops=flops,
    search_space=lazy("codegen.decode_attention.kernel", "search_space"),
    render=lazy("codegen.decode_attention.kernel", "render"),
    patch=patch,
    cases_from_model=cases_from_model,
    aten_ops=_ATTENTION.aten_ops + ("aten::where", "aten::masked_fill", "aten::index_select"),
    params=params,
    examples=(make_case(1, 4, 2, 16, 100, "float16"),),
    verify=VerifyHooks(
        # Stress values go into q only: k and v hold stale slots past the length, which a
        # dense reference multiplies by zero probabilities (a NaN there would turn the row NaN
        # in HF's code and not in a kernel that rightly skips it)
        stress_inputs=(0,),
        # k and v are a layer's KV cache, length and mask which of its slots are valid: the
        # same buffers step after step, one slot longer each step
        cache=Cache(inputs=(1, 2, 3, 4), rewind=rewind, grow=grow),
    ),
    # swaps transformers' attention function in a global for the call, which a trace
    # never reads (it would run SDPA silently)
    traceable=False,
    # the first FUSED configs (kernel.FUSED_CONFIGS says why they lead)
    leads=lazy("codegen.decode_attention.kernel", "leads"),
)
