"""Matmul with a fused epilogue: a gated MLP's gate and up projections, its activation and the
multiply as one Triton kernel, `act(x @ Wg^T) * (x @ Wu^T)`; down_proj stays HF's Linear.

Why it exists: gated_act fuses the activation and the multiply, but still reads back the two
(tokens, intermediate) tensors the gate and up GEMMs wrote. A dual GEMM that keeps both fp32
accumulators on chip and applies the activation in its epilogue never writes them: per MLP it
saves 2 x tokens x intermediate of writes and as much of reads, and two launches. Whether that
pays depends on how close a Triton GEMM comes to cuBLAS: with pointer loads the best tile was
1-6 % slower than cuBLAS's projections plus gated_act's kernel (H200, bf16 prefill); with TMA
loads and one program per SM it is 7-10 % faster (benchmarks/probes/README.md,
`epilogue_probe.py`). A third kernel ("WIDE" configs)
reads both weights through one descriptor and issues one dot per K step into a (BM, 2 BN)
accumulator, as cuBLAS's widest tiles do (kernel.py says why). The search and the integrate
stage still decide per workload, by measurement.

An ALTERNATIVE to gated_act, not a rival claimant: both replace the same silu/gelu and mul, so
the profile's matcher never claims with these patterns. Each extends gated_act's pattern
(`Pattern.extends`): the rank stage builds one occurrence from each swiglu_mlp / geglu_mlp
occurrence plus the `linear` occurrences of the absorbed child Linears (`Pattern.absorbs`:
gate_proj and up_proj, or Phi-3's packed gate_up_proj) and ranks the row beside gated_act's.
At most one of the two families is integrated into a model; pipeline/ chooses
(`RankHooks.rivals`, declared on both), this folder only declares the rivalry.

Recognition is by module class (ends in "MLP") and the activation op, like gated_act's; the
patch (patch.py) then checks the module's code and its projections, as gated_act's does.

The kernel module is imported lazily: importing it applies `@triton.jit`, which fixes the
interpreter-or-compiled choice (TRITON_INTERPRET) for the process, and the registry must not
make that choice just by discovering the family.
"""

from __future__ import annotations

from codegen.matmul.reference import GEMV_MAX_ROWS
from codegen.matmul_epilogue.patch import cases_from_model, patch
from codegen.matmul_epilogue.reference import (
    edge_cases,
    flops,
    gated_gemm,
    make_case,
    make_inputs,
    make_out,
    min_bytes,
    order_bound,
    params,
)
from core.family import Family, Pattern, RankHooks, VerifyHooks, lazy
from profiling.roofline import MATMUL_OPS, input_bytes, op_cost


def gated_gemm_cost(ops: list[dict]) -> tuple[int, int]:
    """(min_bytes, flops) of one fused occurrence from its recorded ops: the absorbed linears
    (gate and up, or Phi-3's gate_up), the activation and the multiply. FLOPs are the linears'
    own (the epilogue's are noise beside them); bytes are x read once, every absorbed weight
    read once, and the product written once (sized by the multiply's operand)."""
    linears = [o for o in ops if o["name"] in MATMUL_OPS]
    flops_ = sum(op_cost(o)[1] for o in linears)
    x = input_bytes(linears[0], 0) if linears else 0
    weights = sum(input_bytes(o, 1) for o in linears)
    product = max((input_bytes(o, i) for o in ops if o["name"] == "aten::mul" for i in (0, 1)),
                  default=0)
    return x + weights + product, flops_


PATTERNS = (
    Pattern(name="gated_mlp_gemm", family="matmul_epilogue", module_class=r"MLP$",
            description="SwiGLU MLP's gate_proj and up_proj GEMMs with silu(gate) * up in the "
                        "epilogue (Llama, Qwen2, Mistral): gated_act's swiglu_mlp occurrence "
                        "plus the two projections' linear occurrences",
            ops={"aten::silu": 1, "aten::mul": 1},
            extends="swiglu_mlp", absorbs=("gate_proj", "up_proj"), cost=gated_gemm_cost),
    Pattern(name="gated_mlp_gemm", family="matmul_epilogue", module_class=r"MLP$",
            description="GeGLU MLP's gate_proj and up_proj GEMMs with gelu_tanh(gate) * up in "
                        "the epilogue (Gemma)",
            ops={"aten::gelu": 1, "aten::mul": 1},
            extends="geglu_mlp", absorbs=("gate_proj", "up_proj"), cost=gated_gemm_cost),
    Pattern(name="gated_mlp_gemm", family="matmul_epilogue", module_class=r"MLP$",
            description="Phi-3's packed gate_up_proj GEMM with silu(gate) * up in the epilogue "
                        "(the two row halves of its weight as the gate and up weights)",
            ops={"aten::silu": 1, "aten::mul": 1},
            extends="swiglu_mlp", absorbs=("gate_up_proj",), cost=gated_gemm_cost),
)


FAMILY = Family(
    name="matmul_epilogue",
    patterns=PATTERNS,
    reference=gated_gemm,
    make_inputs=make_inputs,
    make_out=make_out,
    edge_cases=edge_cases,
    min_bytes=min_bytes,
    flops=flops,
    search_space=lazy("codegen.matmul_epilogue.kernel", "search_space"),
    # at a decode step's rows the GEMV kernel's guessed tile leads the space
    leads=lambda case: 1 if case["rows"] <= GEMV_MAX_ROWS else 0,
    render=lazy("codegen.matmul_epilogue.kernel", "render"),
    patch=patch,
    cases_from_model=cases_from_model,
    aten_ops=("aten::linear", "aten::mm", "aten::addmm", "aten::matmul", "aten::silu",
              "aten::gelu", "aten::mul"),
    params=params,
    examples=(make_case(16, 64, 176, "float16", "silu"),
              make_case(1, 96, 176, "float32", "silu", lead=(1, 1)),
              make_case(16, 64, 176, "float32", "gelu_tanh"),
              make_case(37, 96, 176, "float32", "silu"),),
    benchmark="codegen.matmul_epilogue.bench",
    verify=VerifyHooks(
        # Only x gets the verifier's stress values: stressed weights too would overflow the fp32
        # accumulators (products of two values near the dtype's max) in an order-dependent way,
        # inf or NaN depending on which partial sums meet first.
        stress_inputs=(0,),
        weights=(1, 2),  # the module's weight(s) (and bias), after x
        # where a dot product cancels, the summation order decides which of HF's result and ours
        # lands closer: the verifier allows either within the classic bound
        order_bound=order_bound,
    ),
    rank=RankHooks(
        # replaces the ops gated_act replaces: one of the two is integrated. Not gemv's rival: at
        # a decode step its GEMV (gemv.py) computes gate and up itself and skips the two Linears'
        # gemv kernels (`models.patching.SAME_RESULT`), and gemv keeps every other projection, so
        # the two compose; the ranking counts the gate and up calls in both rows, and the
        # whole-model measurement of the set decides
        rivals=("gated_act",),
    ),
)
