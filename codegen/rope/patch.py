"""Patching the fused rotary embedding into a model: per attention instance, reversible.

`apply_rotary_pos_emb` is a module-level function of
`transformers.models.<family>.modeling_<family>`
that the attention's forward calls by its global name, so Python looks it up in that module's
globals at call time. No attribute of the attention instance reaches it, and rebinding the
module global for good would change every model of that family in the process (the leak seen
with Liger's class-level patches). So each attention instance gets an instance-level forward
that swaps the global for a dispatching version for the duration of its own call and restores
it in a `finally`; between calls, and for other models, the module global is the original.
(Not thread-safe: two threads running forwards of the same family at once could see each
other's swap; the pipeline runs one forward at a time.)

An attention module is patched only when its module's `apply_rotary_pos_emb` and `rotate_half`
are, statement for statement, Llama's, Phi-3's, GPT-NeoX's (Phi-3's computation with named
intermediates) or OLMo-2's (Llama's, cast back to the inputs' dtype), compared as syntax trees,
docstrings aside: that is what the kernel computes.
Other variants (interleaved, multimodal sections) keep their own code.

Where the attention's forward is, statement for statement, one of the HF forwards listed in
`_in_place_forwards` (Llama, Qwen2, Mistral, Gemma, Phi-3), the rotation is written over q and
k themselves, as Liger-Kernel's does: those forwards build q and k from their projections and
rebind both names to the result at once, so nothing else holds the unrotated tensors. In
place saves the output allocation and a few percent of the kernel's time, and
the verifier checks every candidate gives the same bits when `out` is its inputs (`in_place`).
Any other forward gets new tensors, as HF's function returns.

Where transformers gives each attention its own rotary slot (`use_kernelized_func`, with the
`kernels` package installed: `attention._kernel_funcs["rotary_pos_emb"]`), the rotary
goes into that slot's forward instead, as `kernels.kernelize` puts a layer there: torch.compile
traces through the slot, while a global swapped during the call is one it never reads.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import cache
from types import MethodType

import torch
from torch import nn

from codegen.dtypes import dtype_name
from codegen.rope.reference import make_case, params
from core.family import Case, kernel_by_signature
from models.patching import (
    code_shape,
    plain_function,
    same_storage,
    with_global,
    wrap_instance_forwards,
)

GLOBAL_NAME = "apply_rotary_pos_emb"


def _signature(fn) -> str:
    return str(inspect.signature(inspect.unwrap(plain_function(fn))))


@cache
def _known_forms() -> dict[tuple[str, str, str], str]:
    from transformers.models.gpt_neox import modeling_gpt_neox
    from transformers.models.llama import modeling_llama
    from transformers.models.olmo2 import modeling_olmo2
    from transformers.models.phi3 import modeling_phi3

    # GPT-NeoX's function is Phi-3's computation spelled with named intermediates; OLMo-2's is
    # Llama's with its results cast back to q's and k's dtypes, which `_fits` requires cos and
    # sin to share (the cast is then none)
    return {(_signature(m.apply_rotary_pos_emb), code_shape(m.apply_rotary_pos_emb),
             code_shape(m.rotate_half)): form
            for m, form in ((modeling_llama, "full"), (modeling_olmo2, "full"),
                            (modeling_phi3, "partial"), (modeling_gpt_neox, "partial"))}


@cache
def _in_place_forwards() -> frozenset:
    from transformers.models.gemma.modeling_gemma import GemmaAttention
    from transformers.models.llama.modeling_llama import LlamaAttention
    from transformers.models.mistral.modeling_mistral import MistralAttention
    from transformers.models.phi3.modeling_phi3 import Phi3Attention
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

    return frozenset(code_shape(c.forward) for c in (LlamaAttention, Qwen2Attention,
                                                     MistralAttention, GemmaAttention,
                                                     Phi3Attention))


@cache
def _known_tables() -> frozenset:
    from transformers.models.gemma.modeling_gemma import GemmaRotaryEmbedding
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    from transformers.models.mistral.modeling_mistral import MistralRotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    return frozenset(code_shape(c.forward) for c in (
        LlamaRotaryEmbedding, Qwen2RotaryEmbedding, MistralRotaryEmbedding, GemmaRotaryEmbedding,
        Phi3RotaryEmbedding))


def tables_have_equal_halves(model: nn.Module) -> bool:
    """Every rotary embedding in the model is, statement for statement, one of the installed
    HF ones listed in `_known_tables`, each of whose forwards builds the cos/sin rows as
    cat(freqs, freqs) (rope scaling only changes inv_freq): the kernel may then read half of
    each row. The list is per class, not Llama's alone: in transformers 5.17 Qwen2's forward
    differs from Llama's by a `.float()` (found on the H200, where the comparison
    with Llama's alone left Qwen2.5-0.5B without the half-table kernel). A model without a
    rotary embedding (tables made elsewhere) or with other code: False."""
    tables = {type(m) for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")}
    return bool(tables) and all(builds_equal_halves(cls) for cls in tables)


@cache
def builds_equal_halves(cls: type) -> bool:
    """The rotary embedding class's forward is one of `_known_tables`."""
    try:
        return code_shape(cls.forward) in _known_tables()
    except (OSError, TypeError, ValueError):  # no source to compare
        return False


@cache
def in_place_ok(cls: type) -> bool:
    """The class's forward is one whose q and k nothing else holds (see the module doc)."""
    try:
        return code_shape(cls.forward) in _in_place_forwards()
    except (OSError, TypeError):  # no source to compare
        return False


def rotary_form(module_globals: dict) -> str | None:
    """"full" (Llama's code), "partial" (Phi-3's) or None for the module owning these globals."""
    fn, half = module_globals.get(GLOBAL_NAME), module_globals.get("rotate_half")
    if not callable(fn) or not callable(half):
        return None
    try:
        key = (_signature(fn), code_shape(fn), code_shape(half))
    except (OSError, TypeError, ValueError):  # no source to compare
        return None
    return _known_forms().get(key)


def _forward_globals(module: nn.Module) -> dict | None:
    """The globals the class's forward resolves names in, when it calls the rotary by name."""
    fn = inspect.unwrap(type(module).forward)
    code = getattr(fn, "__code__", None)
    if code is None or GLOBAL_NAME not in code.co_names:
        return None
    return fn.__globals__


def find_rotary_attentions(model: nn.Module) -> list[tuple[str, nn.Module, dict, str]]:
    """(path, module, module globals, form) of every attention that applies a known rotary."""
    found = []
    for path, module in model.named_modules():
        module_globals = _forward_globals(module)
        if module_globals is None:
            continue
        form = rotary_form(module_globals)
        if form is not None:
            found.append((path, module, module_globals, form))
    return found


def _rot_dim(model: nn.Module, head_dim: int) -> int:
    """The rotary width, from the rotary embedding's inverse frequencies (one per dim pair);
    Phi-3's partial_rotary_factor shows up there as fewer of them."""
    for module in model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if isinstance(inv_freq, torch.Tensor) and inv_freq.dim() == 1:
            return 2 * inv_freq.numel()
    return head_dim


def cases_from_model(model: nn.Module, workload) -> list[Case]:
    """One case per distinct attention shape. Position ids built by the model have batch 1,
    so cos/sin do too (cos_batch=1); a decode step rotates one position per sequence. At
    batch > 1 transformers' `generate` passes per-row position ids (from the attention mask,
    for left padding), so cos/sin carry the batch there: that is a case too, or rope would
    decline every call of a batched generation."""
    seq = workload.seq if workload.mode == "prefill" else 1
    halves = tables_have_equal_halves(model)
    cases = []
    for _, module, _, form in find_rotary_attentions(model):
        config = module.config
        # GPT-NeoX names it head_size
        head_dim = getattr(module, "head_dim", None) or module.head_size
        rot_dim = _rot_dim(model, head_dim)
        width = None
        if form == "full" and rot_dim < head_dim:
            # Llama's function rotates all it is given: a partial rotary with it (Phi-2,
            # StableLM) slices q and k to the rotary width before the call
            head_dim, width = rot_dim, head_dim
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        for cos_batch in dict.fromkeys((1, workload.batch)):
            case = make_case(workload.batch, seq, config.num_attention_heads, kv_heads,
                             head_dim, rot_dim, workload.dtype, cos_batch, equal_halves=halves,
                             qkv=fused_qkv(module), head_width=width,
                             interleaved=hasattr(module, "query_key_value"))
            if case not in cases:
                cases.append(case)
    return cases


def fused_qkv(module: nn.Module) -> bool:
    """The attention projects q, k and v with one Linear (Phi-3's qkv_proj, GPT-NeoX's
    query_key_value), so q and k reach the rotary as slices of one buffer."""
    return any(isinstance(getattr(module, name, None), nn.Linear)
               for name in ("qkv_proj", "query_key_value"))


def _layout(q: torch.Tensor, k: torch.Tensor) -> tuple[bool, bool, int | None] | None:
    """(qkv, interleaved, head_width) of the case keys (reference.make_case) for q and k as
    given, or None for views of heads wider than they are that no case describes."""
    shared = same_storage(q, k)
    heads, seq, dim = q.shape[1], q.shape[2], q.shape[3]
    interleaved = shared and heads > 1 and k.storage_offset() - q.storage_offset() == dim
    width = q.stride(1)
    if shared or width <= dim or not (seq == 1 or q.stride(2) == heads * width):
        return shared, interleaved, None
    return (False, False, width) if k.stride(1) == width else None


def _fits(form: str, q, k, cos, sin, unsqueeze_dim) -> bool:
    """Calls the kernel handles exactly as the HF function would; others keep HF's code
    (including its errors, e.g. Llama's form given a partial cos)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, cos, sin)):
        return False  # the kernel's outputs carry no autograd history
    if unsqueeze_dim != 1 or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3:
        return False
    if sin.shape != cos.shape or not (q.dtype == k.dtype == cos.dtype == sin.dtype):
        return False
    batch, _, seq, head_dim = q.shape
    rot = cos.shape[-1]
    if rot % 2 or rot > head_dim or (form == "full" and rot != head_dim):
        return False
    return (k.shape[0] == batch and k.shape[2:] == q.shape[2:]
            and cos.shape[0] in (1, batch) and cos.shape[1] == seq)


def dispatching_rotary(original: Callable, form: str, forward_by_case: Callable,
                       in_place: bool = False, equal_halves: bool = False) -> Callable:
    def case_of(q_shape, kv_heads, cos_batch, rot_dim, dtype, layout) -> Case:
        batch, heads, seq, head_dim = q_shape
        qkv, interleaved, width = layout
        return make_case(batch, seq, heads, kv_heads, head_dim, rot_dim, dtype_name(dtype),
                         cos_batch, equal_halves, qkv, width, interleaved)

    resolve = kernel_by_signature(forward_by_case, case_of, params)

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        if not _fits(form, q, k, cos, sin, unsqueeze_dim):
            return original(q, k, cos, sin, unsqueeze_dim)
        layout = _layout(q, k)
        if layout is None:
            return original(q, k, cos, sin, unsqueeze_dim)
        kernel, kw = resolve(q.shape, k.shape[1], cos.shape[0], cos.shape[-1], q.dtype, layout)
        if kernel is None:
            return original(q, k, cos, sin, unsqueeze_dim)
        # Out of place, empty_like keeps q's (batch, seq, heads, dim) memory order, as HF's
        # elementwise result does, so downstream attention sees the layout it sees unpatched.
        out = (q, k) if in_place else (torch.empty_like(q), torch.empty_like(k))
        kernel(q, k, cos, sin, out=out, **kw)
        return out

    return apply_rotary_pos_emb


def whole_table_fallback(forward_by_case: Callable[[Case], Callable | None]) -> Callable:
    """A half-table case with no kernel takes the kernel of the same case without the key: a
    kernel that reads whole rows is right for equal halves too (a run searched before the key
    existed, or a caller that searched only general cases, keeps its rotary kernel)."""
    def choose(case: Case):
        kernel = forward_by_case(case)
        if kernel is None and case.get("equal_halves"):
            kernel = forward_by_case({k: v for k, v in case.items() if k != "equal_halves"})
        return kernel
    return choose


def patch(model: nn.Module, forward_by_case: Callable[[Case], Callable | None]):
    wrappers, slots, halves = [], [], tables_have_equal_halves(model)
    choose = whole_table_fallback(forward_by_case)
    for _, module, module_globals, form in find_rotary_attentions(model):
        slot = rotary_slot(module, module_globals[GLOBAL_NAME])
        original = module_globals[GLOBAL_NAME] if slot is None else plain_function(slot)
        rotary = dispatching_rotary(original, form, choose, in_place_ok(type(module)), halves)
        if slot is not None:
            slots.append(_into_slot(slot, rotary))
        else:
            wrappers.append((module, lambda below, g=module_globals, r=rotary: with_global(
                below, g, GLOBAL_NAME, lambda _previous: r)))
    undo_wrappers = wrap_instance_forwards(wrappers)

    def undo() -> None:
        undo_wrappers()
        while slots:
            slots.pop()()

    return undo


def rotary_slot(attention: nn.Module, rotary) -> nn.Module | None:
    """The attention's own instance of the global rotary module `rotary` (transformers'
    `use_kernelized_func` keeps one per attention, by its kernel layer name), if any."""
    for slot in attention.__dict__.get("_kernel_funcs", {}).values():
        if type(slot) is type(rotary) and isinstance(slot, nn.Module) \
                and "forward" not in slot.__dict__:
            return slot
    return None


def _into_slot(slot: nn.Module, rotary: Callable) -> Callable[[], None]:
    """`rotary` as the slot's forward, a bound method as `kernels` installs one (it reads the
    slot's `forward.__func__`); the undo gives the slot its class's forward back."""
    slot.forward = MethodType(lambda _self, *args, **kwargs: rotary(*args, **kwargs), slot)
    return lambda: slot.__dict__.pop("forward", None)
