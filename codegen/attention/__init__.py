"""Causal attention forward (prefill) with grouped-query heads, as HF runs it through SDPA.

Recognition (moved here from profiling/patterns.py, unchanged): the scope is one call of the
Python function `sdpa_attention_forward` (or `eager_attention_forward`, which never matches: it
runs matmul/softmax, not SDPA) and its one top-level op is aten::scaled_dot_product_attention,
whatever the backend runs beneath it; aten::to and aten::repeat_interleave may come with it.

Case keys: batch, seq, heads, kv_heads, head_dim, dtype, scale; `layouts`, q's, k's and v's
memory layouts where they are not three transposed views (reference.HEAD_LAYOUTS); edge cases
may add `contiguous` (q/k/v not transposed views). Params: scale.

Patch: per attention instance, through the modeling module's ALL_ATTENTION_FUNCTIONS during the
instance's own call (see patch.py); only unpadded prefill calls reach the kernel.

The kernel module is imported lazily: importing it applies `@triton.jit`, which fixes the
interpreter-or-compiled choice (TRITON_INTERPRET) for the process.
"""

from __future__ import annotations

from codegen.attention.patch import cases_from_model, patch
from codegen.attention.reference import (
    attention,
    edge_cases,
    flops,
    make_case,
    make_inputs,
    make_out,
    min_bytes,
    params,
)
from core.family import Family, Pattern, RankHooks, lazy

SDPA = "aten::scaled_dot_product_attention"


def _cost(ops: list[dict]) -> tuple[int, int]:
    """q, k, v read once and the output (q's size) written once; causal QK^T and PV. k and v
    are counted before any repeat_interleave widened them to the query heads."""
    from profiling.roofline import input_bytes

    sdpa = next((o for o in ops if o["name"] == SDPA), None)
    shapes = (sdpa or {}).get("shapes", [])
    if len(shapes) < 3 or len(shapes[0]) != 4 or len(shapes[1]) != 4:
        return 0, 0
    repeats = [o for o in ops if o["name"] == "aten::repeat_interleave"]
    kv = (sum(input_bytes(o, 0) for o in repeats[:2]) if len(repeats) >= 2
          else input_bytes(sdpa, 1) + input_bytes(sdpa, 2))
    (b, h, sq, d), sk = shapes[0], shapes[1][2]
    flops = 2 * b * h * d * sq * (sq + 1) if sq == sk else 4 * b * h * d * sq * sk
    return 2 * input_bytes(sdpa, 0) + kv, flops


# Measured against the SDPA backends HF runs (cuDNN / flash) on the H200: 0.19x at GPT-2's
# prefill shapes and 0.23x at Llama-3.2-1B's (pipeline optimize). It never shipped
# and cost a search and a verification on every run, so the ranking leaves its row without a
# family (`RankHooks.declines`) until the kernel is competitive; `--only attention` still runs it.
NOT_COMPETITIVE = "no competitive kernel: SDPA is faster (0.19-0.23x measured on the H200)"


def one_token_query(ops: list[dict]) -> bool:
    """Whether the SDPA call attends one query token per sequence (a decode step): q's length
    axis is 1, or the mask's is (transformers 5.2x packs a one-token query's heads of one kv
    head into that axis, `pack_gqa`). Such a call is the decode_attention family's."""
    sdpa = next((o for o in ops if o["name"] == SDPA), None)
    shapes = (sdpa or {}).get("shapes", [])
    if len(shapes) < 2 or len(shapes[0]) != 4:
        return False
    mask = shapes[3] if len(shapes) > 3 else []
    return shapes[0][2] == 1 or (isinstance(mask, list) and len(mask) == 4 and mask[2] == 1)


def declines(row: dict) -> str | None:
    return NOT_COMPETITIVE


PATTERNS = (
    Pattern(name="attention", family="attention",
            function=r"^(sdpa_attention_forward|eager_attention_forward)$",
            description="scaled dot-product attention (SDPA)",
            ops={SDPA: 1}, extra_ok=("aten::to", "aten::repeat_interleave"),
            cost=_cost, accepts=lambda ops: not one_token_query(ops)),
)


FAMILY = Family(
    name="attention",
    patterns=PATTERNS,
    reference=attention,
    make_inputs=make_inputs,
    make_out=make_out,
    edge_cases=edge_cases,
    min_bytes=min_bytes,
    flops=flops,
    search_space=lazy("codegen.attention.kernel", "search_space"),
    render=lazy("codegen.attention.kernel", "render"),
    patch=patch,
    cases_from_model=cases_from_model,
    # SDPA, each backend it dispatches to, and the unfused matmul/softmax it could be spelled as.
    aten_ops=(SDPA, "aten::_scaled_dot_product_attention_math",
              "aten::_scaled_dot_product_flash_attention",
              "aten::_scaled_dot_product_flash_attention_for_cpu",
              "aten::_scaled_dot_product_efficient_attention",
              "aten::_scaled_dot_product_cudnn_attention",
              "aten::_scaled_dot_product_fused_attention_overrideable",
              "aten::_flash_attention_forward", "aten::_efficient_attention_forward",
              "aten::matmul", "aten::bmm", "aten::baddbmm", "aten::mm", "aten::softmax",
              "aten::_softmax", "aten::_safe_softmax"),
    params=params,
    examples=(make_case(2, 8, 4, 2, 16, "float16"),),
    # No VerifyHooks: stress values go into q, k and v alike (the default), so NaN/inf
    # injection lands in q: a non-finite key or value would reach rows that a causal kernel
    # never reads, where a dense reference multiplies it by a zero probability and gets NaN.
    rank=RankHooks(
        declines=declines,
    ),
    # swaps transformers' attention function in a global for the call, which a trace
    # never reads (it would run SDPA silently)
    traceable=False,
)
