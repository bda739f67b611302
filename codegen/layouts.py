"""Do a family's verification cases carry the layouts its adapter hands the kernel?

A kernel verified on plain contiguous tensors can be wrong on the strided views a model passes
(issue 27, class 5). This runs a family's patch adapter on a model with every kernel call
intercepted, records the layout of each tensor the adapter passes (shape, strides, storage
offset, dtype, which tensors share storage) and compares it with the tensors the verifier
builds for the case the adapter dispatched: `make_inputs(case)` and `make_out(case, inputs)`,
or `VerifyHooks.in_place(inputs)` where the adapter writes over its inputs. The intercepting kernel
writes the family's reference into `out`, so the forward goes on as unpatched and every later
call sees the layouts it would see with a real kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from codegen.shapes import strides
from core.family import Case, Family, result_region
from core.workload import Workload


def describe(values: Sequence[Any]) -> tuple:
    """One entry per argument: a tensor's (shape, strides (`strides`), storage offset, dtype,
    index of the first argument sharing its storage); anything else as its repr. Empty tensors
    own no storage to share."""
    owners: dict[int, int] = {}
    out = []
    for i, v in enumerate(values):
        if not isinstance(v, torch.Tensor):
            out.append(("value", repr(v)))
            continue
        shared = None
        if v.numel():
            shared = owners.setdefault(v.untyped_storage().data_ptr(), i)
        out.append((tuple(v.shape), strides(v), v.storage_offset(),
                    str(v.dtype).removeprefix("torch."), shared))
    return tuple(out)


def _as_tuple(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _out_arg(outs: tuple) -> Any:
    return outs[0] if len(outs) == 1 else outs


def _aliases(inputs: Sequence, outs: Sequence) -> bool:
    ptrs = {t.untyped_storage().data_ptr() for t in inputs
            if isinstance(t, torch.Tensor) and t.numel()}
    return any(o.numel() and o.untyped_storage().data_ptr() in ptrs for o in outs)


def verified_layout(family: Family, case: Case, in_place: bool = False) -> tuple:
    """The layout of what the verifier passes a candidate for `case`: its inputs and outputs,
    the outputs being the inputs themselves where the call writes in place."""
    inputs = _as_tuple(family.make_inputs(case, "cpu", torch.Generator().manual_seed(0)))
    outs = _as_tuple(family.verify.in_place(inputs) if in_place else family.make_out(case, inputs))
    return describe(inputs + outs)


@dataclass
class Call:
    case: Case
    layout: tuple
    in_place: bool
    n_inputs: int


@dataclass
class Recorder:
    """A chooser (forward_by_case) whose kernels record each call and compute the reference."""

    family: Family
    calls: list[Call] = field(default_factory=list)

    def __call__(self, case: Case):
        fam = self.family

        def kernel(*inputs, out, **params):
            outs = _as_tuple(out)
            in_place = _aliases(inputs, outs)
            self.calls.append(Call(dict(case), describe(inputs + outs), in_place, len(inputs)))
            with torch.no_grad():
                ref = _as_tuple(fam.reference(*[t.clone() if isinstance(t, torch.Tensor) else t
                                                for t in inputs], **params))
                # the result goes into the part of `out` the caller keeps (VerifyHooks.out_region:
                # matmul's pad columns are not the result), or its leading part where a
                # family's result is narrower than what it writes over
                got = outs if in_place else _as_tuple(result_region(fam, case, _out_arg(outs)))
                for o, r in zip(got, ref):
                    o[tuple(slice(0, n) for n in r.shape)].copy_(r)

        return kernel


def adapter_calls(family: Family, model, workload: Workload) -> list[Call]:
    """The kernel calls `family`'s adapter makes in runs of `workload` on `model`, as the
    pipeline runs it (profiling.capture.make_runner): one prefill; two decode steps, since a
    decode runner crops its cache back between steps and the second step sees what every
    later one sees."""
    from profiling.capture import make_runner

    runner = make_runner(model, workload)  # a decode workload's prefill runs unpatched
    recorder = Recorder(family)
    undo = family.patch(model, recorder)
    try:
        with torch.no_grad():
            for _ in range(1 if workload.mode == "prefill" else 2):
                runner.call()
                runner.reset()
    finally:
        undo()
    return recorder.calls


def uncovered(family: Family, model, workload: Workload) -> list[str]:
    """One line per distinct adapter call whose case the profile does not list or whose
    layout the verifier builds neither for that case nor for one of its edge cases; empty when
    every call is covered."""
    cases = family.cases_from_model(model, workload)
    problems: list[str] = []
    seen = set()
    for call in adapter_calls(family, model, workload):
        key = (repr(sorted(call.case.items())), call.layout, call.in_place)
        if key in seen:
            continue
        seen.add(key)
        if call.case not in cases:
            problems.append(f"{family.name}: the adapter dispatches {call.case}, which "
                            f"cases_from_model does not list ({cases})")
            continue
        if call.in_place and family.verify.in_place is None:
            problems.append(f"{family.name}: the adapter writes over its inputs for "
                            f"{call.case}, but the family declares no in_place")
            continue
        # the kernel dispatched for a case is verified on the case and on its edge cases (the
        # decode cache a crop leaves is one), so a layout of either is covered
        want = verified_layout(family, call.case, call.in_place)
        edges = [verified_layout(family, e, call.in_place) for e in family.edge_cases(call.case)]
        if call.layout != want and call.layout not in edges:
            problems.append(f"{family.name} {call.case}: the adapter passes {call.layout}, "
                            f"the verifier builds {want} (shape, strides, storage offset, "
                            "dtype, storage shared with)")
    return problems
