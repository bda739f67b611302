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
import importlib
import inspect

import torch
from torch import nn

from . import _globals, _runtime

ROTARY = "apply_rotary_pos_emb"  # the global transformers' attentions call the rotary by


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


class RotaryAttention(nn.Module):
    """An attention module that calls transformers' `apply_rotary_pos_emb` by its global name
    (Llama's), as the `rope` family patches it where transformers gives the attention no
    rotary slot (`kernels` absent, or a version transformers does not take): the class's own
    forward, a copy whose `apply_rotary_pos_emb` is the package's rotary (`_globals.py`).
    The arguments are Llama's attention's; the cache goes on under whichever name the caller
    gave it (`past_key_values`, or transformers 5.2x's `cache`, in `kwargs`)."""

    has_backward = False
    can_torch_compile = True

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                past_key_values=None, **kwargs):
        forward = ROTARY_FORWARDS.get(type(self), type(self).forward)
        if past_key_values is None:
            return forward(self, hidden_states, position_embeddings, attention_mask, **kwargs)
        return forward(self, hidden_states, position_embeddings, attention_mask,
                       past_key_values, **kwargs)


class PreNormDecoderLayer(nn.Module):
    """A pre-norm decoder layer (Llama's: norm, attention, residual add, norm, MLP, residual
    add), as the `add_rmsnorm` family patches it: the residual add after the attention and the
    post-attention RMSNorm in one kernel. The submodules are called as the class's forward
    calls them, so their own layers (RMSNorm, RotaryAttention, GatedMLP) still apply."""

    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module
    self_attn: nn.Module
    mlp: nn.Module
    has_backward = False
    can_torch_compile = True

    def forward(self, hidden_states, attention_mask=None, position_ids=None,
                past_key_values=None, use_cache=False, position_embeddings=None, **kwargs):
        return _pre_norm_layer(self, hidden_states, attention_mask, position_ids,
                               past_key_values, use_cache, position_embeddings, kwargs)


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
    return _rotary_with(_runtime.facts("rope", slot), _plain(type(slot)), q, k, cos, sin,
                        unsqueeze_dim)


def rotary_function(facts: dict | None, original):
    """transformers' `apply_rotary_pos_emb` as the package runs it: the kernel for an accepted
    case, `original` otherwise (what `RotaryAttention`'s copy of the forward calls)."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        return _rotary_with(facts, original, q, k, cos, sin, unsqueeze_dim)

    return apply_rotary_pos_emb


def _rotary_forwards() -> dict:
    """{attention class: its forward, copied to call the package's rotary} for the classes
    the package's `RotaryAttention` was exported for. Made at import, before any trace: a
    trace calls the copy, it cannot make one."""
    out = {}
    spec = _runtime.SPEC["families"].get("rope")
    for found in spec["classes"] if spec else ():
        if found["facts"].get("via") != "attention":
            continue
        cls = getattr(importlib.import_module(found["module"]), found["class"], None)
        code = inspect.unwrap(getattr(cls, "forward", None))
        module_globals = getattr(code, "__globals__", None)
        if module_globals is None or not callable(module_globals.get(ROTARY)):
            continue
        rotary = rotary_function(found["facts"], module_globals[ROTARY])
        copy = _globals.reading_global_function(cls.forward, module_globals, ROTARY, rotary)
        if copy is not None:
            out[cls] = copy
    return out


def _rotary_with(facts, original, q, k, cos, sin, unsqueeze_dim):
    if (facts is None or unsqueeze_dim != 1 or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3
            or sin.shape != cos.shape or not q.dtype == k.dtype == cos.dtype == sin.dtype
            or cos.shape[-1] != q.shape[-1] or k.shape[0] != q.shape[0]
            or k.shape[2:] != q.shape[2:] or cos.shape[0] not in (1, q.shape[0])
            or cos.shape[1] != q.shape[2] or q.stride(1) > q.shape[3]
            or _runtime.same_storage(q, k) or _runtime.needs_graph(q, k, cos, sin)):
        return original(q, k, cos, sin, unsqueeze_dim)
    batch, heads, seq, head_dim = q.shape
    kernel = _rotary_kernel(batch, seq, heads, k.shape[1], head_dim, cos.shape[0], q.dtype,
                            facts["equal_halves"])
    if kernel is None:
        return original(q, k, cos, sin, unsqueeze_dim)
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


def _pre_norm_layer(layer, hidden_states, attention_mask, position_ids, past_key_values,
                    use_cache, position_embeddings, kwargs):
    facts = _runtime.facts("add_rmsnorm", layer)
    names = {"attention_mask": attention_mask, "position_ids": position_ids,
             "use_cache": use_cache, "position_embeddings": position_embeddings}
    if past_key_values is not None:  # else the caller's own name for it is in kwargs, if any
        names["past_key_values" if facts is None else facts["cache"]] = past_key_values
    residual = hidden_states
    weight = layer.post_attention_layernorm.weight
    norm = layer.post_attention_layernorm
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    if (facts is None or residual.dim() == 0 or residual.numel() == 0
            or residual.shape[-1] != weight.shape[0] or residual.device != weight.device
            or residual.dtype != weight.dtype or eps is None
            or (layer.training and getattr(layer, "gradient_checkpointing", False))
            or _runtime.needs_graph(residual, weight)):
        return type(layer).forward(layer, hidden_states, **names, **kwargs)
    hidden = weight.shape[0]
    kernel, params = _add_rms_norm_kernel(residual.numel() // hidden, hidden, residual.dtype,
                                          float(eps), facts["offset"], facts["cast_first"])
    if kernel is None:
        return type(layer).forward(layer, hidden_states, **names, **kwargs)
    attn_out = layer.self_attn(hidden_states=layer.input_layernorm(residual), **names,
                               **kwargs)[0]
    if attn_out.shape == residual.shape and attn_out.dtype == residual.dtype:
        residual_2d = residual.contiguous().view(-1, hidden)
        total, normed = torch.empty_like(residual_2d), torch.empty_like(residual_2d)
        kernel(attn_out.contiguous().view(-1, hidden), residual_2d, weight, out=(total, normed),
               **params)
        total, normed = total.view(residual.shape), normed.view(residual.shape)
    else:  # an attention that changed shape or dtype: the unfused code, op for op
        total = residual + attn_out
        normed = norm(total)
    return total + layer.mlp(normed)


@functools.cache
def _add_rms_norm_kernel(rows, hidden, dtype, eps, offset, cast_first):
    case = {"rows": rows, "hidden": hidden, "dtype": _runtime.dtype_name(dtype), "eps": eps,
            "offset": offset, "cast_first": cast_first}
    params = {"eps": eps, "offset": offset, "cast_first": cast_first,
              "sum_dtype": case["dtype"]}
    return _runtime.choose("add_rmsnorm", case), params


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


ROTARY_FORWARDS = _rotary_forwards()
