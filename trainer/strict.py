"""Strict dict -> dataclass conversion: unknown keys (with the closest valid one) and wrong types anywhere,
every problem collected, none raised half-way. Presets and the planner's scenario files load through it."""
from __future__ import annotations

import dataclasses
import typing
from typing import Any

from .errors import ConfigError, closest


def from_dict(cls, raw: Any, source: str = "<dict>"):
    """`cls` built from `raw`, or a ConfigError listing every problem, each naming its dotted key."""
    problems: list[str] = []
    value = build(cls, raw, "", problems)
    if problems:
        raise ConfigError(problems, source)
    return value


def build(cls, data: Any, path: str, problems: list[str]):
    if not isinstance(data, dict):
        problems.append(f"{path or 'top level'}: expected a mapping, got {type(data).__name__} {data!r}")
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    renamed = getattr(cls, "RENAMED", {})
    for key in data:
        if key not in names:
            where = f"{path}.{key}" if path else key
            hint = f" ({renamed[key]})" if key in renamed else closest(str(key), names)
            problems.append(f"unknown key '{where}'{hint}")
    values = {}
    for name in names:
        if name in data:
            values[name] = convert(hints[name], data[name], f"{path}.{name}" if path else name, problems)
    try:
        return cls(**values)
    except TypeError as err:  # only reachable if a conversion above let a bad value through
        problems.append(f"{path}: {err}")
        return cls()


def convert(tp, value: Any, path: str, problems: list[str]):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path, problems)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # Optional[X]: X's own problems (a nested unknown key), not "is not X or null"
            return convert(options[0], value, path, problems)
        for option in args:
            trial: list[str] = []
            converted = convert(option, value, path, trial)
            if not trial:
                return converted
        problems.append(f"{path}: {value!r} is not {_type_name(tp)}")
        return value
    if origin is typing.Literal:
        if value not in args:
            problems.append(f"{path}: {value!r} is not one of {', '.join(map(repr, args))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            problems.append(f"{path}: expected a list, got {value!r}")
            return value
        if origin is tuple and len(value) != len(args):
            problems.append(f"{path}: expected {len(args)} values, got {len(value)}: {value!r}")
            return value
        items = args if origin is tuple else [args[0]] * len(value)
        converted = [convert(t, v, f"{path}[{i}]", problems) for i, (t, v) in enumerate(zip(items, value))]
        return tuple(converted) if origin is tuple else converted
    return _convert_scalar(tp, value, path, problems)


def _convert_scalar(tp, value: Any, path: str, problems: list[str]):
    if tp is type(None):
        if value is not None:
            problems.append(f"{path}: expected null, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            problems.append(f"{path}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, float) and value.is_integer():
            return int(value)  # 5e8 written in YAML/JSON
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{path}: expected a number, got {value!r}")
            return value
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            problems.append(f"{path}: expected a string, got {value!r}")
        return value
    if tp is dict:
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping, got {value!r}")
        return value
    problems.append(f"{path}: unsupported type {tp}")  # a schema bug, not a user error
    return value


def _type_name(tp) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    names = [getattr(a, "__name__", str(a)) for a in args]
    return " or ".join(names) + (" or null" if type(None) in typing.get_args(tp) else "")
