"""Patching the grouped q/k/v projection into a model: per attention instance, reversible,
stacked over what runs, nothing copied.

An attention qualifies when it holds `q_proj`, `k_proj` and `v_proj` as plain nn.Linear over
one input width, all three with a bias or none, one dtype and device, at widths the matmul
family does not pad (`codegen.matmul.reference.padded`: that family owns those modules).
Llama, Qwen2, Mistral and Gemma qualify; Phi-3 (`qkv_proj`) and GPT-2 (`c_attn`) fuse the
three already.

HF calls the three projections one after the other on the same tensor. The adapter wraps
each instance's forward (`models.patching.wrap_instance_forward`): q_proj's runs the kernel,
which writes q, k and v, returns q and keeps k and v for the two calls that follow; k_proj's
and v_proj's return what was kept when called with that very tensor (identity and version:
the same object, not modified in place since), and run what ran before otherwise. The kernel
applies when no autograd graph is needed, the tensor has the weights' dtype and device, at
most MAX_ROWS rows of one token per sequence (a decode step), the weights are contiguous, no
hook sits on any of the three and none was swapped, and the chooser gives a kernel for the
signature (`core.family.kernel_by_signature`). The weights are read from the modules at call
time: a weight updated in place is what the kernel reads.

The outputs are three fresh contiguous tensors, the layout HF's Linears return, so rope and
the KV-cache update after them see the cases they were verified on.

The three forwards declare `models.patching.FUSED` (the function that serves a call from the
one launch, or declines it): the gemv family's forward, stacked above them when gemv is
patched later, asks it first and runs its own kernel where it declines; stacked below them it
takes what they decline. So the two families compose in either order (gemv keeps o_proj, the
MLP and the LM head).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from codegen.dtypes import dtype_name
from codegen.matmul.reference import gemv_takes, padded
from codegen.qkv_proj.reference import make_case, params
from core.family import Case, kernel_by_signature
from models.patching import FUSED, intercepted, needs_graph, wrap_instance_forward

NAMES = ("q_proj", "k_proj", "v_proj")


def _plain(m) -> bool:
    return type(m) is nn.Linear and padded(m.out_features) == m.out_features


def attentions(model: nn.Module) -> list[nn.Module]:
    """The modules whose q/k/v projections this family groups (the module docstring)."""
    out = []
    for m in model.modules():
        lins = [getattr(m, n, None) for n in NAMES]
        if not all(_plain(li) for li in lins):
            continue
        ws = [li.weight for li in lins]
        if (len({w.shape[1] for w in ws}) == 1 and len({(w.dtype, w.device) for w in ws}) == 1
                and len({li.bias is None for li in lins}) == 1):
            out.append(m)
    return out


def _case(m: nn.Module, rows: int, dtype: str, lead) -> Case:
    q, k, v = (getattr(m, n) for n in NAMES)
    return make_case(rows, q.in_features, q.out_features, k.out_features, v.out_features,
                     dtype, q.bias is not None, lead)


def cases_from_model(model: nn.Module, workload) -> list[Case]:
    """A decode step's case per distinct attention shape: x is (batch, 1, hidden) there."""
    lead = (workload.batch, workload.tokens // workload.batch)
    cases = []
    for m in attentions(model):
        if not gemv_takes(lead, m.q_proj.out_features):
            continue
        case = _case(m, workload.tokens, workload.dtype, lead)
        if case not in cases:
            cases.append(case)
    return cases


def _unhooked(lins: list[nn.Module]) -> bool:
    return not any(intercepted(li) for li in lins)


def _wrappers(m: nn.Module, forward_by_case: Callable) -> list[tuple[nn.Module, Callable]]:
    lins = [getattr(m, n) for n in NAMES]
    hidden, widths = lins[0].in_features, [li.out_features for li in lins]
    kept: dict[str, tuple] = {}

    def case_of(shape: torch.Size, dtype: torch.dtype) -> Case | None:
        lead = tuple(shape[:-1])
        if not gemv_takes(lead, widths[0]):  # a decode step's rows, as the gemv family's
            return None
        return _case(m, shape.numel() // hidden, dtype_name(dtype),
                     lead if len(lead) > 1 else None)

    resolve = kernel_by_signature(lambda c: None if c is None else forward_by_case(c),
                                  case_of, params)

    def lead(x) -> torch.Tensor | None:
        """q from one launch that writes q, k and v (k and v kept for the calls that
        follow), or None where the kernel does not apply."""
        kept.clear()
        if not isinstance(x, torch.Tensor) or resolve.declines(x.shape, x.dtype):
            return None  # a signature with no kernel (a prefill's rows): nothing else to ask
        now = [getattr(m, n) for n in NAMES]
        ws = [li.weight for li in now]
        if (all(a is b for a, b in zip(now, lins)) and _unhooked(lins)
                and x.dim() in (2, 3) and x.shape[-1] == hidden
                and all(w.dtype == x.dtype and w.device == x.device
                        and w.is_contiguous() for w in ws)
                and not needs_graph(x, *ws)):
            kernel, kw = resolve(x.shape, x.dtype)
            if kernel is not None:
                outs = tuple(torch.empty((*x.shape[:-1], n), dtype=x.dtype,
                                         device=x.device) for n in widths)
                kernel(x, *ws, *([] if lins[0].bias is None else
                                 [li.bias for li in lins]), out=outs, **kw)
                kept["k_proj"] = (x, x._version, outs[1])
                kept["v_proj"] = (x, x._version, outs[2])
                return outs[0]
        return None

    def follow(name: str) -> Callable:
        def take(x) -> torch.Tensor | None:
            """What q_proj's launch kept for this very tensor (same object, not modified in
            place since), or None."""
            hit = kept.pop(name, None)
            if hit is not None and hit[0] is x and hit[1] == x._version:
                return hit[2]
            return None
        return take

    def wrap_with(fused: Callable) -> Callable[[Callable], Callable]:
        def wrap(below: Callable) -> Callable:
            def forward(*args, **kwargs):
                if len(args) == 1 and not kwargs:
                    out = fused(args[0])
                    if out is not None:
                        return out
                elif fused is lead:
                    kept.clear()
                return below(*args, **kwargs)
            setattr(forward, FUSED, fused)  # a gemv forward stacked above asks it first
            return forward
        return wrap

    lead_wrap = wrap_with(lead)

    return [(lins[0], lead_wrap), (lins[1], wrap_with(follow("k_proj"))),
            (lins[2], wrap_with(follow("v_proj")))]


def patch(model: nn.Module, forward_by_case: Callable[[Case], Callable | None]
          ) -> Callable[[], None]:
    """Wrap the three projections of every qualifying attention; the undo restores what each
    ran before (in any order with other adapters stacked on the same modules)."""
    undos = [wrap_instance_forward(mod, wrap) for m in attentions(model)
             for mod, wrap in _wrappers(m, forward_by_case)]

    def undo() -> None:
        for u in reversed(undos):
            u()
        undos.clear()

    return undo
