"""Discovers kernel families: every `codegen/<name>/` package that exposes `FAMILY`.

Adding a family means adding a folder; nothing in pipeline/ or profiling/ changes.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import lru_cache

import codegen
from core.errors import UserError
from core.family import Family, Pattern


@lru_cache(maxsize=1)
def families() -> dict[str, Family]:
    found = {}
    for info in pkgutil.iter_modules(codegen.__path__):
        if not info.ispkg:
            continue
        mod = importlib.import_module(f"codegen.{info.name}")
        fam = getattr(mod, "FAMILY", None)
        if isinstance(fam, Family):
            found[fam.name] = fam
    return found


def get_family(name: str) -> Family:
    try:
        return families()[name]
    except KeyError:
        known = ", ".join(sorted(families()))
        raise UserError(f"unknown kernel family {name!r}; known: {known}") from None


def family_patterns() -> list[Pattern]:
    return [p for fam in families().values() for p in fam.patterns]
