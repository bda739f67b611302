"""Our kernels as torch custom ops, so a patched model compiles with `fullgraph=True`.

Eagerly an adapter calls the kernel its chooser gives it, through `codegen.launch`, whose
host path is a few microseconds: a custom op's Python dispatch would cost more than that on
every call of a launch-bound pass. Under torch.compile the same adapter code is traced, and
there each kernel call becomes one op per family, `torch.ops.kernel_pipeline.<family>(call,
inputs, outs)`, the same schema for every family. A kernel writes its `out` buffers and
nothing else (the contract the verifier checks; a family that works in place passes its
inputs as `out`), so those are what the op declares it mutates, and its fake implementation
writes nothing. Dynamo never reads a kernel's Python; Inductor calls the op, and the op calls
the kernel through the same launcher as eager.

`call` names one kernel and the layout of its arguments, fixed at trace time: the chooser is
asked once, outside the graph (`torch.compiler.assume_constant_result`), and the kernel it
gives is kept under that name. A family whose adapter cannot be traced says so
(`Family.traceable`): its chooser is left as it is, and compiled users are not offered it
(`pipeline.patching.for_compile`).

Self-contained (torch alone): `pipeline export` ships this file in its packages, with their
own namespace.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch

NAMESPACE = "kernel_pipeline"

# exact strides: the chooser picked the kernel for the strides the trace saw (a case carries
# them), so Inductor must hand the op tensors laid out as in eager
LAYOUT_TAG = getattr(torch.Tag, "needs_exact_strides", torch.Tag.needs_fixed_stride_order)

_ops: dict[str, Any] = {}
_choosers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_kernels: dict[str, Callable] = {}  # kernel name -> the chooser's kernel
_kernel_names: dict[tuple, str | None] = {}  # (chooser id, case) -> kernel name
_calls: dict[str, tuple] = {}  # call name -> (kernel, argument layout)
_call_names: dict[tuple, str] = {}  # (kernel name, layout) -> call name
_ids = itertools.count()


def family_op(name: str):
    """`torch.ops.kernel_pipeline.<name>`, defined on first use: (str call, Tensor[] inputs,
    Tensor(a!)[] outs) -> (), the same schema for every family."""
    op = _ops.get(name)
    if op is not None:
        return op

    def run(call: str, inputs: list[torch.Tensor], outs: list[torch.Tensor]) -> None:
        kernel, layout = _calls[call]
        args, out, params = _rebuild(layout, inputs, outs)
        kernel(*args, out=out, **params)

    op = torch.library.custom_op(f"{NAMESPACE}::{name}", run, mutates_args=("outs",),
                                 tags=(LAYOUT_TAG,))
    op.register_fake(lambda call, inputs, outs: None)
    _ops[name] = op
    return op


def compilable(family, chooser: Callable) -> Callable:
    """`chooser` as the adapters see it: unchanged eagerly; under torch.compile, each kernel
    it gives is called as the family's op. A family that declares itself untraceable gets
    `chooser` back as it is."""
    if not getattr(family, "traceable", True):
        return chooser
    family_op(family.name)
    cid = next(_ids)
    _choosers[cid] = chooser
    name = family.name

    def choose(case):
        if not torch.compiler.is_compiling():
            return chooser(case)
        kernel = _kernel_name(cid, tuple((k, _concrete(case[k])) for k in sorted(case)))
        if kernel is None:
            return None
        return functools.partial(_traced_call, name, kernel)

    choose.__wrapped__ = chooser
    return choose


@torch.compiler.assume_constant_result
def _kernel_name(cid: int, case: tuple) -> str | None:
    """The name the chooser's kernel for `case` is kept under, or None where it declines:
    asked at trace time, outside the graph (the chooser loads a source file)."""
    if (cid, case) not in _kernel_names:
        kernel = _choosers[cid](dict(case))
        name = None if kernel is None else f"k{len(_kernels)}"
        if name is not None:
            _kernels[name] = kernel
        _kernel_names[(cid, case)] = name
    return _kernel_names[(cid, case)]


@torch.compiler.assume_constant_result
def _call_name(kernel: str, layout: tuple) -> str:
    """The name one call's kernel and argument layout are kept under, for the op to read."""
    name = _call_names.get((kernel, layout))
    if name is None:
        name = _call_names[(kernel, layout)] = f"{kernel}/c{len(_calls)}"
        _calls[name] = (_kernels[kernel], layout)
    return name


def _traced_call(family: str, kernel: str, *args, out, **params) -> None:
    """One kernel call inside a trace: the tensors it writes (`out`) go to the op's mutable
    list, the rest to its inputs, and everything else into the layout the op rebuilds the
    call from."""
    written = _leaves(out)
    outs: list = []
    inputs: list = []
    layout = _layout((args, out, params), written, inputs, outs)
    family_op(family)(_call_name(kernel, layout), inputs, outs)


def _leaves(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _leaves(v)]
    return []


def _slot(t, pool: list) -> int | None:
    for i, u in enumerate(pool):
        if u is t:
            return i
    return None


def _layout(value, written: list, inputs: list, outs: list):
    """value with each tensor replaced by ("o", i) (written, outs[i]) or ("i", i) (inputs[i]),
    each distinct tensor listed once; other values kept as constants."""
    if isinstance(value, torch.Tensor):
        if _slot(value, written) is not None:
            i = _slot(value, outs)
            if i is None:
                outs.append(value)
                i = len(outs) - 1
            return ("o", i)
        i = _slot(value, inputs)
        if i is None:
            inputs.append(value)
            i = len(inputs) - 1
        return ("i", i)
    if isinstance(value, tuple):
        return ("t", tuple(_layout(v, written, inputs, outs) for v in value))
    if isinstance(value, list):
        return ("l", tuple(_layout(v, written, inputs, outs) for v in value))
    if isinstance(value, dict):
        return ("d", tuple((k, _layout(v, written, inputs, outs)) for k, v in value.items()))
    return ("c", _concrete(value))


def _concrete(value):
    """`value` as a plain number where the trace holds it as a symbol (torch.compile's dynamic
    shapes; dynamo shows such a symbol as an int to `isinstance`, so every number passes
    here). Formatting a symbol specialises the graph on it, guarded: kernels are chosen per
    exact case, so a graph that calls one holds for that shape only."""
    if isinstance(value, (tuple, list)):
        return type(value)(_concrete(v) for v in value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    return int(f"{value}") if isinstance(value, int) else float(f"{value}")


def _rebuild(layout, inputs: list, outs: list):
    kind, body = layout
    if kind == "o":
        return outs[body]
    if kind == "i":
        return inputs[body]
    if kind == "t":
        return tuple(_rebuild(v, inputs, outs) for v in body)
    if kind == "l":
        return [_rebuild(v, inputs, outs) for v in body]
    if kind == "d":
        return {k: _rebuild(v, inputs, outs) for k, v in body}
    return body
