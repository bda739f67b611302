"""GEMV family: the projections of a decode step (a few rows times an nn.Linear's weight, the
LM head included) as one Triton kernel that streams the weight once.

Why it exists: a graphed decode step spends most of its time in cuBLAS GEMMs at one row,
well above the time reading their weights takes: the narrow k/v projections read theirs at a
fraction of the memory's bandwidth (benchmarks/probes/README.md, `decode_kernels.py`). The
kernel (kernel.py) splits the weight into enough programs, split-K where n alone gives too
few, to keep the memory busy; the split sum runs as a second kernel or, FUSED, in the split
kernel's last program per column block (one launch, what a graphed batch-1 step counts). Its
search space starts with cuBLAS itself, so a shape where no GEMV config wins (with cold
weights, the wide projections and the LM heads: benchmarks/probes/README.md, `gemv.py`) keeps
cuBLAS's time.

A family of its own rather than configs of `matmul`: that family acts on the widths it pads
and declines the aligned ones, where cuBLAS is near its roofline at prefill; at a few rows it
is not. Which calls are whose is one test (`codegen.matmul.reference.gemv_takes`): at most
MAX_ROWS rows, one token per sequence, an unpadded width. The ranking's `gemv` pattern applies
it to the profiled shapes and matmul's Linear pattern its complement, so a call is never
claimed by both; the patch applies it to each call (patch.py). A prefill of more than one token
per sequence stays `linear` (a 16-token prefill of one sequence is a GEMM's work, not a GEMV's).

Case keys: rows, k, n, dtype, layout ("linear", as the matmul reference takes it), bias, lead
(x's leading shape as the model passes it); edge cases add row_stride and a 2-D x. Params: n,
layout (the matmul family's). Verified with the matmul family's dot-product order bound.

The kernel module is imported lazily: importing it applies `@triton.jit`, which fixes the
interpreter-or-compiled choice (TRITON_INTERPRET) for the process.
"""

from __future__ import annotations

from codegen.gemv.patch import cases_from_model, patch
from codegen.gemv.reference import (
    MAX_ROWS,
    edge_cases,
    flops,
    linear,
    make_case,
    make_inputs,
    make_out,
    min_bytes,
    order_bound,
    params,
)
from codegen.matmul.reference import gemv_call
from codegen.shapes import gemm_k_n
from core.family import Family, Pattern, RankHooks, VerifyHooks, lazy

__all__ = ["FAMILY", "MAX_ROWS", "PATTERNS"]

PATTERNS = (
    Pattern("gemv", "few-row (decode) matmul of an nn.Linear: a GEMV", family="gemv",
            module_class=r"^Linear$", ops={"aten::linear": 1}, accepts=gemv_call),
)


FAMILY = Family(
    name="gemv",
    patterns=PATTERNS,
    reference=linear,
    make_inputs=make_inputs,
    make_out=make_out,
    edge_cases=edge_cases,
    min_bytes=min_bytes,
    flops=flops,
    search_space=lazy("codegen.gemv.kernel", "search_space"),
    # cuBLAS, then the guessed tile (FUSED where k >> n; DOT from 4 rows)
    leads=lambda case: 2,
    render=lazy("codegen.gemv.kernel", "render"),
    patch=patch,
    cases_from_model=cases_from_model,
    aten_ops=("aten::linear", "aten::mm", "aten::addmm", "aten::matmul", "aten::bmm"),
    params=params,
    examples=(make_case(2, 136, 32, "float32", True, (2, 1)),),
    verify=VerifyHooks(
        # the cuBLAS candidate runs aten::mm/addmm by design (kept where no GEMV config beats it)
        library_ops=("aten::mm", "aten::addmm"),
        # only x is stressed: stressed weights too would overflow the fp32 accumulator in an
        # order-dependent way (as the matmul family)
        stress_inputs=(0,),
        weights=(1, 2),  # the module's weight(s) (and bias), after x
        order_bound=order_bound,
    ),
    rank=RankHooks(
        # one pattern over projections of very different sizes, each patched only where a case
        # was accepted: the graph projection matches each occurrence to its case
        occurrence_case=gemm_k_n,
    ),
)
