"""Patching the fused c_fc + GELU into GPT-2: per MLP instance, reversible, stacked over
what runs.

An MLP qualifies when it is HF's GPT2MLP in form: a `c_fc` Conv1D (weight (in, out), `nf`
outputs, a bias), an `act` that computes tanh-GELU (NewGELUActivation: gelu_new;
GELUTanh: gelu_pytorch_tanh), a `c_proj` and a `dropout`, and a forward that is HF's own,
statement for statement (`models.patching.code_shape`): c_fc, act, c_proj, dropout.

The replacement WRAPS the instance's forward: where the kernel does not apply it calls
`below`, whatever ran before (HF's forward, or another family's patch). It applies when HF
calls mlp(hidden_states) with one tensor, no autograd graph is needed, c_fc is still the
module seen at patch time, unhooked and unwrapped (a hook, accelerate's offloading hook, a
LoRA layer or another family's adapter on c_fc must see its call: codegen.matmul pads a
misaligned c_fc, then this falls back), its weight is contiguous with x's dtype and device,
and the chooser gives a kernel for the input signature (asked once per signature). The
weights are read from c_fc at call time. c_proj and dropout stay modules, called as HF calls
them; the activation module is not called: the kernel computes it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from codegen.dtypes import dtype_name
from codegen.matmul_gelu.reference import make_case, params
from core.family import Case, kernel_by_signature
from models.patching import code_shape, intercepted, needs_graph, wrap_instance_forwards

ACT_OF_CLASS = {"NewGELUActivation": "gelu_new", "GELUTanh": "gelu_pytorch_tanh",
                "PytorchGELUTanh": "gelu_pytorch_tanh"}


def _hf_forward(self, hidden_states):
    hidden_states = self.c_fc(hidden_states)
    hidden_states = self.act(hidden_states)
    hidden_states = self.c_proj(hidden_states)
    hidden_states = self.dropout(hidden_states)
    return hidden_states


def _is_conv1d(m: nn.Module) -> bool:
    w = getattr(m, "weight", None)
    return (type(m).__name__ == "Conv1D" and w is not None and w.dim() == 2
            and getattr(m, "nf", None) == w.shape[1] and getattr(m, "bias", None) is not None)


def find_mlps(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(mlp, act name) for every MLP of GPT-2's form (module docstring)."""
    found = []
    for m in model.modules():
        act = ACT_OF_CLASS.get(type(getattr(m, "act", None)).__name__)
        if (act is None or not _is_conv1d(getattr(m, "c_fc", None))
                or not isinstance(getattr(m, "c_proj", None), nn.Module)
                or not isinstance(getattr(m, "dropout", None), nn.Module)):
            continue
        if code_shape(type(m).forward) == code_shape(_hf_forward):
            found.append((m, act))
    return found


def cases_from_model(model: nn.Module, workload) -> list[Case]:
    """Every qualifying MLP sees `workload.tokens` rows of the hidden width, as (batch,
    tokens per sequence): the leading shape GPT-2 passes."""
    cases = []
    for m, act in find_mlps(model):
        k, n = m.c_fc.weight.shape
        case = make_case(workload.tokens, k, n, workload.dtype, act,
                         lead=(workload.batch, workload.tokens // workload.batch))
        if case not in cases:
            cases.append(case)
    return cases


def _wrapper(mlp: nn.Module, act: str, forward_by_case: Callable) -> Callable:
    c_fc = mlp.c_fc
    k, n = c_fc.weight.shape

    def case_of(shape: torch.Size, dtype: torch.dtype) -> Case:
        return make_case(shape.numel() // k, k, n, dtype_name(dtype), act, lead=shape[:-1])

    resolve = kernel_by_signature(forward_by_case, case_of, params)

    def untouched() -> bool:
        """c_fc is the module seen at patch time and nothing intercepts its call: plain
        lookups, run on every MLP call."""
        now = mlp._modules.get("c_fc")
        return now is c_fc and not intercepted(c_fc) and "forward" not in c_fc.__dict__

    def wrap(below: Callable) -> Callable:
        def forward(*args, **kwargs):
            if len(args) == 1 and not kwargs and untouched():
                (x,) = args
                w, b = c_fc.weight, c_fc.bias
                if (isinstance(x, torch.Tensor) and x.shape[-1] == k
                        and w.dtype == b.dtype == x.dtype and w.device == x.device
                        and w.is_contiguous() and not needs_graph(x, w, b)):
                    kernel, kw = resolve(x.shape, x.dtype)
                    if kernel is not None:
                        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
                        kernel(x, w, b, out=out, **kw)
                        return mlp.dropout(mlp.c_proj(out))
            return below(*args, **kwargs)

        return forward

    return wrap


def patch(model: nn.Module, forward_by_case: Callable[[Case], Callable | None]):
    """Wrap every qualifying MLP's forward; the undo restores what each ran before."""
    return wrap_instance_forwards([(m, _wrapper(m, act, forward_by_case))
                                   for m, act in find_mlps(model)])
