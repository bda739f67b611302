"""Cross-entropy family: logits to (mean, per-row) loss without materialising log-probabilities.

Recognition: the scope is one call of the Python function `cross_entropy`
(torch.nn.functional's frame; HF's ForCausalLMLoss calls it on `logits.float()`). Observed
top-level op with torch.profiler (CPU, torch 2.13): aten::cross_entropy_loss, with
aten::log_softmax (-> aten::to, aten::_log_softmax) and aten::nll_loss_nd (-> aten::nll_loss
-> aten::nll_loss_forward) nested under it.

Patch: a documented no-op. The profiled forward is `model(input_ids)` without labels, so it
computes no loss; there is nothing in it to replace, `cases_from_model` returns no cases and
`patch` returns an undo that does nothing. The kernel serves loss computation outside the
measured pass (training, evaluation) and is verified like every other family.

The kernel module is imported lazily: importing it applies `@triton.jit`, which fixes the
interpreter-or-compiled choice (TRITON_INTERPRET) for the process.
"""

from __future__ import annotations

from codegen.cross_entropy.reference import (
    cross_entropy,
    edge_cases,
    flops,
    make_case,
    make_inputs,
    make_out,
    min_bytes,
    params,
)
from core.family import Family, Pattern, lazy, no_cases, no_patch

_NESTED = ("aten::log_softmax", "aten::_log_softmax", "aten::nll_loss_nd", "aten::nll_loss",
           "aten::nll_loss_forward", "aten::to", "aten::_to_copy", "aten::empty_strided",
           "aten::copy_")

PATTERNS = (
    Pattern(name="cross_entropy", family="cross_entropy", function=r"^cross_entropy$",
            description="cross-entropy loss (torch.nn.functional.cross_entropy): log_softmax "
                        "over the vocabulary, then nll_loss",
            ops={"aten::cross_entropy_loss": 1}, extra_ok=_NESTED),
)


FAMILY = Family(
    name="cross_entropy",
    patterns=PATTERNS,
    reference=cross_entropy,
    make_inputs=make_inputs,
    make_out=make_out,
    edge_cases=edge_cases,
    min_bytes=min_bytes,
    flops=flops,
    search_space=lazy("codegen.cross_entropy.kernel", "search_space"),
    render=lazy("codegen.cross_entropy.kernel", "render"),
    patch=no_patch,
    cases_from_model=no_cases,
    aten_ops=("aten::cross_entropy_loss", "aten::log_softmax", "aten::_log_softmax",
              "aten::nll_loss", "aten::nll_loss_forward", "aten::nll_loss_nd"),
    params=params,
    examples=(make_case(16, 512, "bfloat16"),),
)
