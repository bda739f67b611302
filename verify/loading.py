"""Finding a family by name, loading a candidate source file, and a case's scalar parameters.

The worker process imports the family itself, so families travel between processes as a spec
string: a registry name (`codegen.registry.get_family(name)`) or a dotted import path
"module:attr" (how tests pass families defined under tests/).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from codegen.family import Case, Family


def load_family(spec: str) -> Family:
    """'module.path:ATTR' (attr may be dotted) or a name known to codegen.registry."""
    if ":" in spec:
        module_name, attr = spec.split(":", 1)
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj
    try:
        registry = importlib.import_module("codegen.registry")
    except ModuleNotFoundError as e:
        if e.name != "codegen.registry":
            raise
        raise ValueError(f"family {spec!r}: no codegen.registry here; pass 'module:attr'") from None
    return registry.get_family(spec)


def family_spec(family: Family | str) -> str:
    """A spec string the worker can import the same family object from."""
    if isinstance(family, str):
        return family
    with contextlib.suppress(Exception):  # any registry miss means: look for the object instead
        if load_family(family.name) is family:
            return family.name
    # Not in the registry (a family defined in a test module): find the module attribute that
    # holds this very object.
    for module_name, module in list(sys.modules.items()):
        for attr, value in list(vars(module).items()) if module is not None else ():
            if value is family and module_name != "__main__":
                return f"{module_name}:{attr}"
    raise ValueError(f"family {family.name!r} is neither in codegen.registry nor a module "
                     "attribute; pass its 'module:attr' spec")


def load_candidate(source_path: str | Path) -> Callable[..., None]:
    """Import a candidate source file as a fresh module and return its `forward`."""
    from codegen.source import load_forward

    return load_forward(source_path)


def case_params(family: Family, case: Case) -> dict[str, Any]:
    """The scalar parameters passed to reference(*inputs, **params) and forward(..., **params).

    family.extras['params'](case) when the family gives it; otherwise the case entries named by
    the reference's keyword parameters (keyword-only ones and those with defaults), e.g. `eps`
    for `reference(x, weight, *, eps)`. Shapes and the dtype name are not parameters.
    """
    explicit = family.extras.get("params")
    if callable(explicit):
        return dict(explicit(case))
    names = [p.name for p in inspect.signature(family.reference).parameters.values()
             if p.kind is inspect.Parameter.KEYWORD_ONLY
             or (p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and p.default is not p.empty)]
    return {n: case[n] for n in names if n in case}


def candidate_name(source_path: str | Path) -> str:
    """The file stem, or its folder's name for generic stems
    (candidates/<op>/<variant>/kernel.py)."""
    path = Path(source_path)
    return path.parent.name if path.stem in ("kernel", "candidate", "forward") else path.stem
