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
    family in the process. Not thread-safe; the pipeline runs one forward at a time."""

    def forward_with_global(*args, **kwargs):
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
