"""Row softmax family (last dim), with torch.softmax's dtype semantics.

Recognition: the scope is one call of the Python function `softmax` (torch.nn.functional's
frame, as HF's eager attention calls it: `nn.functional.softmax(scores, dim=-1,
dtype=torch.float32)`). Observed top-level op with torch.profiler (CPU, torch 2.13):
aten::softmax, with aten::to and aten::_softmax nested under it (not top-level ops).

Patch: a documented no-op. No module of the zoo runs a standalone softmax in the profiled
forward: models.loader builds every model with SDPA attention, whose softmax happens inside
the fused attention kernel, and no zoo model applies a softmax elsewhere in its forward. So
`cases_from_model` returns no cases and `patch` changes nothing (its undo does nothing). A model
run with eager attention would call `torch.nn.functional.softmax` through the torch module
itself; intercepting that per instance would mean rebinding `nn` in the modeling module's
globals during each attention call, which is not done here.

The kernel module is imported lazily: importing it applies `@triton.jit`, which fixes the
interpreter-or-compiled choice (TRITON_INTERPRET) for the process.
"""

from __future__ import annotations

from collections.abc import Callable

from codegen.family import Case, Family, Pattern
from codegen.softmax.reference import (
    edge_cases,
    flops,
    make_inputs,
    make_out,
    min_bytes,
    params,
    softmax,
)

PATTERNS = (
    Pattern(name="softmax", family="softmax", function=r"^softmax$",
            description="row softmax over the last dim (torch.nn.functional.softmax)",
            ops={"aten::softmax": 1}, extra_ok=("aten::_softmax", "aten::to", "aten::_to_copy",
                                                "aten::empty_strided", "aten::copy_")),
)


def cases_from_model(model, workload) -> list[Case]:
    """None: the profiled forward runs no standalone softmax (see the module docstring)."""
    return []


def patch(model, forward_by_case: Callable[[Case], Callable | None]) -> Callable[[], None]:
    """A no-op with a no-op undo (see the module docstring)."""
    def undo() -> None:
        return None

    return undo


def _search_space(case: Case) -> list[dict]:
    from codegen.softmax.kernel import search_space

    return search_space(case)


def _render(config: dict, case: Case) -> str:
    from codegen.softmax.kernel import render

    return render(config, case)


FAMILY = Family(
    name="softmax",
    patterns=PATTERNS,
    reference=softmax,
    make_inputs=make_inputs,
    make_out=make_out,
    edge_cases=edge_cases,
    min_bytes=min_bytes,
    flops=flops,
    search_space=_search_space,
    render=_render,
    patch=patch,
    cases_from_model=cases_from_model,
    aten_ops=("aten::softmax", "aten::_softmax"),
    extras={"params": params},
)
