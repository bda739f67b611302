"""Atomic, schema-versioned JSON artifacts.

Every stage writes plain JSON into the run directory. A write goes to a temporary file in the
same folder and is renamed over the target, so a crash never leaves half an artifact behind.
A read checks the schema version and, for the artifact kinds of `core.records`, the shape its
readers rely on: an old or corrupt file is one line naming the file and what is wrong. The
pipeline reads artifacts as their typed records (`load`); `read_json` gives the plain data.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, TypeVar

from pydantic import ValidationError

from core.errors import UserError
from core.record import Record
from core.records import BY_KIND

R = TypeVar("R", bound=Record)

SCHEMA_VERSION = 1


def write_json(path: str | Path, data: dict[str, Any] | Record) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, Record):
        data = data.to_dict()
    payload = {"schema_version": SCHEMA_VERSION, **data}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f, indent=1, default=_default)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text(path: str | Path, text: str | bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode() if isinstance(text, str) else text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def read_json(path: str | Path, kind: str = "artifact") -> dict[str, Any]:
    """The artifact at `path` as plain data, validated against `core.records.BY_KIND[kind]`
    when `kind` names one."""
    data = _read(Path(path), kind)
    model = BY_KIND.get(kind)
    if model is not None:
        _validated(model, data, path, kind)
    return data


def load(path: str | Path, model: type[R], kind: str) -> R:
    """The artifact at `path` as its typed record."""
    return _validated(model, _read(Path(path), kind), path, kind)


def _validated(model: type[R], data: dict, path, kind: str) -> R:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise UserError(f"{kind} {path} is not a valid {kind}: {where}: {first['msg']}{more}"
                        ) from None


def _read(path: Path, kind: str) -> dict[str, Any]:
    if not path.exists():
        raise UserError(f"{kind} not found: {path}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{kind} {path} is not valid JSON ({e})") from None
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise UserError(
            f"{kind} {path} has schema_version {version!r}; this version reads {SCHEMA_VERSION}"
        )
    return data


def _default(obj: Any) -> Any:
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, (set, tuple)):
        return list(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")
