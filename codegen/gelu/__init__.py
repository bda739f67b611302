"""GELU family: GPT-2's gelu_new (NewGELUActivation) as one fused elementwise kernel.

Recognition: the scope is one call of a `NewGELUActivation` module; it holds no inner module,
so all of its aten ops belong to the occurrence. Observed with torch.profiler (CPU, torch 2.13,
fp32 and bf16), outermost ops: aten::mul, aten::pow, aten::mul, aten::add, aten::mul,
aten::tanh, aten::add, aten::mul. The scalar operands add nested aten::to -> aten::_to_copy ->
aten::empty_strided + aten::copy_ and aten::result_type under mul/pow; they are `extra_ok`.

Gemma's `GELUTanh` (aten::gelu) is deliberately not a pattern here: it sits inside the gated
MLP, whose pattern claims it together with the multiply.

The kernel module is imported lazily: importing it applies `@triton.jit`, which fixes the
interpreter-or-compiled choice (TRITON_INTERPRET) for the process.
"""

from __future__ import annotations

from codegen.gelu.patch import cases_from_model, patch
from codegen.gelu.reference import (
    edge_cases,
    flops,
    make_case,
    make_inputs,
    make_out,
    min_bytes,
    new_gelu,
    params,
)
from core.family import Family, Pattern, RankHooks, lazy
from profiling.roofline import streaming_cost

PATTERNS = (
    Pattern(name="gelu_new", family="gelu", module_class=r"^NewGELUActivation$",
            description="GPT-2 gelu_new: 0.5*x*(1+tanh(sqrt(2/pi)*(x+0.044715*x^3))) as "
                        "eight elementwise ops",
            ops={"aten::pow": 1, "aten::mul": 4, "aten::add": 2, "aten::tanh": 1},
            extra_ok=("aten::to", "aten::_to_copy", "aten::empty_strided", "aten::copy_",
                      "aten::result_type"),
            cost=streaming_cost(2)),
)


FAMILY = Family(
    name="gelu",
    patterns=PATTERNS,
    reference=new_gelu,
    make_inputs=make_inputs,
    make_out=make_out,
    edge_cases=edge_cases,
    min_bytes=min_bytes,
    flops=flops,
    search_space=lazy("codegen.gelu.kernel", "search_space"),
    render=lazy("codegen.gelu.kernel", "render"),
    patch=patch,
    cases_from_model=cases_from_model,
    aten_ops=("aten::pow", "aten::mul", "aten::add", "aten::tanh"),
    params=params,
    examples=(make_case(16, 176, "float16"),),
    rank=RankHooks(
        # matmul_gelu computes the activation in c_fc's epilogue: one of the two is integrated
        rivals=("matmul_gelu",),
    ),
)
