"""The base of every typed record (`core.records`): an artifact, or a part of one, read as
attributes.

A record keeps what it was read or built with: fields it declares are validated and typed,
anything else stays as an extra field, and `to_dict` gives back the same keys, so a stage that
reads an artifact, changes a field and writes it again changes nothing else. Code outside the
pipeline that still reads artifacts as dicts (scripts, tests, tools of their own) can: a record
answers `rec["key"]`, `rec.get("key")`, `"key" in rec` and `rec.items()` for the keys it
holds, as the dict it was read from would, and takes `rec["key"] = value` and `rec.update()`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    WrapValidator,
    model_validator,
)
from pydantic_core import PydanticCustomError

R = TypeVar("R", bound="Record")
T = TypeVar("T")


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


_MISSING = _Missing()
_PARTIAL = {"partial": True}


def _needed(value: Any, handler, info: ValidationInfo) -> Any:
    if value is _MISSING:
        if (info.context or {}).get("partial"):
            return None
        raise PydanticCustomError("missing", "Field required")
    return handler(value)


# A field every file of the artifact holds: reading a file without it is refused, naming the
# field. `Record.of` takes part of a record from a caller (a script, a test) and reads a
# needed field it left out as None.
Needed = Annotated[T, WrapValidator(_needed), Field(default=_MISSING, validate_default=True)]
_ALIASES: dict[type, dict[str, str]] = {}  # per record class: a field's alias -> its name


class Record(BaseModel):
    model_config = ConfigDict(extra="allow", validate_assignment=True, populate_by_name=True)
    _source: dict[str, Any] | None = PrivateAttr(default=None)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_source(cls, data: Any, handler) -> Any:
        rec = handler(data)
        if isinstance(data, dict) and isinstance(rec, cls):
            rec._source = data
        return rec

    @model_validator(mode="before")
    @classmethod
    def _by_keys(cls, data: Any) -> Any:
        """A record of another model where this one is expected: read by its keys (a
        profile's workload spec written into the ranking's label of it)."""
        if isinstance(data, Record) and not isinstance(data, cls):
            return data.to_dict()
        return data

    @classmethod
    def of(cls: type[R], data: Any) -> R:
        """`data` as this record: itself when it is one, else validated (a dict, or a record of
        another model, by its keys), a `Needed` field it lacks read as None."""
        if isinstance(data, cls):
            return data
        if isinstance(data, Record):
            data = data.to_dict()
        return cls.model_validate(data, context=_PARTIAL)

    @classmethod
    def list_of(cls: type[R], items: Iterable[Any] | None) -> list[R]:
        return [cls.of(x) for x in items or ()]

    @classmethod
    def map_of(cls: type[R], items: dict[str, Any] | None) -> dict[str, R]:
        return {k: cls.of(v) for k, v in (items or {}).items()}

    def to_dict(self) -> dict[str, Any]:
        """Plain data, the keys it was read or built with (a declared field never set stays
        out, as it was absent)."""
        return self.model_dump(exclude_unset=True, by_alias=True)

    def as_written(self) -> dict[str, Any]:
        """The data the record was read from, as written (its keys in their order, numbers
        not converted), for a reader that passes a part of an artifact on whole (the report's
        report.json); a record built in code, or one a field was set on since: `to_dict`."""
        return self.to_dict() if self._source is None else self._source

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if not name.startswith("_"):
            super().__setattr__("_source", None)

    def has(self, key: str) -> bool:
        """Whether the record holds `key`: read with it, built with it or set since (a
        declared field left at its default does not)."""
        return self._field(key) in self.model_fields_set

    def without(self: R, *keys: str) -> R:
        """A copy that does not hold `keys` (computation state a written artifact leaves out)."""
        drop = {self._field(k) for k in keys}
        return type(self).model_validate(self.model_dump(exclude_unset=True, by_alias=True,
                                                         exclude=drop))

    @classmethod
    def _field(cls, key: str) -> str:
        aliases = _ALIASES.get(cls)
        if aliases is None:
            aliases = _ALIASES[cls] = {info.alias: name for name, info in cls.model_fields.items()
                                       if info.alias}
        return aliases.get(key, key)

    # the mapping view (see the module's doc)

    def __getitem__(self, key: str) -> Any:
        if not isinstance(key, str) or not self.has(key):
            raise KeyError(key)
        return getattr(self, self._field(key))

    def __setitem__(self, key: str, value: Any) -> None:
        setattr(self, self._field(key), value)

    def update(self, fields: dict[str, Any] | None = None, **more: Any) -> None:
        for key, value in {**(fields or {}), **more}.items():
            self[key] = value

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if self.has(key) else default

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self.has(key)

    def keys(self) -> list[str]:
        return list(self.to_dict())

    def items(self) -> list[tuple[str, Any]]:
        return [(k, self[k]) for k in self.keys()]

    def values(self) -> list[Any]:
        return [self[k] for k in self.keys()]

    def __len__(self) -> int:  # a record holding no key is falsy, as an empty dict is
        return len(self.model_fields_set)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, dict):
            return self.to_dict() == other
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]  # mutable, as dicts are
