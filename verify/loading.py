"""Naming a family for the worker, loading a candidate source file, a case's scalar parameters.

The judge is handed a family; it never looks one up by name. The worker process imports that
same family object itself, so a family travels between processes as a dotted import path
"module:attr" (`codegen.rmsnorm:FAMILY`, or a family defined in a test module).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from core.family import Case, Family
from core.source import load_forward


def load_family(spec: str) -> Family:
    """The family at 'module.path:ATTR' (attr may be dotted)."""
    if ":" not in spec:
        raise ValueError(f"family spec {spec!r} is not 'module:attr'")
    module_name, attr = spec.split(":", 1)
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def family_spec(family: Family | str) -> str:
    """A 'module:attr' spec the worker can import the same family object from: the module
    attribute that holds this very object (a family folder's `FAMILY`, or a test's)."""
    if isinstance(family, str):
        return family
    # a family folder's own `FAMILY` first, then any module attribute holding the object
    for module_name, module in list(sys.modules.items()):
        if module is not None and getattr(module, "FAMILY", None) is family:
            return f"{module_name}:FAMILY"
    for module_name, module in list(sys.modules.items()):
        for attr, value in list(vars(module).items()) if module is not None else ():
            if value is family and module_name != "__main__":
                return f"{module_name}:{attr}"
    raise ValueError(f"family {family.name!r} is no module attribute; pass its 'module:attr' "
                     "spec")


def load_candidate(source_path: str | Path) -> Callable[..., None]:
    """Import a candidate source file as a fresh module and return its `forward`."""
    return load_forward(source_path)


def case_params(family: Family, case: Case) -> dict[str, Any]:
    """The scalar parameters passed to reference(*inputs, **params) and forward(..., **params).

    family.params(case) when the family gives it; otherwise the case entries named by
    the reference's keyword parameters (keyword-only ones and those with defaults), e.g. `eps`
    for `reference(x, weight, *, eps)`. Shapes and the dtype name are not parameters.
    """
    if family.params is not None:
        return dict(family.params(case))
    names = [p.name for p in inspect.signature(family.reference).parameters.values()
             if p.kind is inspect.Parameter.KEYWORD_ONLY
             or (p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and p.default is not p.empty)]
    return {n: case[n] for n in names if n in case}


def candidate_name(source_path: str | Path) -> str:
    """The file stem, or its folder's name for generic stems
    (candidates/<op>/<variant>/kernel.py)."""
    path = Path(source_path)
    return path.parent.name if path.stem in ("kernel", "candidate", "forward") else path.stem
