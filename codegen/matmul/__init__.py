"""Matmul family: the projections of a model (nn.Linear, GPT-2's Conv1D, the LM head) where they
run under the roofline, dispatched per profiled shape.

Why it exists: on GPT-2 (124M) prefill b8 s1024 on the H200 the ranking put `linear` at 55 %
of the pass with an attainable 3.0x and nothing acted on it, while torch.compile ran the pass
2.34x faster than eager (FACTS.md). Most of that gap is the LM head: vocab 50257 leaves the
logits' leading dimension misaligned, and cuBLAS ran it about 8x under the measured peak.
The candidates (kernel.py): cuBLAS on a weight padded to an aligned width once at patch time
(patch.py; the caller sees the same shape and values), and a Triton GEMM searched per shape
with the bias in its epilogue (masked stores: any output strides). Verified with the
dot-product order bound, as matmul_epilogue.

Verified on the layouts the adapter passes (issue 27, class 5): x (batch, seq, k) as the model
hands it (the case's `lead`), and `out` the adapter's (batch, seq, n_pad) buffer. The contract
on that buffer: the first n columns are the result and must all be written (`out_region`: the
verifier compares them and poisons them); the pad columns n..n_pad are the candidate's scratch,
allowed but not required, written with anything or left alone, since the caller slices them
away unread (the cuBLAS candidate writes its N_COMPUTE columns there, the Triton one none).
Writes past the buffer are caught by the guard bytes as for any family.

Where GEMMs already run near their roofline (Llama, Qwen: every width a multiple of 64, cuBLAS
near the peak) there is nothing to win and a measurement per shape would only cost time, so
the family declines rows whose attainable speedup is under MIN_ATTAINABLE (`RankHooks.declines`);
the ranking then shows the row without a family and says why. Within a row it acts on, only
the projections whose output width needs padding get cases and a patch (patch.projections):
at aligned widths cuBLAS is the thing to beat and these candidates do not.

Recognition: the two `linear` patterns moved here from profiling/patterns.py (a Linear or
Conv1D module running aten::linear; a Conv1D running aten::addmm), the first leaving a decode
step's few-row calls at unpadded widths to codegen.gemv's `gemv` pattern (reference.gemv_takes:
a GEMV's work, where this family's candidates do not act). matmul_epilogue's patterns absorb a
gated MLP's gate and up `linear` occurrences; the rank stage marks its row an alternative to
this one's for that reason (both replace those GEMMs).

GPT-2's c_fc + gelu_new in one epilogue is codegen.matmul_gelu (a family of its own: it is
gelu's rival, and this family must not be). Not here (yet): the other weight layout as a
cuBLAS candidate (kernel.py says why), and TMA loads.
"""

from __future__ import annotations

from codegen.matmul.patch import cases_from_model, patch
from codegen.matmul.reference import (
    edge_cases,
    flops,
    gemv_call,
    linear,
    make_case,
    make_inputs,
    make_out,
    min_bytes,
    order_bound,
    out_region,
    params,
)
from codegen.shapes import gemm_k_n
from core.family import Family, Pattern, RankHooks, VerifyHooks, lazy

# Under this attainable speedup (the ranking's roofline or measured time) a projection row is
# left alone: what a padded or re-tiled GEMM could still win there is within what measurement
# resolves, and every shape searched costs minutes.
MIN_ATTAINABLE = 1.2


def declines(row: dict) -> str | None:
    speedup = row["attainable_speedup"]
    if speedup < MIN_ATTAINABLE:
        return (f"near the roofline already: attainable {speedup:.2f}x, under the "
                f"{MIN_ATTAINABLE:.1f}x this family acts on")
    return None


def not_gemv_call(ops: list[dict]) -> bool:
    return not gemv_call(ops)


# A few-row Linear call at an unpadded width is the gemv family's `gemv` pattern (gemv_call):
# the complement here, so one call is never claimed by both, whichever pattern tries first.
PATTERNS = (
    Pattern("linear", "matmul of an nn.Linear (bias included)", family="matmul",
            module_class=r"^(Linear|Conv1D)$", ops={"aten::linear": 1},
            accepts=not_gemv_call),
    Pattern("linear", "matmul of a GPT-2 Conv1D", family="matmul", module_class=r"^Conv1D$",
            ops={"aten::addmm": 1}),
)


FAMILY = Family(
    name="matmul",
    patterns=PATTERNS,
    reference=linear,
    make_inputs=make_inputs,
    make_out=make_out,
    edge_cases=edge_cases,
    min_bytes=min_bytes,
    flops=flops,
    search_space=lazy("codegen.matmul.kernel", "search_space"),
    render=lazy("codegen.matmul.kernel", "render"),
    patch=patch,
    cases_from_model=cases_from_model,
    params=params,
    examples=(make_case(16, 64, 500, "float32", "linear", False, lead=(2, 8)),
              make_case(16, 64, 500, "bfloat16", "linear", False, lead=(2, 8)),),
    verify=VerifyHooks(
        out_region=out_region,
        # the cuBLAS candidates run aten::mm/addmm on the padded weight by design
        library_ops=("aten::mm", "aten::addmm"),
        # only x is stressed: stressed weights too would overflow the fp32 accumulator in an
        # order-dependent way (as matmul_epilogue)
        stress_inputs=(0,),
        weights=(1, 2),  # the module's weight(s) (and bias), after x
        order_bound=order_bound,
    ),
    rank=RankHooks(
        # one pattern over projections of very different sizes, each patched only where a case
        # was accepted: the graph projection matches each occurrence to its case
        occurrence_case=gemm_k_n,
        declines=declines,
    ),
    # a padded copy of the weight, kept right by checking its Parameter's address and
    # version on every call: a trace reads neither
    traceable=False,
)
