"""Patching the residual add + RMSNorm + gate/up GEMV into a model: per decoder layer, the
post-attention norm and the MLP swapped and undone together, stacked over what runs.

A layer qualifies when its class's forward is the pre-norm layout the add_rmsnorm family reads
statement for statement (`layer_template`: post_attention_layernorm's output goes to the MLP
and nowhere else), its post_attention_layernorm is an RMSNorm of a known form, and its MLP is
one matmul_epilogue computes with two plain bias-free Linears (gate_proj, up_proj), whose
class returns down_proj's output (`class_returns_down_proj`).

Two ways in, both on the norm's instance forward, both writing the norm's output (`normed`)
and h = act(normed Wg^T) * (normed Wu^T) in one launch, h kept for the MLP's call that follows:

- called as a module (the layer's own forward, or any caller): normed = norm(x);
- `models.patching.ADDS_AND_NORMS`, asked by add_rmsnorm's layer forward in place of its own
  add + norm kernel: total = residual + x and normed = norm(total), both into add_rmsnorm's
  buffers. Why the add is folded here, not left to o_proj: o_proj accumulating into the
  residual would write the layer's input in place (the previous layer's output, which a
  caller may hold: output_hidden_states), or need a copy, a launch again; add_rmsnorm's total
  is the layer's own buffer, which its down_proj accumulates into afterwards (residual_gemm).

The MLP's instance forward returns down_proj(h) (down_proj called as a module, so its own
adapters and add_rmsnorm's residual accumulate apply) when called with a view of that very
normed buffer, not modified in place since (its version), and runs what ran before otherwise.
So nothing is handed on unfilled: whatever else reads normed or total reads HF's values.
Where the MLP does not take h (a hook, a forward stacked above that never asks below), the
launch ran for nothing: the next call sees h unclaimed and the layer stops fusing for the
patch's life.

The kernel applies when no autograd graph is needed, x has the weights' dtype and device, at
most MAX_ROWS rows of one token per sequence, the weights are contiguous, no hook sits on the
norm or the projections and none was swapped (matmul_epilogue's `_as_patched`), and the
chooser gives a kernel for the signature. Forwards declare models.patching.FUSED, so
matmul_epilogue's MLP forward and rmsnorm's norm forward stacked above ask them first.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from codegen.add_rmsnorm.patch import NAME_RE, layer_template
from codegen.add_rmsnorm.residual_gemm import RETURNS_DOWN_PROJ, class_returns_down_proj
from codegen.dtypes import dtype_name
from codegen.matmul_epilogue.patch import _as_patched, gemm_mlps
from codegen.norm_gate_up.reference import MAX_ROWS, make_case, params
from codegen.rmsnorm.patch import kernel_can_take
from codegen.rmsnorm.patch import recognise as recognise_rmsnorm
from core.family import Case, kernel_by_signature
from models.patching import (
    ADDS_AND_NORMS,
    FUSED,
    intercepted,
    needs_graph,
    wrap_instance_forward,
)


def layers(model: nn.Module) -> list[tuple[nn.Module, dict, object, tuple]]:
    """(layer, the norm's form, its GatedMLP, (gate_proj, up_proj)) of every layer this family
    patches (module docstring)."""
    out = []
    for m in model.modules():
        if not NAME_RE.match(type(m).__name__) or layer_template(type(m)) is None:
            continue
        norm, mlp = getattr(m, "post_attention_layernorm", None), getattr(m, "mlp", None)
        if not isinstance(norm, nn.Module) or not isinstance(mlp, nn.Module) \
                or not class_returns_down_proj(type(mlp)):
            continue
        form = recognise_rmsnorm(norm)
        found = [(g, p) for g, p in gemm_mlps(m) if g.module is mlp and len(p) == 2]
        if form is None or not found or norm.weight.shape[0] != found[0][1][0].in_features:
            continue
        out.append((m, form, *found[0]))
    return out


def _case(form: dict, gated, hidden: int, rows: int, dtype: str, residual: bool) -> Case:
    return {**make_case(rows, hidden, gated.cols, dtype, gated.act, residual=residual),
            **form}


def cases_from_model(model: nn.Module, workload) -> list[Case]:
    """A decode step's cases per distinct layer shape, with the residual add (the calls of
    add_rmsnorm's layer forward) and without (the norm called as a module)."""
    if workload.tokens > MAX_ROWS or workload.tokens != workload.batch:
        return []
    cases = []
    for _, form, gated, projs in layers(model):
        for residual in (True, False):
            case = _case(form, gated, projs[0].in_features, workload.tokens, workload.dtype,
                         residual)
            if case not in cases:
                cases.append(case)
    return cases


def _base(t: torch.Tensor) -> torch.Tensor:
    return t if t._base is None else t._base


def _wrappers(layer: nn.Module, form: dict, gated, projs: tuple,
              forward_by_case: Callable) -> list[tuple[nn.Module, Callable]]:
    norm, mlp = layer.post_attention_layernorm, gated.module
    hidden, cols = projs[0].in_features, gated.cols
    kept: dict[str, tuple] = {}
    state = {"off": False}

    def case_of(rows: int, dtype: torch.dtype, residual: bool) -> Case:
        return _case(form, gated, hidden, rows, dtype_name(dtype), residual)

    resolve = kernel_by_signature(forward_by_case, case_of, params)

    def kernel_for(x: torch.Tensor, residual: bool):
        """(the weights, kernel, its params) for this call, or None where it does not apply."""
        if kept:  # the last launch's h went unclaimed: this MLP does not take it
            state["off"] = True
            kept.clear()
        if state["off"] or not isinstance(x, torch.Tensor) or x.dim() not in (2, 3):
            return None
        nw = norm.weight
        rows = x.numel() // hidden if x.shape[-1] == hidden else 0
        one_token = x.dim() == 2 or x.shape[1] == 1
        if not (0 < rows <= MAX_ROWS and one_token and layer.post_attention_layernorm is norm
                and layer.mlp is mlp and not intercepted(norm) and not intercepted(mlp)
                and _as_patched(gated, projs) and kernel_can_take(x, nw, form)
                and nw.is_contiguous()):
            return None
        ws = (projs[0].weight, projs[1].weight)
        if not all(w.dtype == x.dtype and w.device == x.device and w.is_contiguous()
                   for w in ws) or needs_graph(x, nw, *ws):
            return None
        kernel, kw = resolve(rows, x.dtype, residual)
        return None if kernel is None else (nw, ws, kernel, kw)

    def keep(normed: torch.Tensor, h: torch.Tensor) -> None:
        kept["h"] = (normed, normed._version, h)

    def fuse(x) -> torch.Tensor | None:
        """normed from one launch that also writes h (kept for the MLP's call), or None."""
        found = kernel_for(x, False)
        if found is None:
            return None
        nw, ws, kernel, kw = found
        x2 = x.reshape(-1, hidden)
        normed = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        h = torch.empty((x2.shape[0], cols), dtype=x.dtype, device=x.device)
        kernel(x2, nw, *ws, out=(normed, h), **kw)
        keep(normed, h)
        return normed.view(*x.shape)

    def adds(x2d, residual2d, out) -> bool:
        """total = residual + x and normed = norm(total) into `out` (add_rmsnorm's buffers,
        contiguous (rows, hidden)) in one launch that also writes h; False where it does not
        apply (nothing written)."""
        total, normed = out
        found = kernel_for(x2d, True)
        if found is None or x2d.dim() != 2 or not residual2d.is_contiguous() \
                or residual2d.shape != x2d.shape or not total.is_contiguous() \
                or not normed.is_contiguous():
            return False
        nw, ws, kernel, kw = found
        h = torch.empty((x2d.shape[0], cols), dtype=x2d.dtype, device=x2d.device)
        kernel(x2d, nw, *ws, residual2d, out=(normed, h, total), **kw)
        keep(normed, h)
        return True

    def take(x) -> torch.Tensor | None:
        """down_proj(h) where x views the normed buffer the norm's launch wrote (not modified
        in place since), else None."""
        hit = kept.pop("h", None)
        if hit is None or not isinstance(x, torch.Tensor):
            return None
        normed, version, h = hit
        if _base(x) is not normed or x.data_ptr() != normed.data_ptr() \
                or x.numel() != normed.numel() or x._version != version:
            return None
        return mlp.down_proj(h.view(*x.shape[:-1], cols))

    def norm_wrap(below: Callable) -> Callable:
        def forward(*args, **kwargs):
            if len(args) == 1 and not kwargs:
                out = fuse(args[0])
                if out is not None:
                    return out
            return below(*args, **kwargs)
        setattr(forward, FUSED, fuse)  # rmsnorm's forward stacked above asks it first
        setattr(forward, ADDS_AND_NORMS, adds)  # add_rmsnorm's layer forward asks it
        return forward

    def mlp_wrap(below: Callable) -> Callable:
        def forward(*args, **kwargs):
            if len(args) == 1 and not kwargs:
                out = take(args[0])
                if out is not None:
                    return out
            return below(*args, **kwargs)
        setattr(forward, FUSED, take)  # matmul_epilogue's forward stacked above asks it first
        setattr(forward, RETURNS_DOWN_PROJ, "or_below")  # add_rmsnorm's residual accumulate
        return forward

    return [(norm, norm_wrap), (mlp, mlp_wrap)]


def patch(model: nn.Module, forward_by_case: Callable[[Case], Callable | None]
          ) -> Callable[[], None]:
    """Wrap the post-attention norm and the MLP of every qualifying layer together; the undo
    restores what each ran before (in any order with other adapters stacked on them)."""
    undos = [wrap_instance_forward(mod, wrap) for found in layers(model)
             for mod, wrap in _wrappers(*found, forward_by_case)]

    def undo() -> None:
        for u in reversed(undos):
            u()
        undos.clear()

    return undo
