"""Patching the RMSNorm + grouped q/k/v projection into a model: per decoder layer, the norm
and the three projections swapped and undone together, stacked over what runs.

A layer qualifies when its class's forward is the pre-norm layout the add_rmsnorm family reads
statement for statement (`layer_template`: input_layernorm's output goes to self_attn as its
hidden_states and nowhere else), its input_layernorm is an RMSNorm of a known form
(`codegen.rmsnorm.patch.recognise`), its self_attn's q/k/v projections are ones qkv_proj
groups (`codegen.qkv_proj.patch.attentions`), and the attention's forward calls each of them
on its hidden_states (read from its source).

The norm's instance forward runs the kernel: it writes the norm's output (`normed`, a fresh
contiguous tensor, the layout HF's norm returns) and q, k and v, returns `normed` and keeps
q, k and v for the projections' calls that follow; their forwards return what was kept when
called with that very tensor (identity and version: the same object, not modified in place
since) and run what ran before otherwise. Nothing is ever handed on unfilled: whatever else
reads `normed` reads the norm's values. Where the attention does not take what was kept (a
hook on a projection, an attention that feeds them something else), the launch computed
q, k and v for nothing: the next call of the norm sees the unclaimed entries and the layer
stops fusing for the patch's life (HF's norm and projections run, as unpatched).

The kernel applies when no autograd graph is needed, x has the weights' dtype and device, at
most MAX_ROWS rows of one token per sequence (a decode step), the weights are contiguous, no
hook sits on the norm or the projections and none was swapped, and the chooser gives a kernel
for the signature. The weights are read from the modules at call time.

Composition (models.patching): the norm's and the projections' forwards declare FUSED, so a
gemv forward stacked above a projection asks it first, and an rmsnorm forward stacked above
the norm does too (codegen/rmsnorm/patch.py). add_rmsnorm's layer forward calls the norm and
the attention as modules, so it runs through this patch unchanged. qkv_proj is the rival
(family RankHooks): patched together, the one stacked above takes the calls.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable

import torch
from torch import nn

from codegen.add_rmsnorm.patch import NAME_RE, layer_template
from codegen.dtypes import dtype_name
from codegen.matmul.reference import gemv_takes
from codegen.norm_qkv.reference import MAX_ROWS, params
from codegen.qkv_proj.patch import NAMES, attentions
from codegen.qkv_proj.reference import make_case as qkv_case
from codegen.rmsnorm.patch import kernel_can_take
from codegen.rmsnorm.patch import recognise as recognise_rmsnorm
from core.family import Case, kernel_by_signature
from models.patching import FUSED, intercepted, needs_graph, wrap_instance_forward

_CALLS = [re.compile(rf"self\.{name}\(\s*hidden_states\s*\)") for name in NAMES]


def _feeds_projections(attention: nn.Module) -> bool:
    """Whether the attention class's forward calls q_proj, k_proj and v_proj on its
    hidden_states (the tensor the layer hands it: the norm's output)."""
    forward = type(attention).__dict__.get("forward")
    try:
        source = inspect.getsource(inspect.unwrap(forward))
    except (OSError, TypeError):
        return False
    return all(call.search(source) for call in _CALLS)


def layers(model: nn.Module) -> list[tuple[nn.Module, dict]]:
    """(layer, the input norm's form) of every layer this family patches (module docstring)."""
    out = []
    for m in model.modules():
        if not NAME_RE.match(type(m).__name__) or layer_template(type(m)) is None:
            continue
        norm, attn = getattr(m, "input_layernorm", None), getattr(m, "self_attn", None)
        if not isinstance(norm, nn.Module) or not isinstance(attn, nn.Module):
            continue
        form = recognise_rmsnorm(norm)
        if form is None or not any(a is attn for a in attentions(m)) \
                or not _feeds_projections(attn):
            continue
        if norm.weight.shape[0] == attn.q_proj.in_features:
            out.append((m, form))
    return out


def _case(layer: nn.Module, form: dict, rows: int, dtype: str, lead) -> Case:
    q, k, v = (getattr(layer.self_attn, n) for n in NAMES)
    return {**qkv_case(rows, q.in_features, q.out_features, k.out_features, v.out_features,
                       dtype, q.bias is not None, lead), **form}


def cases_from_model(model: nn.Module, workload) -> list[Case]:
    """A decode step's case per distinct layer shape (x is (batch, 1, hidden) there), at most
    MAX_ROWS rows."""
    lead = (workload.batch, workload.tokens // workload.batch)
    cases = []
    for layer, form in layers(model):
        if workload.tokens > MAX_ROWS or not gemv_takes(lead,
                                                        layer.self_attn.q_proj.out_features):
            continue
        case = _case(layer, form, workload.tokens, workload.dtype, lead)
        if case not in cases:
            cases.append(case)
    return cases


def _wrappers(layer: nn.Module, form: dict,
              forward_by_case: Callable) -> list[tuple[nn.Module, Callable]]:
    norm, attn = layer.input_layernorm, layer.self_attn
    lins = [getattr(attn, n) for n in NAMES]
    hidden, widths = lins[0].in_features, [li.out_features for li in lins]
    kept: dict[str, tuple] = {}
    state = {"off": False}

    def case_of(shape: torch.Size, dtype: torch.dtype) -> Case | None:
        lead = tuple(shape[:-1])
        rows = shape.numel() // hidden
        if rows > MAX_ROWS or not gemv_takes(lead, widths[0]):
            return None
        return _case(layer, form, rows, dtype_name(dtype), lead if len(lead) > 1 else None)

    resolve = kernel_by_signature(lambda c: None if c is None else forward_by_case(c),
                                  case_of, params)

    def fuse(x) -> torch.Tensor | None:
        """normed from one launch that also writes q, k and v (kept for the projections'
        calls that follow), or None where the kernel does not apply."""
        if kept:  # the last launch's q, k, v went unclaimed: this attention does not take them
            state["off"] = True
            kept.clear()
        if state["off"] or not isinstance(x, torch.Tensor) or resolve.declines(x.shape, x.dtype):
            return None
        now = [getattr(attn, n) for n in NAMES]
        ws = [li.weight for li in now]
        nw = norm.weight
        if not (layer.input_layernorm is norm and layer.self_attn is attn
                and all(a is b for a, b in zip(now, lins))
                and not intercepted(norm) and not any(intercepted(li) for li in lins)
                and x.dim() in (2, 3) and x.shape[-1] == hidden
                and kernel_can_take(x, nw, form) and nw.is_contiguous()
                and all(w.dtype == x.dtype and w.device == x.device and w.is_contiguous()
                        for w in ws)
                and not needs_graph(x, nw, *ws)):
            return None
        kernel, kw = resolve(x.shape, x.dtype)
        if kernel is None:
            return None
        normed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        outs = tuple(torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
                     for n in widths)
        kernel(x, nw, *ws, *([] if lins[0].bias is None else [li.bias for li in lins]),
               out=(normed, *outs), **kw)
        for name, out in zip(NAMES, outs):
            kept[name] = (normed, normed._version, out)
        return normed

    def follow(name: str) -> Callable:
        def take(x) -> torch.Tensor | None:
            """What the norm's launch kept for this very tensor (same object, not modified
            in place since), or None."""
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
                return below(*args, **kwargs)
            setattr(forward, FUSED, fused)  # forwards stacked above ask it first
            return forward
        return wrap

    return [(norm, wrap_with(fuse)), *((li, wrap_with(follow(n))) for li, n in zip(lins, NAMES))]


def patch(model: nn.Module, forward_by_case: Callable[[Case], Callable | None]
          ) -> Callable[[], None]:
    """Wrap the input norm and the three projections of every qualifying layer together; the
    undo restores what each ran before (in any order with other adapters stacked on them)."""
    undos = [wrap_instance_forward(mod, wrap) for layer, form in layers(model)
             for mod, wrap in _wrappers(layer, form, forward_by_case)]

    def undo() -> None:
        for u in reversed(undos):
            u()
        undos.clear()

    return undo
