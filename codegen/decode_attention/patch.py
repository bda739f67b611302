"""Patching the decode-attention kernel into a model: per attention instance, reversible.

The way in is the attention family's (codegen/attention/patch.py explains the choice): each
attention instance gets an instance-level forward that, for its own call only, rebinds the
modeling module's ALL_ATTENTION_FUNCTIONS to a stand-in putting a dispatcher in front of
transformers' `sdpa_attention_forward`. This forward also notes the call's cache (`cache=` from
transformers 5.2x, `past_key_values=` before), because the attention function is not given it
and the kernel wants the layer's on-device length.

The dispatcher takes a call only where the kernel computes what sdpa_attention_forward would
(`_fits`): one query token, no dropout, softcap or position bias, and either no mask (a dynamic
cache: sdpa attends to every key) or a boolean mask of one row per sequence (HF's mask at a
static-cache step), which the kernel applies. Where the layer is a plain StaticLayer whose
buffers are the keys and values given, the kernel reads the valid length from its
`cumulative_length` (already advanced by this step's update) and never touches the slots past
it: HF's causal mask is False there, so nothing changes but the bytes read. Everything else,
a prefill included, goes to the original function unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from codegen.attention.patch import (
    DTYPES,
    GLOBAL_NAME,
    _Interfaces,
    _sdpa_forward,
    find_attentions,
    sdpa_attentions,
)
from codegen.decode_attention.reference import make_case, params
from codegen.dtypes import dtype_name
from core.family import Case, kernel_by_signature
from models.patching import needs_graph, wrap_instance_forwards


def _static_layer_type():
    try:
        from transformers.cache_utils import StaticLayer
    except ImportError:  # a transformers without static layers: every call is a dynamic one
        return None
    return StaticLayer


def device_length(cache, module: nn.Module, key: torch.Tensor, value: torch.Tensor):
    """The layer's on-device count of valid slots where the layer is a plain StaticLayer (not a
    sliding-window or indexed one, whose slots are not positions) and `key`/`value` are its own
    buffers; else None (the kernel then reads every slot of `key`)."""
    static = _static_layer_type()
    layers = getattr(cache, "layers", None)
    index = getattr(module, "layer_idx", None)
    if static is None or layers is None or index is None or not 0 <= index < len(layers):
        return None
    layer = layers[index]
    if type(layer) is not static or key is not getattr(layer, "keys", None) \
            or value is not getattr(layer, "values", None):
        return None
    length = getattr(layer, "cumulative_length", None)
    if not isinstance(length, torch.Tensor) or length.dim() != 0 or length.device != key.device:
        return None
    return length


def _mask_fits(mask, batch: int, slots: int) -> bool:
    return mask is None or (mask.dtype == torch.bool and mask.dim() == 4
                            and mask.shape[0] in (1, batch) and mask.shape[1] == 1
                            and mask.shape[2] == 1 and mask.shape[3] == slots)


def _fits(module: nn.Module, q, k, v, attention_mask, kwargs: dict) -> bool:
    """True where sdpa_attention_forward would attend one query token over k/v with at most a
    per-sequence boolean mask, so the kernel gives the same result."""
    if kwargs.get("position_bias") is not None or kwargs.get("dropout", 0.0):
        return False
    if kwargs.get("softcap") is not None or kwargs.get("output_attentions"):
        return False
    if needs_graph(q, k, v):
        return False
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or q.shape[2] != 1:
        return False
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in DTYPES:
        return False
    if not (q.device == k.device == v.device):
        return False
    batch, heads, _, head_dim = q.shape
    if heads != k.shape[1] * getattr(module, "num_key_value_groups", 1):
        return False
    if k.shape[0] != batch or k.shape[3] != head_dim or k.shape[2] == 0:
        return False
    if attention_mask is not None and attention_mask.device != q.device:
        return False
    window = kwargs.get("sliding_window")
    if window is not None and k.shape[2] > window:
        return False  # the brief's rule: windows keep HF's code
    return _mask_fits(attention_mask, batch, k.shape[2])


def dispatching_attention(original: Callable, resolve: Callable, cache) -> Callable:
    def attention_forward(module, query, key, value, attention_mask, **kwargs):
        if not _fits(module, query, key, value, attention_mask, kwargs):
            return original(module, query, key, value, attention_mask, **kwargs)
        batch, heads, _, head_dim = query.shape
        kernel, kw = resolve(batch, heads, key.shape[1], head_dim, key.shape[2], query.dtype,
                             kwargs.get("scaling"))
        if kernel is None:
            return original(module, query, key, value, attention_mask, **kwargs)
        out = torch.empty((batch, 1, heads, head_dim), dtype=query.dtype, device=query.device)
        kernel(query, key, value, device_length(cache, module, key, value), attention_mask,
               out=out, **kw)
        return out, None  # SDPA returns no attention weights either

    attention_forward.fronts_sdpa = True  # another adapter stacked above may front it in turn
    return attention_forward


def _resolver(forward_by_case: Callable[[Case], Callable | None]) -> Callable:
    def case_of(batch, heads, kv_heads, head_dim, slots, dtype, scaling) -> Case:
        return make_case(batch, heads, kv_heads, head_dim, slots, dtype_name(dtype), scaling)

    return kernel_by_signature(forward_by_case, case_of, params)


def several_queries(args: tuple, kwargs: dict) -> bool:
    """Whether the self-attention's call projects more than one query per sequence from its
    hidden_states [batch, seq, hidden] (a prefill): `_fits` would then decline in the
    attention function, so the call goes below without the stand-in being built."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    return isinstance(hidden, torch.Tensor) and hidden.dim() == 3 and hidden.shape[1] != 1


def _instance_forward(module_globals: dict, resolve: Callable) -> Callable:
    def wrap(below):
        def forward(*args, **kwargs):
            if several_queries(args, kwargs):
                return below(*args, **kwargs)
            cache = kwargs.get("cache", kwargs.get("past_key_values"))

            def front(fn):
                if fn is _sdpa_forward() or getattr(fn, "fronts_sdpa", False):
                    return dispatching_attention(fn, resolve, cache)
                return fn

            previous = module_globals[GLOBAL_NAME]
            module_globals[GLOBAL_NAME] = _Interfaces(previous, front)
            try:
                return below(*args, **kwargs)
            finally:
                module_globals[GLOBAL_NAME] = previous

        return forward

    return wrap


def cases_from_model(model: nn.Module, workload) -> list[Case]:
    """One case per distinct attention shape of a decode step over `seq` cached positions (a
    prefill has none: its queries are many). Only models configured with SDPA; a sliding
    window shorter than the cache keeps HF's code."""
    if workload.mode != "decode":
        return []
    cases = []
    for module, heads, kv_heads in sdpa_attentions(model, workload.seq + 1):
        case = make_case(workload.batch, heads, kv_heads, module.head_dim, workload.seq + 1,
                         workload.dtype, getattr(module, "scaling", None))
        if case not in cases:
            cases.append(case)
    return cases


def patch(model: nn.Module, forward_by_case: Callable[[Case], Callable | None]):
    resolve = _resolver(forward_by_case)
    return wrap_instance_forwards(
        (module, _instance_forward(module_globals, resolve))
        for _, module, module_globals in find_attentions(model))
