"""JSON round-trip for the frozen dataclasses (configs, plans, results): sorted keys, enums by
value, a schema_version, and a strict loader that refuses unknown keys and lists the known
ones. Never imports array libraries."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import types
import typing
from typing import Any, TypeVar

from dataflow.models.errors import ConfigError

SCHEMA_VERSION = 1
T = TypeVar("T")


def to_dict(obj: Any) -> Any:
    """Plain JSON-able structure for a dataclass tree (enums by value, tuples as lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        # A field marked omit_if_default is left out while it holds its default, so adding an
        # optional field does not change the JSON (or hash) of objects that do not use it.
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not (f.metadata.get("omit_if_default")
                        and getattr(obj, f.name) == f.default)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_dict(v) for k, v in obj.items()}
    return obj


def to_json(obj: Any, *, indent: int | None = 2) -> str:
    """JSON text with a schema_version and sorted keys, stable for hashing."""
    body = to_dict(obj)
    if isinstance(body, dict):
        body = {"schema_version": SCHEMA_VERSION, **body}
    return json.dumps(body, sort_keys=True, indent=indent)


def stable_hash(obj: Any) -> str:
    """Short hex digest of an object's canonical JSON; equal objects hash equal across runs."""
    text = to_json(obj, indent=None)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def from_dict(cls: type[T], data: Any, *, where: str | None = None) -> T:
    """Build `cls` from a dict made by `to_dict`, refusing unknown or missing keys."""
    where = where or cls.__name__
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a JSON object, got {type(data).__name__}")
    data = {k: v for k, v in data.items() if k != "schema_version"}
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown keys {unknown}; known keys are {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{where}: missing key '{name}'")
            continue
        kwargs[name] = _convert(hints[name], data[name], f"{where}.{name}")
    return cls(**kwargs)


def from_json(cls: type[T], text: str) -> T:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{cls.__name__}: not valid JSON ({exc})") from None
    if isinstance(data, dict) and data.get("schema_version", SCHEMA_VERSION) != SCHEMA_VERSION:
        raise ConfigError(
            f"{cls.__name__}: schema_version {data['schema_version']} is not supported; "
            f"this version reads {SCHEMA_VERSION}"
        )
    return from_dict(cls, data)


def _convert(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, where)
            except (ConfigError, TypeError, ValueError) as exc:
                errors.append(str(exc))
        raise ConfigError(f"{where}: {value!r} matches none of {args}: {errors}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise ConfigError(f"{where}: expected {len(args)} items, got {len(value)}")
        return tuple(_convert(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where=where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            valid = [m.value for m in tp]
            raise ConfigError(f"{where}: {value!r} is not one of {valid}") from None
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value
