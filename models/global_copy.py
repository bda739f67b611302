"""A forward whose code reads one module-level global as another value, without touching the
module: `with_global` under torch.compile, and the attention layer of `pipeline export`'s
packages (which ship this file as `_globals.py`: it imports nothing but the standard library).

Hugging Face modelling code calls some functions by their global name (apply_rotary_pos_emb),
so no attribute of a module reaches them. Swapping the global for the duration of a call
works eagerly, but dynamo does not follow the swap; a copy of the function over globals of its
own does not need one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from types import CellType, FunctionType, MethodType


def reading_global(forward: Callable, module_globals: dict, name: str, value) -> Callable | None:
    """A copy of the bound method `forward` whose code, where it reads the global `name` of
    `module_globals`, reads `value` instead; wrappers around that code (transformers'
    `deprecate_kwarg`, `kernels`' `use_kernelized_func`) are copied with it, each closing over
    the copy beneath. The other globals are those of the moment of the call to this function
    (a name of the module rebound later is not seen by the copy). None where `forward` is no
    bound method (an instance forward of another adapter beneath) or nothing in its chain
    reads the global."""
    func, owner = getattr(forward, "__func__", None), getattr(forward, "__self__", None)
    if owner is None:
        return None
    copy = reading_global_function(func, module_globals, name, value)
    return None if copy is None else MethodType(copy, owner)


def _swapped(module_globals: dict, name: str, value) -> dict:
    swapped = dict(module_globals)
    swapped[name] = value
    # without a module name, dynamo guards these globals as this dict (its "unnamed scope"),
    # not as the module of that name, whose global is the original
    swapped.pop("__name__", None)
    return swapped


def _copy_chain(fn, module_globals: dict, name: str, swapped: dict):
    if fn.__globals__ is module_globals and name in fn.__code__.co_names:
        return _copy(fn, swapped, fn.__closure__)
    inner = getattr(fn, "__wrapped__", None)
    if not inspect.isfunction(inner) or not fn.__closure__:
        return None
    inner_copy = _copy_chain(inner, module_globals, name, swapped)
    if inner_copy is None:
        return None
    cells = tuple(CellType(inner_copy) if _holds(c, inner) else c for c in fn.__closure__)
    if all(a is b for a, b in zip(cells, fn.__closure__, strict=True)):
        return None  # the wrapper reaches the code some other way
    copy = _copy(fn, fn.__globals__, cells)
    copy.__wrapped__ = inner_copy
    return copy


def _holds(cell, value) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:  # an empty cell
        return False


def _copy(fn, fn_globals: dict, closure):
    copy = FunctionType(fn.__code__, fn_globals, fn.__name__, fn.__defaults__, closure)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__dict__.update(fn.__dict__)
    copy.__qualname__, copy.__module__ = fn.__qualname__, fn.__module__
    return copy


def reading_global_function(fn: Callable, module_globals: dict, name: str,
                            value) -> Callable | None:
    """`reading_global` for a plain function (a class's forward, unbound)."""
    if not inspect.isfunction(fn):
        return None
    return _copy_chain(fn, module_globals, name, _swapped(module_globals, name, value))
