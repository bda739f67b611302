"""Row softmax family (last dim), with torch.softmax's dtype semantics.

Recognition: the scope is one call of the Python function `softmax` (torch.nn.functional's
frame, as HF's eager attention calls it: `nn.functional.softmax(scores, dim=-1,
dtype=torch.float32)`). Observed top-level op with torch.profiler (CPU, torch 2.13):
aten::softmax, with aten::to and aten::_softmax nested under it (not top-level ops).

Patch: a documented no-op. No module of the zoo runs a standalone softmax in the profiled
forward: profiling.loader builds every model with SDPA attention, whose softmax happens inside
the fused attention kernel, and no zoo model applies a softmax elsewhere in its forward. So
`cases_from_model` returns no cases and `patch` changes nothing (its undo does nothing). A model
run with eager attention would call `torch.nn.functional.softmax` through the torch module
itself; intercepting that per instance would mean rebinding `nn` in the modeling module's
globals during each attention call, which is not done here.

The kernel module is imported lazily: importing it applies `@triton.jit`, which fixes the
interpreter-or-compiled choice (TRITON_INTERPRET) for the process.
"""

from __future__ import annotations

from codegen.softmax.reference import (
    edge_cases,
    flops,
    make_case,
    make_inputs,
    make_out,
    min_bytes,
    params,
    softmax,
)
from core.family import Family, Pattern, lazy, no_cases, no_patch

PATTERNS = (
    Pattern(name="softmax", family="softmax", function=r"^softmax$",
            description="row softmax over the last dim (torch.nn.functional.softmax)",
            ops={"aten::softmax": 1}, extra_ok=("aten::_softmax", "aten::to", "aten::_to_copy",
                                                "aten::empty_strided", "aten::copy_")),
)


FAMILY = Family(
    name="softmax",
    patterns=PATTERNS,
    reference=softmax,
    make_inputs=make_inputs,
    make_out=make_out,
    edge_cases=edge_cases,
    min_bytes=min_bytes,
    flops=flops,
    search_space=lazy("codegen.softmax.kernel", "search_space"),
    render=lazy("codegen.softmax.kernel", "render"),
    patch=no_patch,
    cases_from_model=no_cases,
    aten_ops=("aten::softmax", "aten::_softmax"),
    params=params,
    examples=(make_case(16, 100, "float16", "float32"),),
)
