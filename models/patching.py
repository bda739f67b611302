"""Per-instance, reversible module patching: the one mechanism every family's adapter uses.

A class-level patch leaks into every model built later in the process (seen with Liger), so
adapters only ever shadow `forward` on the instance, and undo restores exactly what was there.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable

from torch import nn


def set_instance_forward(module: nn.Module, forward: Callable) -> Callable[[], None]:
    """Shadow the class's forward on this instance only; the undo puts back exactly what was
    there (nothing, or an earlier instance-level forward)."""
    had = "forward" in module.__dict__
    previous = module.__dict__.get("forward")
    module.forward = forward

    def undo() -> None:
        if had:
            module.forward = previous
        else:
            del module.forward

    return undo


def set_instance_forwards(replacements) -> Callable[[], None]:
    """`set_instance_forward` for each (module, forward); one undo restores all, last first."""
    undos = [set_instance_forward(module, forward) for module, forward in replacements]

    def undo() -> None:
        for u in reversed(undos):
            u()
        undos.clear()

    return undo


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


def code_shape(fn) -> str:
    """A function's body as a syntax tree, without its docstring, name or decorators: adapters
    compare it with the Hugging Face code the kernel reproduces, statement for statement."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(fn))))
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return ast.dump(ast.Module(body=body, type_ignores=[]))
