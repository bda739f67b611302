"""RMSNorm into the grouped q/k/v projection: a pre-norm decoder layer's input_layernorm and
its attention's q_proj, k_proj and v_proj at a decode step as one Triton launch (kernel.py),
where the shipped set runs two (the rmsnorm family's kernel, then qkv_proj's).

Why it exists (issue 61, "RMSNorm into the QKV projection's prologue"): a graphed batch-1
decode step is bound by its kernel count (benchmarks/results/decode-1207-h100/
decode-step-llama-3.2-1b.md: 197 kernels, 132 of them reading no weight), and the norm is one
of those per layer. Each program of the projection normalises the row itself (a first pass
over x from L2), so nothing waits on a norm's output, and program 0 writes that output too:
the tensor the layer hands the attention is filled, whatever reads it.

Recognition: the `norm_qkv` occurrence is qkv_proj's (the three projections' own gemv
occurrences inside one attention, located by its decode_attention occurrence) plus the
sibling input_layernorm's rmsnorm occurrence; an option of those rows, as qkv_proj is of
gemv's. It is qkv_proj's rival (both launch the three projections; the one that saves more
per call is kept) and composes with gemv, rmsnorm and add_rmsnorm (patch.py).

Cases: qkv_proj's (rows, k, nq, nk, nv, dtype, bias, lead) at most MAX_ROWS rows, with the
norm's form (eps, offset, cast_first); params eps, offset, cast_first.
"""

from __future__ import annotations

import math

from codegen.norm_qkv.patch import cases_from_model, patch
from codegen.norm_qkv.reference import (
    MAX_ROWS,
    edge_cases,
    flops,
    make_case,
    make_inputs,
    make_out,
    min_bytes,
    norm_qkv,
    order_bound,
    params,
)
from codegen.qkv_proj import decode_gemvs, grouped_cost
from core.family import Family, Pattern, RankHooks, VerifyHooks, lazy
from profiling.roofline import MATMUL_OPS, input_bytes

__all__ = ["FAMILY", "MAX_ROWS", "PATTERNS"]


def norm_grouped_cost(ops: list[dict]) -> tuple[int, int]:
    """(min_bytes, flops) of one occurrence: the grouped projections' (x read once, every
    weight once, every output once), plus normed written once and the norm's weight read (a
    row's width; the norm's input is the projections' x, read once)."""
    linears = [o for o in ops if o["name"] in MATMUL_OPS]
    nbytes, nflops = grouped_cost(linears)
    if not linears:
        return nbytes, nflops
    x_bytes = input_bytes(linears[0], 0)
    dims = linears[0]["shapes"][0]
    rows = max(1, math.prod(int(d) for d in dims[:-1]))
    return nbytes + x_bytes + x_bytes // rows, nflops + 4 * rows * int(dims[-1])


def few_rows(ops: list[dict]) -> bool:
    """decode_gemvs, and at most MAX_ROWS rows: more go to the unfused norm and GEMVs."""
    if not decode_gemvs(ops):
        return False
    lin = next(o for o in ops if o["name"] == "aten::linear")
    return math.prod(int(d) for d in lin["shapes"][0][:-1]) <= MAX_ROWS


PATTERNS = (
    Pattern(name="norm_qkv", family="norm_qkv", function=r"^sdpa_attention_forward$",
            description="a decoder layer's input_layernorm and its attention's q_proj, k_proj "
                        "and v_proj at a decode step as one launch",
            extends="decode_attention",
            absorbs=("q_proj", "k_proj", "v_proj", "../input_layernorm"),
            absorbs_only=True, cost=norm_grouped_cost, accepts=few_rows),
)


FAMILY = Family(
    name="norm_qkv",
    patterns=PATTERNS,
    reference=norm_qkv,
    make_inputs=make_inputs,
    make_out=make_out,
    edge_cases=edge_cases,
    min_bytes=min_bytes,
    flops=flops,
    search_space=lazy("codegen.norm_qkv.kernel", "search_space"),
    leads=lambda case: 1,  # the guessed tile (DOT from 4 rows)
    render=lazy("codegen.norm_qkv.kernel", "render"),
    patch=patch,
    cases_from_model=cases_from_model,
    aten_ops=("aten::linear", "aten::mm", "aten::addmm", "aten::matmul", "aten::pow",
              "aten::mean", "aten::rsqrt", "aten::mul"),
    params=params,
    examples=(make_case(2, 64, 64, 64, 64, "float32", True, (2, 1)),),
    verify=VerifyHooks(
        # only x is stressed, as qkv_proj's: stressed weights would overflow the fp32
        # accumulator in an order-dependent way
        stress_inputs=(0,),
        weights=(1, 2, 3, 4, 5, 6, 7),  # the norm's weight, the three weights and biases
        order_bound=order_bound,
    ),
    # qkv_proj launches the same three projections (from the norm's output): one of the two
    rank=RankHooks(rivals=("qkv_proj",)),
    # the projections take what the norm's launch kept by the normed tensor's identity and
    # version, which a trace does not know
    traceable=False,
)
