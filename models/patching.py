"""Per-instance, reversible module patching: the one mechanism every family's adapter uses.

A class-level patch leaks into every model built later in the process (seen with Liger), so
adapters only ever shadow `forward` on the instance, and undo restores exactly what was there.
Several adapters may stack forwards on one instance (rope, attention and kv_cache on the
attention modules); their undos may come in any order.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable

import torch
from torch import nn

from models.global_copy import reading_global


def needs_graph(*tensors: torch.Tensor) -> bool:
    """Whether a backward pass will need these tensors' autograd history: a kernel writes plain
    buffers with none, so the adapter then runs the original code instead."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def intercepted(module: nn.Module) -> bool:
    """Whether something runs around the module's forward when it is called: a hook of torch's,
    or accelerate's (which replaces the instance's forward and sets `_hf_hook`, to bring
    offloaded weights in). Plain lookups: adapters ask on every call."""
    return bool(module._forward_hooks or module._forward_pre_hooks
                or "_hf_hook" in module.__dict__)


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors view one storage. A torch.compile trace has no addresses (dynamo
    cannot read `data_ptr`); there, views of one buffer share their `_base`."""
    if torch.compiler.is_compiling():
        return a._base is not None and a._base is b._base
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class _InstanceForward:
    """One instance-level forward. Live, it runs `wrap(below)`; once undone it passes calls
    straight to `below`, so a forward stacked on top of it (another family's, which captured
    it as its own `below`) keeps working whichever of the two is undone first."""

    def __init__(self, module: nn.Module, wrap: Callable[[Callable], Callable]) -> None:
        self.had = "forward" in module.__dict__
        self.below = module.forward  # an earlier instance forward, or the bound class forward
        self.run = wrap(self.below)
        self.live = True
        state = self  # the installed function reads `run` at call time: undo re-points it

        def forward(*args, **kwargs):
            return state.run(*args, **kwargs)

        forward._instance_forward = self
        self.forward = forward
        module.forward = forward

    def undo(self, module: nn.Module) -> None:
        self.run, self.live = self.below, False
        if module.__dict__.get("forward") is not self.forward:
            return  # buried under a later forward: it now passes through
        had, below = self.had, self.below
        # put back the first live forward beneath, skipping ones undone while buried
        while had and not getattr(getattr(below, "_instance_forward", None), "live", True):
            layer = below._instance_forward
            had, below = layer.had, layer.below
        if had:
            module.forward = below
        else:
            del module.forward


# On an adapter's forward: every path returns what the module's own forward would (another
# kernel for the same function of the same parameters, with no side effect), so a caller that
# computes that function itself from the module's parameters may skip calling the module
SAME_RESULT = "same_result"


def only_same_result_forwards(module: nn.Module) -> bool:
    """Whether every live instance forward on `module` declares SAME_RESULT, down to the
    class's forward (none at all counts): skipping the module's call loses nothing but a
    kernel. An instance forward not installed through this module (accelerate's) does not."""
    forward = module.__dict__.get("forward")
    while forward is not None:
        layer = getattr(forward, "_instance_forward", None)
        if layer is None:
            return False
        if layer.live and not getattr(layer.run, SAME_RESULT, False):
            return False
        if not layer.had:
            break
        forward = layer.below
    return True


# On an adapter's forward, a function of the call's one tensor: the module's result computed
# in one launch with its siblings' (an attention's q/k/v projections), or None where it
# declines. A SAME_RESULT forward stacked above asks it first (`fused_below`), so the fusion
# happens whichever of the two adapters was installed last.
FUSED = "fused"


def fused_below(below: Callable) -> Callable | None:
    """The FUSED function of the first live FUSED forward `below` reaches through live
    SAME_RESULT ones only (undone layers pass calls through); None where there is none.
    Asked per call."""
    layer = getattr(below, "_instance_forward", None)
    while layer is not None:
        if layer.live:
            fused = getattr(layer.run, FUSED, None)
            if fused is not None:
                return fused
            if not getattr(layer.run, SAME_RESULT, False):
                return None
        if not layer.had:
            return None
        layer = getattr(layer.below, "_instance_forward", None)
    return None


# On an adapter's forward, a function (x, out) -> bool: out += the module's result for x,
# written in place in one launch (a residual add in a GEMV's epilogue), True where it did
ACCUMULATES = "accumulates"


def _layers_from_top(module: nn.Module):
    """The module's instance-forward layers (installed here), top first; stops at one that
    was not (accelerate's) or at the class's forward."""
    layer = getattr(module.__dict__.get("forward"), "_instance_forward", None)
    while layer is not None:
        yield layer
        if not layer.had:
            return
        layer = getattr(layer.below, "_instance_forward", None)


def accumulator(module: nn.Module) -> Callable | None:
    """The ACCUMULATES function of the first live forward on `module` declaring one, or None."""
    for layer in _layers_from_top(module):
        if layer.live and getattr(layer.run, ACCUMULATES, None) is not None:
            return getattr(layer.run, ACCUMULATES)
    return None


def reaches(module: nn.Module, forward: Callable) -> bool:
    """Whether a call of `module` reaches the instance forward `forward` (installed on it),
    through live SAME_RESULT forwards only, which pass it down (`fused_below`) where it is
    FUSED. Undone layers pass calls through."""
    for layer in _layers_from_top(module):
        if layer.forward is forward:
            return layer.live
        if layer.live and not getattr(layer.run, SAME_RESULT, False):
            return False
    return False


def wrap_instance_forward(module: nn.Module,
                          wrap: Callable[[Callable], Callable]) -> Callable[[], None]:
    """Shadow the forward on this instance only with `wrap(below)`, where `below` is what the
    instance ran until now (the class's forward, or another adapter's instance forward: rope,
    attention and kv_cache all wrap the same attention modules). Undos may come in any order:
    the last one leaves the instance as it was (no `forward` attribute, or the earlier one)."""
    layer = _InstanceForward(module, wrap)
    return lambda: layer.undo(module)


def set_instance_forward(module: nn.Module, forward: Callable) -> Callable[[], None]:
    """`wrap_instance_forward` for a forward that does not call the one below it."""
    return wrap_instance_forward(module, lambda _below: forward)


def _undo_all(undos: list[Callable[[], None]]) -> Callable[[], None]:
    def undo() -> None:
        for u in reversed(undos):
            u()
        undos.clear()

    return undo


def set_instance_forwards(replacements) -> Callable[[], None]:
    """`set_instance_forward` for each (module, forward); one undo restores all."""
    return _undo_all([set_instance_forward(module, forward) for module, forward in replacements])


def wrap_instance_forwards(wrappers) -> Callable[[], None]:
    """`wrap_instance_forward` for each (module, wrap); one undo restores all."""
    return _undo_all([wrap_instance_forward(module, wrap) for module, wrap in wrappers])


def with_global(forward: Callable, module_globals: dict, name: str,
                make_value: Callable) -> Callable:
    """`forward` with `module_globals[name]` set to make_value(previous) for the duration of its
    own call only: HF calls some functions (apply_rotary_pos_emb, ALL_ATTENTION_FUNCTIONS) by
    their global name, and rebinding the global for good would change every model of that
    family in the process. Not thread-safe; the pipeline runs one forward at a time.

    torch.compile cannot follow the swap: dynamo resolves the callee's global from the module's
    dict as it was, not as the swap left it (torch 2.13 traces the original function, silently;
    the recompile-limit warnings of the run in benchmarks/results/export-llama-3.2-1b-prefill-
    b8-s1024-1207-h100/h2h.log name this wrapper's frame). So under torch.compile the call goes
    to `reading_global`'s copy of the forward, whose code reads the value from globals of its
    own, and no dict is written."""
    traced = reading_global(forward, module_globals, name, make_value(module_globals[name]))

    def forward_with_global(*args, **kwargs):
        if traced is not None and torch.compiler.is_compiling():
            return traced(*args, **kwargs)
        previous = module_globals[name]
        module_globals[name] = make_value(previous)
        try:
            return forward(*args, **kwargs)
        finally:
            module_globals[name] = previous

    return forward_with_global


def plain_function(fn):
    """The function behind a Hub-kernels wrapper, else `fn`. With the `kernels` package
    installed (a dependency of transformers from 5.25), `@use_kernel_forward_from_hub` turns a
    module-level function such as `apply_rotary_pos_emb` into an `nn.Module` instance whose
    forward calls the original, `func` in its closure; adapters compare that function's code
    and signature with HF's."""
    forward = getattr(type(fn), "forward", None)
    code = getattr(forward, "__code__", None)
    if code is not None and "func" in code.co_freevars and forward.__closure__:
        inner = forward.__closure__[code.co_freevars.index("func")].cell_contents
        if inspect.isfunction(inner):
            return inner
    return fn


def code_shape(fn) -> str:
    """A function's body as a syntax tree, without its docstring, name or decorators: adapters
    compare it with the Hugging Face code the kernel reproduces, statement for statement."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(plain_function(fn)))))
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return ast.dump(ast.Module(body=body, type_ignores=[]))


def joins_partial_rotary(attention) -> bool:
    """The attention rotates only part of each head (`rotary_ndims` below `head_dim`: Phi-2,
    StableLM) and joins the parts again with a cat, so the q and k it hands on are contiguous."""
    head_dim = getattr(attention, "head_dim", None)
    return head_dim is not None and 0 < getattr(attention, "rotary_ndims", head_dim) < head_dim
