"""The dispatch this package's layers go through (exported by kernel-pipeline's `pipeline
export`; this file is its `_runtime.py`).

`kernels.json` lists, per kernel family, the exact cases a kernel was accepted for (on the
run's device, for the workloads it names), the module under `_kernels/` holding that kernel,
and the Hugging Face classes the layers were exported for, with what each layer must know of
them (`facts`). A call whose case is not listed, or a module of another class, runs the
original forward. Under torch.compile each kernel call is one custom op of this package's
namespace (`_ops.py`), which Inductor calls; Dynamo never reads the kernel's Python.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
from pathlib import Path

import torch

from . import _ops

SPEC = json.loads(Path(__file__).with_name("kernels.json").read_text())


class _Family:
    """What `_ops.compilable` reads of a family."""

    traceable = True

    def __init__(self, name: str):
        self.name = name


def _case_key(case: dict) -> tuple:
    return tuple(sorted(case.items()))


@functools.cache
def _load(module: str):
    if not torch.cuda.is_available():
        # Triton's interpreter reads its switch when a kernel is defined, as it is imported
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return importlib.import_module(f"._kernels.{module}", __package__).forward


def _chooser(family: str):
    by_case = {_case_key(k["case"]): k["module"] for k in SPEC["families"][family]["kernels"]}

    def choose(case: dict):
        module = by_case.get(_case_key(case))
        return None if module is None else _load(module)

    return _ops.compilable(_Family(family), choose)


# made at import, before any trace: a trace calls them, it cannot build them
CHOOSERS = {family: _chooser(family) for family in SPEC["families"]}
FACTS = {family: {(c["module"], c["class"]): c["facts"] for c in spec["classes"]}
         for family, spec in SPEC["families"].items()}


def facts(family: str, module: torch.nn.Module) -> dict | None:
    """What the export found of the module's class, or None for a class it was not exported
    for (the layer then runs the original forward)."""
    cls = type(module)
    return FACTS[family].get((cls.__module__, cls.__qualname__))


def choose(family: str, case: dict):
    """The accepted kernel for exactly `case`, or None."""
    return CHOOSERS[family](case)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def needs_graph(*tensors: torch.Tensor) -> bool:
    """Autograd needs these tensors' history: the kernels compute no gradient."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors view one storage (in a trace, which has no addresses: one base)."""
    if torch.compiler.is_compiling():
        return a._base is not None and a._base is b._base
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
