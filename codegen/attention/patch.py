"""Patching the attention kernel into a model: per attention instance, reversible.

How HF picks the attention function (transformers 5.x, Llama/Qwen2/Mistral and most decoders):
the attention module's forward calls
`ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)`,
where `ALL_ATTENTION_FUNCTIONS` is a module global of `modeling_<family>` (imported from
modeling_utils). Three ways in were weighed:

- registering a function under a private name with `AttentionInterface.register` and giving the
  instance a shallow-copied config naming it: the registration is class-level (process-wide)
  state, and a copied config stops following the model's own (`model.set_attn_implementation`
  would no longer reach the patched layers) and breaks `module.config is model.config`;
- rebinding `ALL_ATTENTION_FUNCTIONS["sdpa"]` or the module global for good: leaks into every
  model of the process (the Liger problem);
- what is done here, as the rope adapter does: each attention instance gets an instance-level
  forward that, for the duration of its own call only, rebinds the module global
  `ALL_ATTENTION_FUNCTIONS` to a thin stand-in, restored in a `finally`. The stand-in resolves
  the configured function through the real mapping at call time, and only when that is
  transformers' `sdpa_attention_forward` hands back a dispatcher in front of it. Config, the
  mapping and other instances are never touched; between calls the global is the original.
  (Not thread-safe, like the rope adapter: the pipeline runs one forward at a time.)

The dispatcher takes a call only where the kernel computes exactly what SDPA would (see `_fits`):
HF's unpadded prefill, where the mask builder drops the mask (attention_mask is None) and SDPA
runs with is_causal. Everything else goes to the original function unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn

from codegen.attention.reference import head_layout, make_case, params
from codegen.dtypes import dtype_name
from core.family import Case
from models.patching import (
    joins_partial_rotary,
    needs_graph,
    with_global,
    wrap_instance_forwards,
)

GLOBAL_NAME = "ALL_ATTENTION_FUNCTIONS"
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _sdpa_forward() -> Callable:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def _forward_globals(module: nn.Module) -> dict | None:
    """The globals the class's forward resolves names in, when it picks its attention function
    through ALL_ATTENTION_FUNCTIONS."""
    fn = inspect.unwrap(type(module).forward)
    code = getattr(fn, "__code__", None)
    if code is None or GLOBAL_NAME not in code.co_names:
        return None
    return fn.__globals__ if GLOBAL_NAME in fn.__globals__ else None


def find_attentions(model: nn.Module) -> list[tuple[str, nn.Module, dict]]:
    """(path, module, module globals) of every causal self-attention that dispatches through
    ALL_ATTENTION_FUNCTIONS."""
    found = []
    for path, module in model.named_modules():
        if not getattr(module, "is_causal", False) or not hasattr(module, "head_dim"):
            continue
        module_globals = _forward_globals(module)
        if module_globals is not None:
            found.append((path, module, module_globals))
    return found


def _sliding_window(module: nn.Module) -> int | None:
    """The window HF passes as `sliding_window` (Qwen2 keeps it per layer, Mistral in config)."""
    if hasattr(module, "sliding_window"):
        return module.sliding_window
    return getattr(getattr(module, "config", None), "sliding_window", None)


def sdpa_attentions(model: nn.Module, keys: int) -> list[tuple[nn.Module, int, int]]:
    """(module, heads, kv heads) of each attention configured with SDPA whose sliding window,
    if any, covers `keys` keys: the calls a kernel of ours may take (a shorter window makes HF
    pass a mask, and other implementations keep their own code)."""
    out = []
    for _, module, _ in find_attentions(model):
        config = module.config
        if getattr(config, "_attn_implementation", None) != "sdpa":
            continue
        window = _sliding_window(module)
        if window is not None and keys > window:
            continue
        heads = config.num_attention_heads
        out.append((module, heads, getattr(config, "num_key_value_heads", None) or heads))
    return out  # (GPT-2's config has no num_key_value_heads)


def cases_from_model(model: nn.Module, workload) -> list[Case]:
    """One case per distinct attention shape of a prefill. A decode step has none: its single
    query attends to the cached keys (q_len 1 != k_len), which is not the causal square this
    kernel computes, so the dispatcher hands every decode call to the original function and no
    kernel is ever asked for. Nor has a model configured other than with SDPA, or a prefill
    longer than a sliding window (HF then passes a mask): those calls also keep HF's code."""
    if workload.mode != "prefill":
        return []
    cases = []
    for module, heads, kv_heads in sdpa_attentions(model, workload.seq):
        case = make_case(workload.batch, workload.seq, heads, kv_heads, module.head_dim,
                         workload.dtype, getattr(module, "scaling", None),
                         predicted_layouts(module))
        if case not in cases:
            cases.append(case)
    return cases


def predicted_layouts(module: nn.Module) -> tuple[str, str, str]:
    """q's, k's and v's layout in the profiled prefill (reference.HEAD_LAYOUTS): k and v come
    out of the cache update (cat, or the kv_cache kernel: contiguous either way) where the
    model caches, else from their projections; q is a column block of GPT-2's fused c_attn,
    Phi-3's rotary cat result (a fused qkv_proj with HF's rotary; the rope family's in-place
    kernel leaves it a column block instead, a layout without a case, so SDPA runs there),
    the cat of a partial rotary's two parts (Phi-2, StableLM), or else a transposed view of
    its projection."""
    fused = "qkv" if hasattr(module, "c_attn") else None
    rotary_cat = hasattr(module, "qkv_proj") or joins_partial_rotary(module)
    q = fused or ("bhsd" if rotary_cat else "bshd")
    cached = getattr(getattr(module, "config", None), "use_cache", True)
    kv = "bhsd" if cached else (fused or "bshd")
    return q, kv, kv


def _fits(module: nn.Module, q, k, v, attention_mask, kwargs: dict) -> bool:
    """True where sdpa_attention_forward would run plain causal SDPA on q, k, v, so the kernel
    gives the same result; anything else keeps HF's code (and its errors)."""
    if attention_mask is not None or kwargs.get("position_bias") is not None:
        return False  # padding, sliding-window or custom masks: not the pure causal case
    if kwargs.get("dropout", 0.0) or kwargs.get("softcap") is not None:
        return False
    if kwargs.get("output_attentions"):
        return False  # HF warns that SDPA returns no weights; keep that
    if kwargs.get("is_causal") is False or not getattr(module, "is_causal", True):
        return False
    if needs_graph(q, k, v):
        return False  # the kernel's output carries no autograd history
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        return False
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in DTYPES:
        return False
    if not (q.device == k.device == v.device):
        return False
    batch, heads, seq, head_dim = q.shape
    kv_heads = k.shape[1]
    # SDPA groups heads only as the module declares; other head counts raise there, as they
    # should. q_len != k_len is decode (or a prefill after a cached prefix): not causal square.
    if heads != kv_heads * getattr(module, "num_key_value_groups", 1):
        return False
    if k.shape[0] != batch or k.shape[2] != seq or k.shape[3] != head_dim or seq == 0:
        return False
    window = kwargs.get("sliding_window")
    return window is None or seq <= window


def case_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float | None
            ) -> Case | None:
    """The call's case, the layouts of q, k and v included (a kernel runs only on the layouts
    it was verified on); None for a layout no case describes."""
    batch, heads, seq, head_dim = q.shape
    case = make_case(batch, seq, heads, k.shape[1], head_dim, dtype_name(q.dtype), scaling)
    layouts = tuple(head_layout(t, role, case) for role, t in enumerate((q, k, v)))
    if None in layouts:
        return None
    return make_case(batch, seq, heads, k.shape[1], head_dim, dtype_name(q.dtype), scaling,
                     layouts)


def dispatching_attention(original: Callable, forward_by_case: Callable) -> Callable:
    def attention_forward(module, query, key, value, attention_mask, **kwargs):
        if not _fits(module, query, key, value, attention_mask, kwargs):
            return original(module, query, key, value, attention_mask, **kwargs)
        case = case_of(query, key, value, kwargs.get("scaling"))
        kernel = None if case is None else forward_by_case(case)
        if kernel is None:
            return original(module, query, key, value, attention_mask, **kwargs)
        batch, heads, seq, head_dim = query.shape
        out = torch.empty((batch, seq, heads, head_dim), dtype=query.dtype, device=query.device)
        kernel(query, key, value, out=out, **params(case))
        return out, None  # SDPA returns no attention weights either

    attention_forward.fronts_sdpa = True
    return attention_forward


class _Interfaces:
    """Stands in for ALL_ATTENTION_FUNCTIONS during one patched instance's call: looks the
    configured function up in the real mapping, then puts the dispatcher in front of SDPA."""

    def __init__(self, real, wrap: Callable[[Callable], Callable]) -> None:
        self._real, self._wrap = real, wrap

    def get_interface(self, attn_implementation, default):
        return self._wrap(self._real.get_interface(attn_implementation, default))

    def __getitem__(self, key):
        return self._wrap(self._real[key])

    def get(self, key, default=None):
        return self._wrap(self._real.get(key, default))

    def __contains__(self, key) -> bool:
        return key in self._real

    def __getattr__(self, name):
        return getattr(self._real, name)


def _wrapper(forward_by_case: Callable) -> Callable:
    def wrap(fn):
        # a dispatcher of another family stacked beneath (decode_attention) fronts SDPA too
        fronts = fn is _sdpa_forward() or getattr(fn, "fronts_sdpa", False)
        return dispatching_attention(fn, forward_by_case) if fronts else fn

    return lambda previous: _Interfaces(previous, wrap)


def patch(model: nn.Module, forward_by_case: Callable[[Case], Callable | None]):
    return wrap_instance_forwards(
        (module, lambda below, g=module_globals: with_global(below, g, GLOBAL_NAME,
                                                             _wrapper(forward_by_case)))
        for _, module, module_globals in find_attentions(model))
