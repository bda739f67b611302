"""KV-cache append family: DynamicLayer.update's two cats (keys, values) in one launch.

Recognition (moved here from profiling/patterns.py, unchanged): the scope is one call of a
Python function named `update` or `lazy_initialization`, and the pattern claims every op in it
(ops={}). Innermost first: on a prefill `lazy_initialization` (inside DynamicLayer.update)
claims its own ops, aten::empty/to/lift_fresh/detach_ twice for the two `torch.tensor([])`,
which launch nothing; DynamicLayer.update then claims its two aten::cat; Cache.update around
it finds nothing left. A decode step has the two cats only. Observed with torch.profiler on
the H200 Llama fixtures (tests/fixtures) and on the CPU tiny models.

Case keys: batch, kv_heads, head_dim, past, new, dtype; edge cases may add `contiguous` (new
states not transposed views) and `cropped` (the cache a strided view). No params.

Patch: per attention instance, through the cache layer's `update` during the instance's own
call (see patch.py); plain DynamicLayer layers, and StaticLayer layers (StaticCache, what a
captured decode step runs: the static layout, `layout: "static"` in the case, written in place
at the on-device position in one launch).

The kernel module is imported lazily: importing it applies `@triton.jit`, which fixes the
interpreter-or-compiled choice (TRITON_INTERPRET) for the process.
"""

from __future__ import annotations

from codegen.kv_cache.patch import cases_from_model, patch
from codegen.kv_cache.reference import (
    edge_cases,
    flops,
    kv_append,
    make_case,
    make_inputs,
    make_out,
    make_static_case,
    min_bytes,
    params,
)
from core.family import Cache, Family, Pattern, RankHooks, VerifyHooks, lazy


def _occurrence_case(ops: list[dict]) -> dict:
    """Which of the two kinds of case one profiled update is: a static cache writes its slots
    with index_copy_ (the step a CUDA graph replays, at 7.0x inside a graph on GPT-2 decode),
    a dynamic one appends with cat after `past` positions (1.8x there)."""
    if any(o["name"] == "aten::index_copy_" for o in ops):
        return {"layout": "static"}
    cat = next((o for o in ops if o["name"] == "aten::cat" and o.get("shapes")), None)
    first = (cat["shapes"][0] or [None])[0] if cat else None
    past = first[2] if isinstance(first, list) and len(first) == 4 else None
    return {"layout": None, **({"past": past} if past is not None else {})}


def _cost(ops: list[dict]) -> tuple[int, int]:
    """Every cat input read once and the same bytes written once. The profiler records a
    cat's inputs as one TensorList without an element type, so its bytes are counted at 2 per
    element (roofline's default; the GPU workloads are bf16 or fp16)."""
    from profiling.roofline import tensor_bytes

    moved = 0
    for op in ops:
        if op["name"] != "aten::cat" or not op.get("shapes"):
            continue
        listed, dtype = op["shapes"][0], (op.get("dtypes") or [""])[0]
        if isinstance(listed, list) and all(isinstance(s, list) for s in listed):
            moved += 2 * sum(tensor_bytes(s, dtype) for s in listed)
    return moved, 0


PATTERNS = (
    Pattern(name="kv_cache", family="kv_cache", function=r"^(update|lazy_initialization)$",
            description="KV-cache update (model(input_ids) builds a cache by default)",
            ops={}, cost=_cost),
)


FAMILY = Family(
    name="kv_cache",
    patterns=PATTERNS,
    reference=kv_append,
    make_inputs=make_inputs,
    make_out=make_out,
    edge_cases=edge_cases,
    min_bytes=min_bytes,
    flops=flops,
    search_space=lazy("codegen.kv_cache.kernel", "search_space"),
    render=lazy("codegen.kv_cache.kernel", "render"),
    patch=patch,
    cases_from_model=cases_from_model,
    aten_ops=("aten::cat",),
    params=params,
    examples=(make_case(2, 2, 16, 0, 6, "float16"), make_static_case(1, 2, 16, 1, "float16"),),
    benchmark="codegen.kv_cache.bench",
    verify=VerifyHooks(
        # the static layout's adapter writes into the cache buffers themselves
        in_place=lambda inputs: inputs[:2] if len(inputs) == 5 else None,
        # the keys and values held before the call (no growth probe: a dynamic cache is a new
        # tensor each step, and the static layout's position is an input the case fixes)
        cache=Cache(inputs=(0, 1)),
    ),
    rank=RankHooks(
        occurrence_case=_occurrence_case,
    ),
    # the static layout's launch advances the cache position on the device, beyond `out`
    # and `in_place`, and the dynamic layout compares source text per call
    traceable=False,
)
