"""Rotary embedding family: q and k rotated in one launch (HF layout, rotate_half, partial rotary).

Recognition: the scope is one call of the Python function `apply_rotary_pos_emb` (a function
frame inside the attention module). The `rotate_half` frames nested in it match no pattern, so
their ops stay in the occurrence. Observed top-level ops with torch.profiler (CPU, torch 2.13;
CUDA, torch 2.11 trace of Llama), views (unsqueeze, slice, narrow, as_strided) aside:
Llama/Qwen2/Mistral/Gemma: aten::mul x4, aten::neg x2, aten::cat x2, aten::add x2;
Phi-3 (partial-rotary code, whatever the factor): the same plus two more aten::cat that
append the pass-through dims.

Case keys: batch, seq, heads, kv_heads, head_dim, rot_dim, cos_batch, dtype; `equal_halves`
where the model's rotary embedding is HF's (cos/sin rows are cat(freqs, freqs), so the kernel
reads half of each); edge cases may add `contiguous` (q/k not transposed views). No params.

The kernel module is imported lazily: importing it applies `@triton.jit`, which fixes the
interpreter-or-compiled choice (TRITON_INTERPRET) for the process.
"""

from __future__ import annotations

from codegen.rope.patch import cases_from_model, patch
from codegen.rope.reference import (
    apply_rotary,
    edge_cases,
    flops,
    make_case,
    make_inputs,
    make_out,
    min_bytes,
    params,
)
from core.family import Family, Pattern, VerifyHooks, lazy


def _cost(ops: list[dict]) -> tuple[int, int]:
    """q and k read and written once, cos and sin read once. In HF order the first mul is
    q * cos and the third k * cos."""
    from profiling.roofline import input_bytes

    muls = [o for o in ops if o["name"] == "aten::mul"]
    if len(muls) < 3:
        return 0, 0
    q, cos, k = input_bytes(muls[0], 0), input_bytes(muls[0], 1), input_bytes(muls[2], 0)
    return 2 * (q + k) + 2 * cos, 0


PATTERNS = (
    Pattern(name="rope", family="rope", function=r"^apply_rotary_pos_emb$",
            description="rotary embedding of q and k: q*cos + rotate_half(q)*sin, same for k",
            ops={"aten::mul": 4, "aten::neg": 2, "aten::cat": 2, "aten::add": 2}, cost=_cost),
    Pattern(name="rope_partial", family="rope", function=r"^apply_rotary_pos_emb$",
            description="partial rotary (Phi-3): the first rot_dim dims rotated, the rest "
                        "appended unchanged by a second cat",
            ops={"aten::mul": 4, "aten::neg": 2, "aten::cat": 4, "aten::add": 2}, cost=_cost),
)


FAMILY = Family(
    name="rope",
    patterns=PATTERNS,
    reference=apply_rotary,
    make_inputs=make_inputs,
    make_out=make_out,
    edge_cases=edge_cases,
    min_bytes=min_bytes,
    flops=flops,
    search_space=lazy("codegen.rope.kernel", "search_space"),
    render=lazy("codegen.rope.kernel", "render"),
    patch=patch,
    cases_from_model=cases_from_model,
    aten_ops=("aten::mul", "aten::neg", "aten::cat", "aten::add"),
    params=params,
    examples=(make_case(2, 4, 4, 2, 16, 8, "float16"),),
    benchmark="codegen.rope.bench",
    verify=VerifyHooks(
        # Stress values go into q and k only: cos/sin are cosines and sines in every model, and
        # stressing them to 1e4 would test an input no caller can produce. The adapter writes
        # the rotation over q and k (patch.in_place_ok), so the verifier runs each candidate
        # that way.
        stress_inputs=(0, 1),
        in_place=lambda inputs: inputs[:2],
    ),
)
