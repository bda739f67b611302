"""RMSNorm into the gated MLP's gate/up GEMV: a decoder layer's post_attention_layernorm (and
the residual add before it) and its MLP's gate and up projections with the activation and
multiply, at a decode step, as one Triton launch (kernel.py), where the shipped set runs two
(add_rmsnorm's kernel, then matmul_epilogue's gate/up GEMV).

Why it exists (issue 61, "O-projection with the residual add and the next RMSNorm, gate/up
GEMV with SiLU-and-multiply"): a graphed batch-1 decode step is bound by its kernel count
(benchmarks/results/decode-1207-h100/decode-step-llama-3.2-1b.md: 197 kernels, 132 of them
reading no weight). Each program of the GEMV forms the residual stream's row and normalises it
itself, and program 0 writes the row (total) and the norm's output (normed), so the layer's
residual add into down_proj (add_rmsnorm's residual_gemm) goes on as before: the layer's
forward is add_rmsnorm's, with this kernel in place of the add + norm kernel (patch.py).

Recognition: the `norm_gate_up` occurrence is matmul_epilogue's (a gated MLP's gate and up
Linears) plus the layer's post_attention_layernorm's rmsnorm occurrence, at most MAX_ROWS
rows; an option beside matmul_epilogue's row. add_rmsnorm is its rival (both replace the
layer's add + norm: add_rmsnorm ships where this one does not, a prefill); it composes with
matmul_epilogue (on the MLP), gemv, rmsnorm and norm_qkv.

Cases: rows, hidden, cols, dtype, act, residual (whether the add comes first: the patch
always adds; without it the kernel is a norm + gate/up for a layer whose add is elsewhere),
and the norm's form (eps, offset, cast_first); params eps, offset, cast_first, act.
"""

from __future__ import annotations

import math

from codegen.norm_gate_up.patch import cases_from_model, patch
from codegen.norm_gate_up.reference import (
    MAX_ROWS,
    edge_cases,
    flops,
    make_case,
    make_inputs,
    make_out,
    min_bytes,
    norm_gate_up,
    order_bound,
    params,
)
from core.family import Family, Pattern, RankHooks, VerifyHooks, lazy
from profiling.roofline import MATMUL_OPS, input_bytes, op_cost

__all__ = ["FAMILY", "MAX_ROWS", "PATTERNS"]


def _x_dims(ops: list[dict]) -> list[int] | None:
    lin = next((o for o in ops if o["name"] == "aten::linear"), None)
    shapes = (lin or {}).get("shapes") or []
    return shapes[0] if shapes and isinstance(shapes[0], list) and shapes[0] else None


def few_rows(ops: list[dict]) -> bool:
    """Two linears on a decode step's x: at most MAX_ROWS rows, one token per sequence."""
    dims = _x_dims(ops)
    if dims is None or sum(o["name"] == "aten::linear" for o in ops) != 2:
        return False
    lead = [int(d) for d in dims[:-1]]
    return math.prod(lead) <= MAX_ROWS and (len(lead) < 2 or lead[-1] == 1)


def norm_gated_cost(ops: list[dict]) -> tuple[int, int]:
    """(min_bytes, flops): the two linears' bytes with x counted once, plus the norm's weight
    read and normed written; the GEMMs' and the norm's FLOPs (an upper bound on the bytes:
    gate's and up's outputs are counted where only h is written)."""
    linears = [o for o in ops if o["name"] in MATMUL_OPS]
    if not linears:
        return 0, 0
    costs = [op_cost(o) for o in linears]
    x_bytes = input_bytes(linears[0], 0)
    dims = _x_dims(linears) or [1]
    rows = max(1, math.prod(int(d) for d in dims[:-1]))
    nbytes = sum(b for b, _ in costs) - x_bytes * (len(linears) - 1)
    return nbytes + x_bytes + x_bytes // rows, sum(f for _, f in costs) + 4 * rows * int(dims[-1])


PATTERNS = (
    Pattern(name="norm_gate_up", family="norm_gate_up",
            description="a decoder layer's post_attention_layernorm and its gated MLP's gate "
                        "and up projections with the activation at a decode step, one launch",
            extends="swiglu_mlp",
            absorbs=("gate_proj", "up_proj", "../post_attention_layernorm"),
            cost=norm_gated_cost, accepts=few_rows),
)


FAMILY = Family(
    name="norm_gate_up",
    patterns=PATTERNS,
    reference=norm_gate_up,
    make_inputs=make_inputs,
    make_out=make_out,
    edge_cases=edge_cases,
    min_bytes=min_bytes,
    flops=flops,
    search_space=lazy("codegen.norm_gate_up.kernel", "search_space"),
    leads=lambda case: 1,  # the guessed tile (DOT from 4 rows)
    render=lazy("codegen.norm_gate_up.kernel", "render"),
    patch=patch,
    cases_from_model=cases_from_model,
    aten_ops=("aten::linear", "aten::mm", "aten::matmul", "aten::pow", "aten::mean",
              "aten::rsqrt", "aten::mul", "aten::add", "aten::silu"),
    params=params,
    examples=(make_case(2, 64, 96, "float32", "silu"),),
    verify=VerifyHooks(
        # x only, as matmul_epilogue's: stressed weights would overflow the fp32 accumulators
        # in an order-dependent way
        stress_inputs=(0,),
        weights=(1, 2, 3),  # the norm's weight, w_gate, w_up
        order_bound=order_bound,
    ),
    # both replace the layer's residual add + post-attention norm: one of the two per run
    rank=RankHooks(rivals=("add_rmsnorm",)),
    # the MLP's forward takes what the norm's launch kept by the normed tensor's identity and
    # version, which a trace does not know
    traceable=False,
)
