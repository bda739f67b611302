"""Gated MLP activation family: SwiGLU (Llama/Qwen2/Mistral), GeGLU (Gemma), Phi-3's packed form.

Recognition (what the profile's matcher does with these patterns): the scope is one call of a
module whose class name ends in "MLP". Its Linear children claim their own matmul ops; the ops
of every other child module (the activation module: `SiLUActivation`, `GELUTanh`) belong to the
MLP occurrence. What remains is exactly the activation op plus the multiply. Observed top-level
ops with torch.profiler (CPU, torch 2.13; CUDA, torch 2.11 trace of Llama): LlamaMLP:
aten::silu, aten::mul; GemmaMLP: aten::gelu, aten::mul; Phi3MLP: aten::chunk, aten::silu,
aten::mul, where chunk is a view op (profiling.patterns.VIEW_OPS), so one SwiGLU pattern
covers both layouts and the patch tells them apart by the module's code.

The kernel module is imported lazily: importing it applies `@triton.jit`, which fixes the
interpreter-or-compiled choice (TRITON_INTERPRET) for the process, and the registry must not
make that choice just by discovering the family.
"""

from __future__ import annotations

from codegen.gated_act.patch import cases_from_model, patch
from codegen.gated_act.reference import (
    edge_cases,
    flops,
    gated_act,
    make_case,
    make_inputs,
    make_out,
    min_bytes,
    params,
)
from core.family import CudaVariant, Family, Pattern, RankHooks, VerifyHooks, lazy
from profiling.roofline import streaming_cost

PATTERNS = (
    Pattern(name="swiglu_mlp", family="gated_act", module_class=r"MLP$",
            description="SwiGLU MLP: silu(gate) * up, gate and up from gate_proj/up_proj "
                        "(Llama, Qwen2, Mistral) or from chunk(2) of gate_up_proj (Phi-3); "
                        "the silu runs inside the act_fn child (SiLUActivation)",
            ops={"aten::silu": 1, "aten::mul": 1},
            cost=streaming_cost(3, "aten::mul")),  # read gate and up, write the product
    Pattern(name="geglu_mlp", family="gated_act", module_class=r"MLP$",
            description="GeGLU MLP (Gemma): gelu_tanh(gate_proj(x)) * up_proj(x); the gelu "
                        "runs inside the act_fn child (GELUTanh)",
            ops={"aten::gelu": 1, "aten::mul": 1},
            cost=streaming_cost(3, "aten::mul")),
)


def baseline_case(case: dict) -> dict:
    """The unpatched MLP multiplies two contiguous tensors where the adapter hands the kernel
    the column halves of one fused GEMM's output (`GateUp`): HF's activation on those strided
    halves ran slower than on what the model runs, and overstated gated_act's saving against
    matmul_epilogue's (Llama-3.2-1B b8: 257 us per call claimed against 130)."""
    if case.get("operands") != "halves":
        return case
    return {**{k: v for k, v in case.items() if k != "row_stride"}, "operands": "separate"}


FAMILY = Family(
    name="gated_act",
    patterns=PATTERNS,
    reference=gated_act,
    make_inputs=make_inputs,
    make_out=make_out,
    edge_cases=edge_cases,
    min_bytes=min_bytes,
    flops=flops,
    search_space=lazy("codegen.gated_act.kernel", "search_space"),
    render=lazy("codegen.gated_act.kernel", "render"),
    patch=patch,
    cases_from_model=cases_from_model,
    aten_ops=("aten::silu", "aten::gelu", "aten::mul"),
    params=params,
    examples=(make_case(16, 176, "float16", "silu", "packed"),
              make_case(16, 176, "float16", "gelu_tanh", "separate"),),
    cuda=CudaVariant(search_space=lazy("codegen.gated_act.cuda", "search_space"),
                     render=lazy("codegen.gated_act.cuda", "render")),
    benchmark="codegen.gated_act.bench",
    verify=VerifyHooks(
        baseline_case=baseline_case,
    ),
    rank=RankHooks(
        rivals=("matmul_epilogue",),
    ),
    # the fused [gate; up] weight is checked by its Parameters' addresses: a trace has none
    traceable=False,
)
