"""Layers for `kernels.kernelize`: each takes the Hugging Face module's own arguments, runs the
run's accepted kernel where the call's exact case was accepted, and the module's original
forward everywhere else (another shape or dtype, autograd, a class the package was not
exported for).

Pure layers, as `kernels` requires: no state, no constructor, `forward` only; what a forward
needs of the module it reads from the module (`self` is the Hugging Face module once
kernelized). The kernels compute no gradient (`has_backward = False`: kernelize for training
falls back to the original); under torch.compile each kernel call is one custom op
(`can_torch_compile = True`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from . import _runtime


class RMSNorm(nn.Module):
    """An RMSNorm (`hidden_states` -> normalised, times the weight), as the `rmsnorm` family
    replaces it: Llama's form or Gemma's (1 + weight), as the export found the class."""

    weight: torch.Tensor
    variance_epsilon: float
    has_backward = False
    can_torch_compile = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _rms_norm(self, hidden_states)


class ApplyRotaryPosEmb(nn.Module):
    """transformers' `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)` (its kernel layer
    `rotary_pos_emb`), as the `rope` family replaces it: q and k as the attention's
    projections hand them (heads of head_dim, unfused), new tensors out."""

    has_backward = False
    can_torch_compile = True

    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        return _rotary(self, q, k, cos, sin, unsqueeze_dim)


class GatedMLP(nn.Module):
    """A gated MLP, down_proj(act(gate_proj(x)) * up_proj(x)), as the `matmul_epilogue` family
    replaces it: the gate and up GEMMs with the activation and product in their epilogue,
    then the model's own down_proj."""

    gate_proj: nn.Linear
    up_proj: nn.Linear
    down_proj: nn.Linear
    has_backward = False
    can_torch_compile = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _gated_mlp(self, x)


def _rms_norm(module, x):
    facts = _runtime.facts("rmsnorm", module)
    weight = module.weight
    if (facts is None or x.dim() == 0 or x.numel() == 0 or x.shape[-1] != weight.shape[0]
            or x.dtype != weight.dtype or x.device != weight.device
            or _runtime.needs_graph(x, weight)):
        return type(module).forward(module, x)
    hidden = weight.shape[0]
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    kernel, params = _rms_norm_kernel(x.numel() // hidden, hidden, x.dtype, float(eps),
                                      facts["offset"], facts["cast_first"])
    if kernel is None:
        return type(module).forward(module, x)
    flat = x.contiguous().view(-1, hidden)
    out = torch.empty_like(flat)
    kernel(flat, weight, out=out, **params)
    return out.view(x.shape)


@functools.cache
def _rms_norm_kernel(rows, hidden, dtype, eps, offset, cast_first):
    params = {"eps": eps, "offset": offset, "cast_first": cast_first}
    case = {"rows": rows, "hidden": hidden, "dtype": _runtime.dtype_name(dtype), **params}
    return _runtime.choose("rmsnorm", case), params


def _rotary(slot, q, k, cos, sin, unsqueeze_dim):
    facts = _runtime.facts("rope", slot)
    if (facts is None or unsqueeze_dim != 1 or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3
            or sin.shape != cos.shape or not q.dtype == k.dtype == cos.dtype == sin.dtype
            or cos.shape[-1] != q.shape[-1] or k.shape[0] != q.shape[0]
            or k.shape[2:] != q.shape[2:] or cos.shape[0] not in (1, q.shape[0])
            or cos.shape[1] != q.shape[2] or q.stride(1) > q.shape[3]
            or _runtime.same_storage(q, k) or _runtime.needs_graph(q, k, cos, sin)):
        return _plain(type(slot))(q, k, cos, sin, unsqueeze_dim)
    batch, heads, seq, head_dim = q.shape
    kernel = _rotary_kernel(batch, seq, heads, k.shape[1], head_dim, cos.shape[0], q.dtype,
                            facts["equal_halves"])
    if kernel is None:
        return _plain(type(slot))(q, k, cos, sin, unsqueeze_dim)
    out = (torch.empty_like(q), torch.empty_like(k))
    kernel(q, k, cos, sin, out=out)
    return out


@functools.cache
def _rotary_kernel(batch, seq, heads, kv_heads, head_dim, cos_batch, dtype, equal_halves):
    case = {"batch": batch, "seq": seq, "heads": heads, "kv_heads": kv_heads,
            "head_dim": head_dim, "rot_dim": head_dim, "cos_batch": cos_batch,
            "dtype": _runtime.dtype_name(dtype)}
    if equal_halves:  # the model's rotary tables are cat(freqs, freqs)
        case["equal_halves"] = True
    return _runtime.choose("rope", case)


@functools.cache
def _plain(slot_class: type):
    """transformers' own rotary function behind its kernel-layer module (the `func` its
    forward closes over): the original, which the slot's class forward would route back
    here."""
    forward = slot_class.forward
    return forward.__closure__[forward.__code__.co_freevars.index("func")].cell_contents


def _gated_mlp(mlp, x):
    facts = _runtime.facts("matmul_epilogue", mlp)
    gate, up = mlp.gate_proj, mlp.up_proj
    if facts is None or type(mlp.act_fn).__name__ != facts["act_class"] or not (
            type(gate) is nn.Linear and type(up) is nn.Linear and gate.bias is None
            and up.bias is None and not (gate._forward_hooks or gate._forward_pre_hooks
                                         or up._forward_hooks or up._forward_pre_hooks)):
        return type(mlp).forward(mlp, x)
    w_gate, w_up = gate.weight, up.weight
    if (x.dim() < 2 or x.shape[-1] != w_gate.shape[1] or x.dtype != w_gate.dtype
            or w_up.dtype != x.dtype or x.device != w_gate.device
            or _runtime.same_storage(w_gate, w_up) or _runtime.needs_graph(x, w_gate, w_up)):
        return type(mlp).forward(mlp, x)
    kernel = _gated_mlp_kernel(x.shape, w_gate.shape[1], w_gate.shape[0], x.dtype,
                               facts["act"])
    if kernel is None:
        return type(mlp).forward(mlp, x)
    out = torch.empty((*x.shape[:-1], w_gate.shape[0]), dtype=x.dtype, device=x.device)
    kernel(x, w_gate, w_up, out=out, act=facts["act"])
    return mlp.down_proj(out)


@functools.cache
def _gated_mlp_kernel(shape, hidden, cols, dtype, act):
    lead = tuple(shape[:-1])
    rows = 1
    for n in lead:
        rows *= n
    case = {"rows": rows, "hidden": hidden, "cols": cols, "dtype": _runtime.dtype_name(dtype),
            "act": act, "lead": "x".join(str(n) for n in lead)}
    return _runtime.choose("matmul_epilogue", case)
