"""Patching the fused GELU into a model: per activation-module instance, reversible.

Every `NewGELUActivation` instance (GPT-2's `model.transformer.h.*.mlp.act`) gets an
instance-level forward (never a class-level one: that would leak into every model built later
in the process) that asks `forward_by_case(case)` on each call and runs the module's own code
when the answer is None, so a kernel accepted for one workload only runs on that workload.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from codegen.dtypes import dtype_name
from codegen.gelu.reference import make_case, params
from core.family import Case, kernel_by_signature
from models.patching import needs_graph, set_instance_forwards

ACT_CLASSES = ("NewGELUActivation",)


def find_activations(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(path, m) for path, m in model.named_modules()
            if type(m).__name__ in ACT_CLASSES]


def _features_out(module: nn.Module) -> int | None:
    if isinstance(module, nn.Linear):
        return module.out_features
    return getattr(module, "nf", None)  # transformers' Conv1D (GPT-2) stores its width as nf


def input_width(model: nn.Module, path: str) -> int | None:
    """The activation's input width, read from its MLP: HF MLPs declare the up projection
    (GPT-2's c_fc, Phi's fc1) as their first projection child, and it feeds the activation."""
    parent_path = path.rpartition(".")[0]
    parent = model.get_submodule(parent_path) if parent_path else model
    for child in parent.children():
        width = _features_out(child)
        if width is not None:
            return width
    return None


def cases_from_model(model: nn.Module, workload) -> list[Case]:
    cases = []
    for path, _ in find_activations(model):
        width = input_width(model, path)
        if width is None:
            continue
        case = make_case(workload.tokens, width, workload.dtype,
                         lead=(workload.batch, workload.tokens // workload.batch))
        if case not in cases:
            cases.append(case)
    return cases


def case_of(shape: torch.Size, dtype: torch.dtype) -> Case:
    """The call's case, its leading shape included: the kernel runs only on the shape it was
    verified for."""
    return make_case(shape.numel() // shape[-1], shape[-1], dtype_name(dtype), lead=shape[:-1])


def _dispatching_forward(original: Callable, forward_by_case: Callable) -> Callable:
    # the case (and its key's hash) once per input signature, not on every call: rebuilding it
    # each time costs tens of microseconds of host per call, which a host-bound pass pays
    resolve = kernel_by_signature(forward_by_case, case_of, params)

    def forward(input):
        if needs_graph(input):
            return original(input)
        kernel, kw = resolve(input.shape, input.dtype)
        if kernel is None:
            return original(input)
        out = torch.empty(input.shape, dtype=input.dtype, device=input.device)
        kernel(input, out=out, **kw)
        return out

    return forward


def patch(model: nn.Module, forward_by_case: Callable[[Case], Callable | None]):
    return set_instance_forwards((m, _dispatching_forward(m.forward, forward_by_case))
                                 for _, m in find_activations(model))
