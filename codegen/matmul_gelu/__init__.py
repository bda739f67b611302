"""Matmul with a GELU epilogue: GPT-2's c_fc GEMM, its bias and its tanh-GELU as one Triton
kernel, `gelu_tanh(x @ W + b)`; c_proj stays HF's Conv1D.

Why it exists: on GPT-2 prefill the gelu family fuses the activation's eight elementwise ops
into one kernel, but that kernel still reads back the (tokens, 3072) pre-activation the c_fc
GEMM wrote and writes it again: at b8 s1024 bf16, 2 x 50 MB per MLP beside a 0.1 ms GEMM,
and one launch. Here the activation happens on the accumulator, so neither the write nor the
read nor the launch remains. The search and the integrate stage decide by measurement
whether a Triton GEMM close enough to cuBLAS makes that pay.

Why a family of its own rather than a capability of matmul or matmul_epilogue: the policy
integrates one family of each rival pair (`RankHooks.rivals`), and this kernel replaces the
activation that the gelu family replaces. Inside matmul, rivalry with gelu would put the
whole matmul family (the padded LM head: most of its gain) against gelu on GPT-2; inside
matmul_epilogue, every function of that family (reference, inputs, order bound, patch) would
have to switch between the gated (x, w_gate, w_up) and the biased (x, w, b) signatures.
The kernel reuses matmul_epilogue's tile order (`_tile`).

An ALTERNATIVE to the gelu_new row, as matmul_epilogue's is to gated_act's: its pattern
extends the gelu family's (one occurrence per NewGELUActivation call) and absorbs the
sibling c_fc's `linear` occurrence (`absorbs=("../c_fc",)`: a child of the activation's
parent), so the rank stage shows it beneath gelu_new and never replaces the two together.
GELUTanh (gelu_pytorch_tanh) MLPs are patched too, but no profiled row extends them yet
(no family owns a lone aten::gelu).
"""

from __future__ import annotations

from codegen.gelu import PATTERNS as GELU_PATTERNS
from codegen.matmul_gelu.patch import cases_from_model, patch
from codegen.matmul_gelu.reference import (
    conv1d_gelu,
    edge_cases,
    flops,
    make_case,
    make_inputs,
    make_out,
    min_bytes,
    order_bound,
    params,
)
from core.family import Family, Pattern, RankHooks, VerifyHooks, lazy
from profiling.roofline import MATMUL_OPS, input_bytes, op_cost


def gemm_gelu_cost(ops: list[dict]) -> tuple[int, int]:
    """(min_bytes, flops) of one fused occurrence: the absorbed c_fc's FLOPs; bytes are its x,
    weight and bias read once and the activation written once (the size of c_fc's output,
    which the activation's first op reads)."""
    linears = [o for o in ops if o["name"] in MATMUL_OPS]
    flops_ = sum(op_cost(o)[1] for o in linears)
    reads = sum(input_bytes(o, i) for o in linears for i in range(3))
    act_in = max((input_bytes(o, 0) for o in ops if o["name"] not in MATMUL_OPS), default=0)
    return reads + act_in, flops_


(_GELU_NEW,) = (p for p in GELU_PATTERNS if p.name == "gelu_new")

PATTERNS = (
    Pattern(name="mlp_gemm_gelu", family="matmul_gelu", module_class=_GELU_NEW.module_class,
            description="GPT-2's c_fc GEMM with bias and gelu_new in the epilogue: gelu's "
                        "gelu_new occurrence plus the sibling c_fc's linear occurrence",
            ops=dict(_GELU_NEW.ops), extra_ok=_GELU_NEW.extra_ok,
            extends="gelu_new", absorbs=("../c_fc",), cost=gemm_gelu_cost),
)


FAMILY = Family(
    name="matmul_gelu",
    patterns=PATTERNS,
    reference=conv1d_gelu,
    make_inputs=make_inputs,
    make_out=make_out,
    edge_cases=edge_cases,
    min_bytes=min_bytes,
    flops=flops,
    search_space=lazy("codegen.matmul_gelu.kernel", "search_space"),
    render=lazy("codegen.matmul_gelu.kernel", "render"),
    patch=patch,
    cases_from_model=cases_from_model,
    aten_ops=("aten::linear", "aten::mm", "aten::addmm", "aten::matmul", "aten::gelu",
              "aten::tanh", "aten::pow", "aten::mul", "aten::add"),
    params=params,
    examples=(make_case(16, 64, 176, "float32", "gelu_new"),),
    verify=VerifyHooks(
        # only x is stressed: stressed weights too would overflow the fp32 accumulator in an
        # order-dependent way (as matmul_epilogue)
        stress_inputs=(0,),
        weights=(1, 2),  # the module's weight(s) (and bias), after x
        order_bound=order_bound,
    ),
    rank=RankHooks(
        # replaces the activation the gelu family replaces: one of the two is integrated
        rivals=("gelu",),
    ),
)
