"""Patching the residual add + RMSNorm + gate/up GEMV into a model: per decoder layer, the
layer's add + post-attention norm and its MLP's gate/up swapped and undone together, stacked
over what runs.

A layer qualifies when its class's forward is the pre-norm layout the add_rmsnorm family reads
statement for statement (`layer_template`: post_attention_layernorm's output goes to the MLP
and nowhere else), with no dropout module on its residual branches, its post_attention_layernorm
is an RMSNorm of a known form, and its MLP is one matmul_epilogue computes with two plain
bias-free Linears (gate_proj, up_proj), whose class returns down_proj's output.

The layer's forward is add_rmsnorm's (`codegen.add_rmsnorm.patch.patch_layers`: the same
submodules called in the same order, the last residual add folded into down_proj's GEMV), with
a kernel of this layer's own in place of the add + norm kernel: it writes total = residual +
attn_out and normed = norm(total) into the layer's buffers, and h = act(normed Wg^T) *
(normed Wu^T), kept for the MLP's call that follows. Why the add is folded here rather than
into o_proj's GEMV: o_proj accumulating into the residual would write the layer's input in
place (the previous layer's output, which a caller may hold: output_hidden_states) or need a
copy, a launch again; total is the layer's own buffer, which down_proj then accumulates into.

The MLP's instance forward returns down_proj(h) (down_proj called as a module, so its own
adapters and the residual accumulate apply) when called with a view of that very normed
buffer, not modified in place since (its version), and runs what ran before otherwise. So
nothing is handed on unfilled: whatever else reads normed or total reads HF's values. Where
the MLP does not take h (a forward stacked above it that never asks below), the launch ran for
nothing: the next call sees h unclaimed and the layer stops fusing for the patch's life (the
add and the norm then run as the reference's torch code, the MLP as HF's).

Per call the kernel applies when no autograd graph is needed, at most MAX_ROWS rows, the
weights have x's dtype and device and are contiguous, no hook sits on the MLP or the
projections and none was swapped (matmul_epilogue's `_as_patched`); per signature, where the
chooser gives a kernel (else the layer's forward below runs: add_rmsnorm's where it was
patched first, HF's otherwise). The MLP's forward declares models.patching.FUSED, so
matmul_epilogue's MLP forward stacked above asks it first. add_rmsnorm is the rival (both
replace the layer's add + norm); on a workload where this family does not ship (a prefill,
more than MAX_ROWS rows) add_rmsnorm is tried in its place (pipeline.integrate.fall_back).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from codegen.add_rmsnorm.patch import NAME_RE, layer_template, patch_layers
from codegen.add_rmsnorm.residual_gemm import RETURNS_DOWN_PROJ, class_returns_down_proj
from codegen.matmul_epilogue.patch import _as_patched, gemm_mlps
from codegen.norm_gate_up.reference import MAX_ROWS, make_case, params
from codegen.rmsnorm.patch import recognise as recognise_rmsnorm
from codegen.rmsnorm.reference import rms_norm
from core.family import Case
from models.patching import FUSED, intercepted, needs_graph, wrap_instance_forward


def layers(model: nn.Module) -> list[tuple[nn.Module, dict, dict, object, tuple]]:
    """(layer, its layout template, the norm's form, its GatedMLP, (gate_proj, up_proj)) of
    every layer this family patches (module docstring)."""
    out = []
    for m in model.modules():
        template = layer_template(type(m)) if NAME_RE.match(type(m).__name__) else None
        if template is None or any(template["dropouts"]):
            continue
        norm, mlp = getattr(m, "post_attention_layernorm", None), getattr(m, "mlp", None)
        if not isinstance(norm, nn.Module) or not isinstance(mlp, nn.Module) \
                or not isinstance(getattr(m, "self_attn", None), nn.Module) \
                or not isinstance(getattr(m, "input_layernorm", None), nn.Module) \
                or not class_returns_down_proj(type(mlp)):
            continue
        form = recognise_rmsnorm(norm)
        found = [(g, p) for g, p in gemm_mlps(m) if g.module is mlp and len(p) == 2]
        if form is None or not found or norm.weight.shape[0] != found[0][1][0].in_features:
            continue
        out.append((m, template, form, *found[0]))
    return out


def _case(form: dict, gated, hidden: int, rows: int, dtype: str) -> Case:
    return {**make_case(rows, hidden, gated.cols, dtype, gated.act), **form}


def cases_from_model(model: nn.Module, workload) -> list[Case]:
    """A decode step's case per distinct layer shape (one token per sequence, at most
    MAX_ROWS rows)."""
    if workload.tokens > MAX_ROWS or workload.tokens != workload.batch:
        return []
    cases = []
    for _, _, form, gated, projs in layers(model):
        case = _case(form, gated, projs[0].in_features, workload.tokens, workload.dtype)
        if case not in cases:
            cases.append(case)
    return cases


def _base(t: torch.Tensor) -> torch.Tensor:
    return t if t._base is None else t._base


def _adapter(layer: nn.Module, form: dict, gated, projs: tuple,
             forward_by_case: Callable) -> tuple[Callable, Callable[[Callable], Callable]]:
    """(the chooser add_rmsnorm's layer forward asks for its add + norm kernel, the MLP's
    wrap)."""
    mlp, hidden, cols = gated.module, projs[0].in_features, gated.cols
    kept: dict[str, tuple] = {}
    state = {"off": False}

    def applies(x2d: torch.Tensor, ws: tuple) -> bool:
        if kept:  # the last launch's h went unclaimed: this MLP does not take it
            state["off"] = True
            kept.clear()
        return (not state["off"] and x2d.shape[0] <= MAX_ROWS and layer.mlp is mlp
                and not intercepted(mlp) and _as_patched(gated, projs)
                and all(w.dtype == x2d.dtype and w.device == x2d.device and w.is_contiguous()
                        for w in ws) and not needs_graph(x2d, *ws))

    def chooser(case: Case) -> Callable | None:
        """add_rmsnorm's case (rows, hidden, dtype, the norm's form) -> its kernel's call,
        computed by this family's kernel for the same rows, or None (once per signature)."""
        if case["rows"] > MAX_ROWS:
            return None
        ours = _case(form, gated, hidden, case["rows"], case["dtype"])
        kernel = forward_by_case(ours)
        if kernel is None:
            return None
        kw = params(ours)

        def add_norm(x2d, residual2d, weight, *, out, eps, offset, cast_first,
                     sum_dtype=None) -> None:
            """out = (residual + x, the norm of it), as add_rmsnorm's kernel writes them
            (`sum_dtype`, add_rmsnorm's param, is the tensors' own dtype here)."""
            total, normed = out
            ws = (projs[0].weight, projs[1].weight)
            if applies(x2d, ws):
                h = torch.empty((x2d.shape[0], cols), dtype=x2d.dtype, device=x2d.device)
                kernel(x2d, weight, *ws, residual2d, out=(normed, h, total), **kw)
                kept["h"] = (normed, normed._version, h)
            else:  # the reference's torch code: HF's add, then its norm
                torch.add(residual2d, x2d, out=total)
                normed.copy_(rms_norm(total, weight, eps=eps, offset=offset,
                                      cast_first=cast_first))

        return add_norm

    def take(x) -> torch.Tensor | None:
        """down_proj(h) where x views the normed buffer the launch wrote (not modified in
        place since), else None."""
        hit = kept.pop("h", None)
        if hit is None or not isinstance(x, torch.Tensor):
            return None
        normed, version, h = hit
        if _base(x) is not normed or x.data_ptr() != normed.data_ptr() \
                or x.numel() != normed.numel() or x._version != version:
            return None
        return mlp.down_proj(h.view(*x.shape[:-1], cols))

    def mlp_wrap(below: Callable) -> Callable:
        def forward(*args, **kwargs):
            if len(args) == 1 and not kwargs:
                out = take(args[0])
                if out is not None:
                    return out
            return below(*args, **kwargs)
        setattr(forward, FUSED, take)  # matmul_epilogue's forward stacked above asks it first
        setattr(forward, RETURNS_DOWN_PROJ, "or_below")  # the residual add into down_proj
        return forward

    return chooser, mlp_wrap


def patch(model: nn.Module, forward_by_case: Callable[[Case], Callable | None]
          ) -> Callable[[], None]:
    """Wrap the MLP and replace the layer's forward (add_rmsnorm's, with this family's kernel)
    of every qualifying layer together; the undo restores what each ran before."""
    undos, items = [], []
    for layer, template, form, gated, projs in layers(model):
        chooser, mlp_wrap = _adapter(layer, form, gated, projs, forward_by_case)
        undos.append(wrap_instance_forward(gated.module, mlp_wrap))
        items.append((layer, {"template": template, "form": form}, chooser))
    undos.append(patch_layers(items))

    def undo() -> None:
        for u in reversed(undos):
            u()
        undos.clear()

    return undo
