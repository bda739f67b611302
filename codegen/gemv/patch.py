"""Patching few-row projections: every plain nn.Linear (the LM head among them) whose width the
matmul family does not pad (`codegen.matmul.patch.projections` takes those: never both on one
module), per instance, reversible, dispatched once per input signature.

Nothing is copied: the kernel reads the module's own weight and bias, so a tied LM head stays
tied and undo has no memory to give back. A call reaches a kernel when HF calls the module with
one tensor of at most MAX_ROWS rows, one token per sequence (a decode step at batch <= 16:
`gemv_takes`, the same test the ranking's `gemv` pattern applies, so what is ranked is what is
patched), no autograd graph is needed, the weight and bias are still the Parameters seen at
patch time with the same storage (reassigned, or moved with `.to()`, falls back), x has their
dtype and device, and the chooser gives a kernel for the signature
(`core.family.kernel_by_signature`). An in-place update of the weight needs no check: the
kernel reads the weight as it is. Otherwise, a prefill included, the module's own code runs.
Where a fused adapter sits below (qkv_proj's, `models.patching.FUSED`: q, k and v in one
launch), it is asked first and this kernel runs where it declines, so the two families
compose in either patch order.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn

from codegen.dtypes import dtype_name
from codegen.gemv.reference import make_case, params
from codegen.matmul.patch import layout_of, projections
from codegen.matmul.reference import gemv_takes
from core.family import Case, kernel_by_signature
from models.patching import (
    ACCUMULATES,
    SAME_RESULT,
    fused_below,
    needs_graph,
    wrap_instance_forward,
)


def linears(model: nn.Module) -> list[nn.Module]:
    """The plain nn.Linear modules this family wraps: those the matmul family leaves alone."""
    padded_ones = {id(m) for m, _ in projections(model)}
    return [m for m in model.modules() if layout_of(m) == "linear" and id(m) not in padded_ones]


def cases_from_model(model: nn.Module, workload) -> list[Case]:
    """One case per distinct (k, n, bias) at the workload's rows, laid out as the model passes
    x: (batch, 1) at a decode step (`workload.tokens` is batch x 1 there), (batch, seq) at a
    prefill, which only a one-token prefill of at most MAX_ROWS sequences gives this family."""
    batch = workload.batch
    lead = (batch, workload.tokens // batch)
    cases = []
    for m in linears(model):
        n, k = m.weight.shape
        if not gemv_takes(lead, n):
            continue
        case = make_case(workload.tokens, k, n, workload.dtype, m.bias is not None, lead)
        if case not in cases:
            cases.append(case)
    return cases


def _wrapper(module: nn.Module, forward_by_case: Callable) -> Callable[[Callable], Callable]:
    n, k = module.weight.shape
    weight, bias = module.weight, module.bias
    stamp = (weight.data_ptr(), None if bias is None else bias.data_ptr())
    has_bias = bias is not None
    tail = () if bias is None else (bias,)

    def case_of(shape: torch.Size, dtype: torch.dtype) -> Case | None:
        lead = tuple(shape[:-1])
        if not gemv_takes(lead, n):
            return None
        return make_case(shape.numel() // k, k, n, dtype_name(dtype), has_bias,
                         lead if len(lead) > 1 else None)

    def chooser(case: Case | None):
        return None if case is None else forward_by_case(case)

    resolve = kernel_by_signature(chooser, case_of, params)

    def unchanged() -> bool:
        w, b = module.weight, module.bias
        if torch.compiler.is_compiling():  # no addresses in a trace; the kernel reads these
            return w is weight and b is bias  # Parameters as they are when the graph runs
        return (w is weight and b is bias and w.data_ptr() == stamp[0]
                and (b is None or b.data_ptr() == stamp[1]))

    takes_accumulate: dict[int, bool] = {}

    def accumulate(x: torch.Tensor, total: torch.Tensor) -> bool:
        """total += x @ W^T in the kernel's epilogue, where one is given for x's signature
        and renders `accumulate` (kernels accepted before it did not), no bias. Not inside a
        torch.compile trace (the kernel's op has no such argument)."""
        if torch.compiler.is_compiling():
            return False
        if not (bias is None and x.dtype == weight.dtype == total.dtype
                and x.device == weight.device and x.shape[-1] == k and x.dim() in (2, 3)
                and total.is_contiguous() and total.numel() == x.numel() // k * n
                and total.shape[-1] == n and unchanged() and not needs_graph(x, weight)):
            return False
        kernel, kw = resolve(x.shape, x.dtype)
        if kernel is None:
            return False
        if id(kernel) not in takes_accumulate:
            takes_accumulate[id(kernel)] = "accumulate" in inspect.signature(kernel).parameters
        if not takes_accumulate[id(kernel)]:
            return False
        kernel(x, weight, out=total, accumulate=True, **kw)
        return True

    def wrap(below: Callable) -> Callable:
        def forward(*args, **kwargs):
            if len(args) == 1 and not kwargs:
                (x,) = args
                if isinstance(x, torch.Tensor) and resolve.declines(x.shape, x.dtype):
                    # no kernel of ours for the signature (a prefill's rows): `below` runs
                    # what this forward would, a FUSED forward beneath included
                    return below(x)
                fused = fused_below(below)
                if fused is not None:  # qkv_proj's one launch below: it serves q, k and v
                    out = fused(x)
                    if out is not None:
                        return out
                if (isinstance(x, torch.Tensor) and x.dtype == weight.dtype
                        and x.device == weight.device and x.shape[-1] == k
                        and x.dim() in (2, 3) and unchanged() and not needs_graph(x, weight)):
                    kernel, kw = resolve(x.shape, x.dtype)
                    if kernel is not None:
                        out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
                        kernel(x, weight, *tail, out=out, **kw)
                        return out
            return below(*args, **kwargs)

        # F.linear of the module's own weight and bias either way: matmul_epilogue's GEMV,
        # which computes gate_proj's and up_proj's products itself, may skip this call
        setattr(forward, SAME_RESULT, True)
        # add_rmsnorm's residual add into down_proj runs in this kernel's epilogue
        setattr(forward, ACCUMULATES, accumulate)
        return forward

    return wrap


def patch(model: nn.Module, forward_by_case: Callable[[Case], Callable | None]
          ) -> Callable[[], None]:
    """Wrap each of `linears(model)`; the undo restores what each ran before."""
    undos = [wrap_instance_forward(m, _wrapper(m, forward_by_case)) for m in linears(model)]

    def undo() -> None:
        for u in reversed(undos):
            u()
        undos.clear()

    return undo
