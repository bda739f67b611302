"""Grouped q/k/v projection family: an attention's three projections at a decode step as one
Triton launch that streams all three weights (kernel.py), where HF runs three cuBLAS GEMMs.

Why it exists (issue 25, "fewer kernels per step where the count decides"): once a decode step
is one CUDA graph its projections set the pace. Llama-3.2-1B b1 KV 1024 graphed with the
shipped set takes 1.46 ms against a weight-read floor near 0.59 ms; the verified kernel times
put q, k and v at 9.5, 7.9 and 7.9 us per layer (12.6 MB of weight at about 0.5 TB/s), where
one launch over the same bytes can stream at the rate the gate/up GEMV reaches (33.5 MB in
17 us). Grouping also takes two graph nodes per layer away. Whether it pays is the
measurement's to say: `benchmarks/probes/qkv_grouping.py` asks the same of a cuBLAS GEMM over
concatenated weights, and the pipeline's kernel timing and whole-model rules decide per workload.

Recognition: the `qkv_proj` occurrence is the three projections' own `gemv` occurrences
inside one attention scope (located by its decode_attention occurrence, which it does not
replace: `Pattern.absorbs_only`); it is an option of the `gemv` row, whose family patches the
same Linears one by one; the two compose (patch.py), so both may be integrated.

Cases: rows, k, nq, nk, nv, dtype, bias, lead (reference.py); no params.
"""

from __future__ import annotations

from codegen.matmul.reference import gemv_call
from codegen.qkv_proj.patch import cases_from_model, patch
from codegen.qkv_proj.reference import (
    MAX_ROWS,
    edge_cases,
    flops,
    make_case,
    make_inputs,
    make_out,
    min_bytes,
    order_bound,
    params,
    qkv,
)
from core.family import Family, Pattern, VerifyHooks, lazy
from profiling.roofline import MATMUL_OPS, input_bytes, op_cost

__all__ = ["FAMILY", "MAX_ROWS", "PATTERNS"]


def grouped_cost(ops: list[dict]) -> tuple[int, int]:
    """(min_bytes, flops) of one grouped occurrence from its recorded linears: x read once, every
    weight once, every output written once; FLOPs the three GEMMs'."""
    linears = [o for o in ops if o["name"] in MATMUL_OPS]
    costs = [op_cost(o) for o in linears]
    x = input_bytes(linears[0], 0) if linears else 0
    # op_cost reads each linear's x again: count it once
    return sum(b for b, _ in costs) - x * max(0, len(linears) - 1), sum(f for _, f in costs)


def decode_gemvs(ops: list[dict]) -> bool:
    """Each of the three linears is a decode step's GEMV at a width no family pads (gemv_call):
    the calls the patch takes."""
    linears = [o for o in ops if o["name"] == "aten::linear"]
    return len(linears) == 3 and all(gemv_call([o]) for o in linears)


PATTERNS = (
    Pattern(name="qkv_proj", family="qkv_proj", function=r"^sdpa_attention_forward$",
            description="an attention's q_proj, k_proj and v_proj at a decode step as one "
                        "launch (the three Linears' gemv occurrences)",
            extends="decode_attention", absorbs=("q_proj", "k_proj", "v_proj"),
            absorbs_only=True, cost=grouped_cost, accepts=decode_gemvs),
)


FAMILY = Family(
    name="qkv_proj",
    patterns=PATTERNS,
    reference=qkv,
    make_inputs=make_inputs,
    make_out=make_out,
    edge_cases=edge_cases,
    min_bytes=min_bytes,
    flops=flops,
    search_space=lazy("codegen.qkv_proj.kernel", "search_space"),
    leads=lambda case: 1,  # the guessed tile (DOT from 4 rows)
    render=lazy("codegen.qkv_proj.kernel", "render"),
    patch=patch,
    cases_from_model=cases_from_model,
    aten_ops=("aten::linear", "aten::mm", "aten::addmm", "aten::matmul"),
    params=params,
    examples=(make_case(2, 64, 64, 64, 64, "float32", True, (2, 1)),),
    verify=VerifyHooks(
        # only x is stressed: stressed weights too would overflow the fp32 accumulator in an
        # order-dependent way (as the matmul and gemv families)
        stress_inputs=(0,),
        weights=(1, 2, 3, 4, 5, 6),  # the three weights (and biases), after x
        order_bound=order_bound,
    ),
    # not gemv's rival though both patch the three Linears at a decode step: they compose in
    # either patch order (models.patching.FUSED), gemv keeping every other projection
    # k_proj's and v_proj's calls take what q_proj's kept by the input's version, a number
    # a trace does not know
    traceable=False,
)
