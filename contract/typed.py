"""Reading a dataclass back from JSON with every key checked, so a damaged config.json names its key.

The dataclasses of the engine format are the schema: their field types say what each key must hold.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, TypeVar

from kiln.contract.errors import EngineLoadError

T = TypeVar("T")


def read_dataclass(cls: type[T], data: Any, where: str, error: type[Exception] = EngineLoadError) -> T:
    """``cls(**data)`` after checking that ``data`` is a mapping with every required key, no unknown
    key, and values of the annotated types; ``error`` names the first bad key as ``where.key``."""
    if not isinstance(data, dict):
        raise error(f"{where!r} must be a JSON object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise error(f"unknown key(s) {[_join(where, k) for k in unknown]}; {where!r} has {sorted(fields)}")
    values = {}
    for name, f in fields.items():
        if name in data:
            values[name] = _check(hints[name], data[name], _join(where, name), error)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise error(f"key {_join(where, name)!r} is missing")
    return cls(**values)


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _check(tp: Any, value: Any, key: str, error: type[Exception]) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]  # the format uses only "X | None"
        return _check(inner, value, key, error)
    if dataclasses.is_dataclass(tp):
        return read_dataclass(tp, value, key, error)
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
    }
    if tp in ok:
        if not ok[tp](value):
            raise error(f"{key!r} must be {_describe(tp)}, got {value!r:.60}")
        if tp is float and not math.isfinite(value):   # Python's json reads NaN and Infinity
            raise error(f"{key!r} must be a finite number, got {value!r}")
        return float(value) if tp is float else value
    if origin is list:
        if not isinstance(value, list):
            raise error(f"{key!r} must be a list, got {value!r}")
        return [_check(args[0], v, f"{key}[{i}]", error) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise error(f"{key!r} must be a JSON object, got {value!r}")
        return {k: _check(args[1], v, f"{key}.{k}", error) for k, v in value.items()}
    raise TypeError(f"the engine format has no reader for {tp!r} ({key})")  # a bug in the schema, not the file


def _describe(tp: Any) -> str:
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[tp]
