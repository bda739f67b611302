"""Mixture-of-experts block family: the router, the experts and their weighted sum as one fused
Triton pipeline (Mixtral, Qwen2-MoE's routed part, Qwen3-MoE, OLMoE, gpt-oss).

Recognition: the scope is one call of the model's MoE block (`MixtralSparseMoeBlock`,
`Qwen2MoeSparseMoeBlock`, `Qwen3MoeSparseMoeBlock`, `OlmoeSparseMoeBlock`, `GptOssMLP`); the
pattern claims every op inside it that no inner pattern claims, whichever
`experts_implementation` the model runs (eager's loop over experts, batched_mm's gathers and
bmm, grouped_mm's sort, histogram and grouped GEMMs), and takes in the router's softmax, which
the softmax pattern claims first as a call of `F.softmax` (`Pattern.inner`). So the router, the
experts and the combine are one row, and the ranking gives the experts block's share of the
pass. Qwen2-MoE's shared expert is an MLP of its own (gated_act's row); its sigmoid gate and
the add to the routed part stay in this row and run as HF runs them when patched.

The kernel module is imported lazily (core.family.lazy): importing it applies `@triton.jit`,
which fixes the interpreter-or-compiled choice for the process.
"""

from __future__ import annotations

from collections import Counter

from codegen.moe_experts.patch import BLOCKS, cases_from_model, patch
from codegen.moe_experts.reference import (
    edge_cases,
    flops,
    make_case,
    make_inputs,
    make_out,
    min_bytes,
    moe_block,
    order_bound,
    params,
)
from core.family import Family, Pattern, VerifyHooks, lazy
from profiling.roofline import ELEM_BYTES


def moe_cost(ops: list[dict]) -> tuple[int, int]:
    """(min_bytes, flops) of one fused block from its recorded ops, whatever the experts
    implementation: tokens T, hidden H and experts E from the router's GEMM (x (T, H) by its
    (E, H) weight); each expert's weight elements from the 3-D (E, ., .) tensors the experts
    touch (gate_up and down, transposed or not); top-k from the (T, k) routing tensors. Bytes:
    x and the output once, the router's weight and every expert a call can reach (all of them
    when T k >= E) once; FLOPs: the router's GEMM and three GEMMs per (token, expert) pair."""
    router = next((o for o in ops if o["name"] == "aten::linear"
                   and str(o.get("module_class", "")).endswith("Router")
                   and len(o.get("shapes") or []) >= 2), None)
    if router is None or not router["shapes"][0] or not router["shapes"][1]:
        return 0, 0
    x, w = router["shapes"][0], router["shapes"][1]
    tokens, hidden, experts = (x[0] if len(x) == 2 else x[0] * x[1]), x[-1], w[0]
    es = ELEM_BYTES.get((router.get("dtypes") or ["bfloat16"])[0], 2)
    three_d = {tuple(sorted(s)): s for o in ops for s in (o.get("shapes") or [])
               if s and len(s) == 3 and s[0] == experts}
    per_expert = sum(s[1] * s[2] for s in three_d.values())
    ks = Counter(s[1] for o in ops for s in (o.get("shapes") or [])
                 if s and len(s) == 2 and s[0] == tokens and 1 <= s[1] < experts)
    k = ks.most_common(1)[0][0] if ks else 1
    active = min(experts, tokens * k)
    nbytes = (2 * tokens * hidden + experts * hidden + active * per_expert) * es
    return nbytes, 2 * tokens * hidden * experts + 2 * tokens * k * per_expert


PATTERNS = (
    Pattern(name="moe_experts", family="moe_experts",
            module_class="^(" + "|".join(BLOCKS.values()) + ")$",
            description="MoE block: the router's GEMM, softmax and top-k, the experts' gate/up "
                        "and down GEMMs with the activation, the routing weights and the "
                        "top-k sum (any experts_implementation)",
            ops={}, inner=("softmax",), cost=moe_cost),
)


FAMILY = Family(
    name="moe_experts",
    patterns=PATTERNS,
    reference=moe_block,
    make_inputs=make_inputs,
    make_out=make_out,
    edge_cases=edge_cases,
    min_bytes=min_bytes,
    flops=flops,
    search_space=lazy("codegen.moe_experts.kernel", "search_space"),
    render=lazy("codegen.moe_experts.kernel", "render"),
    patch=patch,
    cases_from_model=cases_from_model,
    aten_ops=("aten::topk", "aten::softmax", "aten::sort", "aten::_grouped_mm", "aten::bmm",
              "aten::silu", "aten::index_add", "aten::histc", "aten::one_hot",
              "aten::linear"),
    params=params,
    # narrow widths, eight tokens: both paths' configs are searched, the last (the grouped
    # path's widest blocks) the fewest programs for the interpreter
    examples=(make_case(8, 32, 16, 4, 2, "float32", "olmoe"),),
    verify=VerifyHooks(
        # stress values in x only: stressed weights would overflow the fp32 accumulators in an
        # order-dependent way (as matmul_epilogue's)
        stress_inputs=(0,),
        order_bound=order_bound,
        # the router's and the experts' weights (and gpt-oss's biases)
        weights=(1, 2, 3, 4, 5, 6),
    ),
    benchmark="codegen.moe_experts.bench",
    # the adapter checks module identities and hooks at call time (`patch._as_patched`),
    # which a trace would freeze
    traceable=False,
)
