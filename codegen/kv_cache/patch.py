"""Patching the KV-cache append into a model: per attention instance, per call, reversible.

How HF reaches the append (transformers 5.17 to 5.24; Llama, Qwen2, Mistral, Gemma, Phi-3,
GPT-2): the attention's forward calls `cache.update(key_states, value_states, self.layer_idx,
...)` on the Cache its caller passes (keyword `cache`; `past_key_values` before 5.2x).
`Cache.update` adds missing layers, drives offloading, and calls
`self.layers[layer_idx].update(...)`, which for a DynamicLayer is the lazy initialization and
the two cats. Three ways in were weighed:

- rebinding `DynamicLayer.update` on the class: every cache in the process would take the
  kernel (the Liger leak);
- shadowing `update` on the Cache object: the dispatcher would have to repeat Cache.update
  (layer replication, offload streams), which differs between 5.17 and 5.24;
- what is done here: each attention instance gets an instance-level forward that, for the
  duration of its own call only, shadows `update` on the one DynamicLayer (or StaticLayer)
  object of its layer
  (`cache.layers[self.layer_idx]`) and restores it in a `finally`. Cache.update stays HF's
  code; only DynamicLayer.update's body is replaced, and only where it is, as a syntax tree,
  the code `reference.dynamic_layer_update` repeats. Other layer types (sliding window,
  static, quantized, chunked) keep their code, as does a layer that does not exist yet when
  the attention is called (a DynamicCache built without a config adds its layers inside
  Cache.update; HF's models build theirs from the config, all layers up front).

The dispatcher runs the layer's own `lazy_initialization` as update does (its side effects
differ by version: 5.17 also sets `layer.dtype` and gives the empty values the keys' dtype),
then the kernel writes fresh contiguous keys and values, which become `layer.keys` and
`layer.values` as cat's results would. Whatever the kernel would not compute exactly as cat
does (mixed dtypes or devices, shapes cat rejects, a graph autograd needs) and every case the
chooser declines goes to the original update. Not thread-safe, like the other adapters.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from functools import cache

import torch
from torch import nn

from codegen.dtypes import dtype_name
from codegen.kv_cache.reference import (
    INITIALISED_FROM_KEYS,
    dynamic_layer_update,
    make_case,
    make_static_case,
    params,
    state_layout,
    static_layer_update,
)
from core.family import Case, kernel_by_signature
from models.patching import (
    code_shape,
    joins_partial_rotary,
    needs_graph,
    wrap_instance_forwards,
)

CACHE_ARGS = ("cache", "past_key_values")  # the 5.2x name first, then the one it replaced
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _parameters(fn) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


@cache
def dynamic_layer() -> type | None:
    """transformers' DynamicLayer when its `update` is the code the dispatcher repeats."""
    try:
        from transformers.cache_utils import DynamicLayer

        same = (_parameters(DynamicLayer.update) == _parameters(dynamic_layer_update)
                and code_shape(DynamicLayer.update) == code_shape(dynamic_layer_update))
    except (ImportError, OSError, TypeError, ValueError):  # no such class, or no source
        return None
    return DynamicLayer if same else None


@cache
def static_layer() -> type | None:
    """transformers' StaticLayer when its `update` is the code the static dispatcher repeats
    (`reference.static_layer_update`); a layer class whose update differs keeps its code."""
    try:
        from transformers.cache_utils import StaticLayer

        same = (_parameters(StaticLayer.update) == _parameters(static_layer_update)
                and code_shape(StaticLayer.update) == code_shape(static_layer_update))
    except (ImportError, OSError, TypeError, ValueError):
        return None
    return StaticLayer if same else None


@cache
def initialised_attributes() -> tuple[str, ...] | None:
    """The attributes DynamicLayer.lazy_initialization copies from the key states, where its
    code is one the dispatcher knows (`INITIALISED_FROM_KEYS`), else None."""
    layer_type = dynamic_layer()
    if layer_type is None:
        return None
    try:
        shape = code_shape(layer_type.lazy_initialization)
    except (OSError, TypeError, ValueError):
        return None
    return next((attrs for known, attrs in INITIALISED_FROM_KEYS
                 if code_shape(known) == shape), None)


@cache
def _empty(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One kept `torch.tensor([])` per dtype and device: what lazy_initialization would make,
    for the kernel's argument checks only (with nothing cached it reads no row of it)."""
    return torch.empty(0, dtype=dtype, device=device)


def _cache_index(cls: type) -> int | None:
    """Position (after self) of the cache parameter of the class's forward, if it has one."""
    try:
        names = [name for name, _ in _parameters(cls.forward)][1:]
    except (TypeError, ValueError):
        return None
    return next((names.index(n) for n in CACHE_ARGS if n in names), None)


def find_cached_attentions(model: nn.Module) -> list[tuple[str, nn.Module, int]]:
    """(path, module, position of its cache argument) of every module with an integer
    `layer_idx` and a `head_dim` whose class forward takes a cache and calls an `update`."""
    found = []
    for path, module in model.named_modules():
        if not isinstance(getattr(module, "layer_idx", None), int) \
                or not hasattr(module, "head_dim"):
            continue
        code = getattr(inspect.unwrap(type(module).forward), "__code__", None)
        index = _cache_index(type(module))
        if code is not None and "update" in code.co_names and index is not None:
            found.append((path, module, index))
    return found


def _plain_layers(model: nn.Module) -> Callable[[int], bool]:
    """Whether layer i of the cache HF's models build for themselves (DynamicCache from the
    config) is a plain DynamicLayer."""
    layer_type = dynamic_layer()
    if layer_type is None:
        return lambda i: False
    from transformers.cache_utils import DynamicCache

    try:
        layers = DynamicCache(config=model.config).layers
    except (AttributeError, KeyError, TypeError, ValueError):  # a config it cannot read
        return lambda i: False
    if not layers:  # no layer types in the config: every layer is replicated as DynamicLayer
        return lambda i: True
    return lambda i: i < len(layers) and type(layers[i]) is layer_type


def cases_from_model(model: nn.Module, workload) -> list[Case]:
    """One case per distinct attention shape: a prefill appends `seq` positions to an empty
    cache, a decode step one position to `seq` cached ones (the decode runner crops back to
    `seq` after each step). A decode workload also has the static layout's one-position case:
    the step the graphs stage captures runs over a StaticCache (models.graphs)."""
    past, new = (0, workload.seq) if workload.mode == "prefill" else (workload.seq, 1)
    plain = _plain_layers(model)
    static = workload.mode == "decode" and static_layer() is not None
    cases = []
    for _, module, _ in find_cached_attentions(model):
        if not plain(module.layer_idx):
            continue
        config = module.config
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        found = [make_case(workload.batch, kv_heads, module.head_dim, past, new,
                           workload.dtype, states, config.num_attention_heads)
                 for states in predicted_states(module)]
        if static:
            found.append(make_static_case(workload.batch, kv_heads, module.head_dim, 1,
                                          workload.dtype))
        cases += [c for c in found if c not in cases]
    return cases


def predicted_states(module: nn.Module) -> list[tuple[str, str]]:
    """The layouts (reference.STATE_LAYOUTS) of the new keys and values this attention may hand
    the cache: column blocks of GPT-2's fused c_attn; for Phi-3's fused qkv_proj, the keys out
    of HF's rotary (its cat) and the values a column block, and both column blocks where the
    rope family's in-place kernel runs (predicting only the first, the patched set would make
    no kv_cache call and leave HF's cat in the pass);
    contiguous keys out of a partial rotary's cat (Phi-2, StableLM: `rotary_ndims` below the
    head); else transposed views of the projections (the rotary keeps the keys' layout)."""
    if hasattr(module, "c_attn"):
        return [("qkv", "qkv")]
    if hasattr(module, "qkv_proj"):
        return [("bhsd", "qkv"), ("qkv", "qkv")]
    if joins_partial_rotary(module):
        return [("bhsd", "bshd")]
    return [("bshd", "bshd")]


def _cropped_by(keys: torch.Tensor, values: torch.Tensor, past: int) -> int | None:
    """Positions beyond `past` in the buffer the cache is a view of (0: contiguous, 1: what a
    crop after one appended step leaves, the decode runner's steady state); None for any other
    layout, which no case verifies: cat runs there."""
    if past == 0:
        return 0
    b, h, _, d = keys.shape
    for extra in (0, 1):
        want = (h * (past + extra) * d, (past + extra) * d, d, 1)
        if keys.stride() == values.stride() == want and keys.storage_offset() == \
                values.storage_offset() == 0:
            return extra
    return None


def _cached_length(cached: torch.Tensor, shape: torch.Size) -> int | None:
    """Positions cached: 0 for lazy_initialization's `torch.tensor([])` (cat skips it), the
    seq axis of a cache that fits states of this shape, None where cat would raise."""
    if cached.dim() == 1 and cached.numel() == 0:
        return 0
    if cached.dim() == 4 and cached.shape[:2] == shape[:2] and cached.shape[3] == shape[3]:
        return cached.shape[2]
    return None


def _fits(keys, values, key_states, value_states) -> int | None:
    """The cached length where the kernel gives exactly cat's result, else None. Runs on
    every call: dtypes are compared by identity and devices as indices (cheap, no objects)."""
    if not (isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor)):
        return None
    if needs_graph(keys, values, key_states, value_states):
        return None  # the kernel's outputs carry no autograd history
    dtype = key_states.dtype
    if dtype not in DTYPES or not (value_states.dtype is keys.dtype is values.dtype is dtype):
        return None  # cat would promote; the kernel copies bits
    device = key_states.get_device()
    if not (value_states.get_device() == keys.get_device() == values.get_device() == device):
        return None
    shape = key_states.shape
    if len(shape) != 4 or value_states.shape != shape or values.shape != keys.shape:
        return None
    return _cached_length(keys, shape)


def kernel_resolver(forward_by_case: Callable) -> Callable:
    """(new states' shape, dtype, cached length, their layouts, query heads) -> (kernel or
    None, its params), once per signature."""

    def case_of(shape: torch.Size, dtype: torch.dtype, past: int, states: tuple,
                heads: int) -> Case:
        batch, kv_heads, new, head_dim = shape
        return make_case(batch, kv_heads, head_dim, past, new, dtype_name(dtype), states,
                         heads)

    return kernel_by_signature(forward_by_case, case_of, params)


def _states(key_states, value_states, heads: int) -> tuple | None:
    """The new states' layouts (reference.state_layout), or None for one no case describes;
    worked out once per geometry (a decode step calls this on every layer)."""
    return _states_of(key_states.shape, key_states.stride(), key_states.storage_offset(),
                      value_states.stride(), value_states.storage_offset(), heads)


@cache
def _states_of(shape, k_stride, k_offset, v_stride, v_offset, heads) -> tuple | None:
    batch, kv_heads, new, head_dim = shape
    probe = make_case(batch, kv_heads, head_dim, 0, new, "float32")
    probe["heads"] = heads
    got = (state_layout(shape, k_stride, k_offset, 0, probe),
           state_layout(shape, v_stride, v_offset, 1, probe))
    return None if None in got else got


def dispatching_update(layer, original: Callable, resolve: Callable, heads: int) -> Callable:
    """DynamicLayer.update of `layer`, the two cats sent to the kernel where one is given.

    A layer's first update (a prefill) runs lazy_initialization, whose two `torch.tensor([])`
    on the device cost host time (about 20 us each on the H200's host under cProfile) only to
    be replaced by the cats' results. Where its code is a known one, the dispatcher sets what
    it would leave instead, once the kernel is certain to run; otherwise, or without a kernel,
    HF's own code runs as before."""
    initialised = initialised_attributes()

    def update(key_states, value_states, *args, **kwargs):
        fresh = not layer.is_initialized
        if fresh and initialised is not None and "lazy_initialization" not in layer.__dict__:
            keys = values = _empty(key_states.dtype, key_states.device)
        else:
            if fresh:
                layer.lazy_initialization(key_states, value_states)
                fresh = False
            keys, values = layer.keys, layer.values
        past = _fits(keys, values, key_states, value_states)
        kernel = None
        if past is not None and _cropped_by(keys, values, past) is not None:
            states = _states(key_states, value_states, heads)
            if states is not None:
                kernel, kw = resolve(key_states.shape, key_states.dtype, past, states, heads)
        if kernel is None:  # the original initialises (if still needed) and cats
            return original(key_states, value_states, *args, **kwargs)
        if fresh:
            for name in initialised:
                setattr(layer, name, getattr(key_states, name))
            layer.is_initialized = True
        batch, kv_heads, new, head_dim = key_states.shape
        shape = (batch, kv_heads, past + new, head_dim)
        out = (key_states.new_empty(shape), key_states.new_empty(shape))
        kernel(keys, values, key_states, value_states, out=out, **kw)
        layer.keys, layer.values = out
        return out

    return update


def static_resolver(forward_by_case: Callable) -> Callable:
    """(new states' shape, dtype) -> (kernel or None, its params) of the static layout."""

    def case_of(shape: torch.Size, dtype: torch.dtype) -> Case:
        batch, kv_heads, new, head_dim = shape
        return make_static_case(batch, kv_heads, head_dim, new, dtype_name(dtype))

    return kernel_by_signature(forward_by_case, case_of, params)


# per StaticLayer, the kernel's ticket (see kernel._kv_static_kernel): allocated once, on the
# layer's first patched update (a warm-up before capture), so a captured step keeps its address
_TICKETS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@cache
def _advances(kernel) -> bool:
    """Whether a candidate's forward takes `ticket` (advances the position in its launch);
    one that does not gets HF's add_ after it. Wrappers that count calls keep the signature
    (functools.wraps), so this sees the candidate's own."""
    try:
        return "ticket" in inspect.signature(kernel).parameters
    except (TypeError, ValueError):
        return False


def static_dispatching_update(layer, original: Callable, resolve: Callable) -> Callable:
    """StaticLayer.update of `layer`: its two index_copy_, the arange and add that build
    their index, and the counter's add_ become one launch that reads `cumulative_length` and
    advances it on the device; nothing is read on the host, so a captured step stays a
    replayable step. Per Llama-3.2-1B step that is 16 x 5 aten kernels less 16 (the count in
    tests/codegen/test_static_decode.py). Of what the count left per layer (5 GEMMs, the
    mask's where, the MLP's residual add, the counter's add_), the add_ was the cheapest to
    remove: a few lines in a kernel we own, where fusing q/k/v into one GEMM is the matmul
    family's work and the mask's where and the residual add cross module boundaries. The
    first update (its lazy allocation), states that do not fit the buffers, and declined
    cases run HF's code."""

    def update(key_states, value_states, *args, **kwargs):
        if not layer.is_initialized or resolve.declines(key_states.shape, key_states.dtype):
            return original(key_states, value_states, *args, **kwargs)
        keys, values = layer.keys, layer.values
        shape = key_states.shape
        if _fits_static(keys, values, key_states, value_states, layer.cumulative_length):
            kernel, kw = resolve(shape, key_states.dtype)
        else:
            kernel = None
        if kernel is None:
            return original(key_states, value_states, *args, **kwargs)
        if _advances(kernel):
            ticket = _TICKETS.get(layer)
            if ticket is None or ticket.device != keys.device:
                ticket = _TICKETS[layer] = torch.zeros(1, dtype=torch.int32,
                                                       device=keys.device)
            kernel(keys, values, key_states, value_states, layer.cumulative_length,
                   out=(keys, values), ticket=ticket, **kw)
        else:
            kernel(keys, values, key_states, value_states, layer.cumulative_length,
                   out=(keys, values), **kw)
            layer.cumulative_length.add_(shape[-2])
        return keys, values

    return update


def _fits_static(keys, values, key_states, value_states, position) -> bool:
    """Where the kernel writes what index_copy_ would (index_copy_ raises on mixed dtypes)."""
    if not all(isinstance(t, torch.Tensor) for t in (keys, values, position)):
        return False
    if needs_graph(keys, values, key_states, value_states):
        return False
    dtype = key_states.dtype
    if dtype not in DTYPES or not (value_states.dtype is keys.dtype is values.dtype is dtype):
        return False
    device = key_states.get_device()
    if not (value_states.get_device() == keys.get_device() == values.get_device()
            == position.get_device() == device):
        return False
    shape = key_states.shape
    return (len(shape) == 4 and value_states.shape == shape and values.shape == keys.shape
            and keys.dim() == 4 and keys.shape[:2] == shape[:2] and keys.shape[3] == shape[3]
            and position.dtype is torch.int64 and position.numel() == 1)


_MISSING = object()


def _wrapper(module: nn.Module, index: int, forward_by_case: Callable) -> Callable:
    """The attention's forward with its layer's `update` shadowed for the call. Every
    attention call of a host-bound pass pays this, so it stays a few lookups: the cache
    argument by name, then by position, and the layer checked by exact type."""
    layer_idx = module.layer_idx
    heads = module.config.num_attention_heads
    resolvers = {}
    if dynamic_layer() is not None:
        resolve = kernel_resolver(forward_by_case)
        resolvers[dynamic_layer()] = lambda layer, update: dispatching_update(
            layer, update, resolve, heads)
    if static_layer() is not None:
        static_resolve = static_resolver(forward_by_case)
        resolvers[static_layer()] = lambda layer, update: static_dispatching_update(
            layer, update, static_resolve)
    first, second = CACHE_ARGS

    def wrap(below: Callable) -> Callable:
        def forward(*args, **kwargs):
            cache_obj = kwargs.get(first, _MISSING)
            if cache_obj is _MISSING:
                cache_obj = kwargs.get(second, _MISSING)
                if cache_obj is _MISSING:
                    cache_obj = args[index] if index < len(args) else None
            layers = getattr(cache_obj, "layers", None)
            if type(layers) is not list or not 0 <= layer_idx < len(layers):
                return below(*args, **kwargs)
            layer = layers[layer_idx]
            how = resolvers.get(type(layer))
            if how is None:
                return below(*args, **kwargs)
            own = layer.__dict__
            had, previous = "update" in own, own.get("update")
            layer.update = how(layer, layer.update)
            try:
                return below(*args, **kwargs)
            finally:
                if had:
                    layer.update = previous
                else:
                    del layer.update

        return forward

    return wrap


def patch(model: nn.Module, forward_by_case: Callable[[Case], Callable | None]):
    if dynamic_layer() is None and static_layer() is None:  # layer code we do not know
        return lambda: None
    return wrap_instance_forwards((module, _wrapper(module, index, forward_by_case))
                                  for _, module, index in find_cached_attentions(model))
