"""Strict dict -> dataclass conversion: unknown keys (with the closest valid one) and wrong types anywhere,
every problem collected, none raised half-way. Presets and the planner's scenario files load through it."""
from __future__ import annotations

import dataclasses
import functools
import math
import typing
from typing import Any

from .errors import ConfigError, closest, short
from .numbers import EXACT, INT64_MAX, Kind


def from_dict(cls, raw: Any, source: str = "<dict>"):
    """`cls` built from `raw`, or a ConfigError listing every problem, each naming its dotted key."""
    problems: list[str] = []
    value = build(cls, raw, "", problems)
    if problems:
        raise ConfigError(problems, source)
    return value


def build(cls, data: Any, path: str, problems: list[str]):
    if not isinstance(data, dict):
        problems.append(f"{path or 'top level'}: expected a mapping, got {type(data).__name__} {short(data)}")
        return cls()
    hints, names = _fields(cls)
    renamed = getattr(cls, "RENAMED", {})
    for key in data:
        if key not in names:
            where = f"{path}.{key}" if path else key
            hint = f" ({renamed[key]})" if key in renamed else _suggestion(str(key), names)
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


@functools.cache
def _fields(cls) -> tuple[dict, list[str]]:
    """A dataclass's field types and names. Cached: get_type_hints evaluates every string annotation anew at each
    call (this module's dataclasses use `from __future__ import annotations`), and every preset, template, run
    config and `--set` loads through here (~16,000 builds in a quick test run)."""
    return typing.get_type_hints(cls), [f.name for f in dataclasses.fields(cls)]


# Names other tools use for our keys (HF Trainer, DeepSpeed): too far apart for a spelling match.
OTHER_NAMES = {"learning_rate": "lr", "gradient_accumulation_steps": "grad_accum",
               "gradient_accumulation": "grad_accum", "train_micro_batch_size_per_gpu": "micro_batch_size",
               "per_device_train_batch_size": "micro_batch_size", "batch_size": "micro_batch_size",
               "train_batch_size": "global_batch_size", "gradient_clipping": "grad_clip", "max_grad_norm": "grad_clip",
               "warmup": "warmup_steps", "num_steps": "max_steps", "steps": "max_steps", "adam_epsilon": "eps",
               "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
               "num_key_value_heads": "num_kv_heads", "model_type": "family", "model_name_or_path": "name_or_path",
               "max_seq_length": "seq_len", "max_length": "seq_len", "dataset": "source", "seed_value": "seed"}


def out_of_range(obj: Any, path: str = "") -> list[str]:
    """Every number of a built dataclass (nested ones, lists and tuples included) outside its field's kind
    (trainer/numbers.py: the ranges the command-line flags use too). Run by resolve with the other value checks,
    so they are all reported together; strings ('auto') and null are judged by their types, not here."""
    problems = []
    for field in dataclasses.fields(obj):
        value, where = getattr(obj, field.name), f"{path}.{field.name}" if path else field.name
        if dataclasses.is_dataclass(value):
            problems += out_of_range(value, where)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                problems += (out_of_range(item, f"{where}[{i}]") if dataclasses.is_dataclass(item)
                             else _kind_problem(field.metadata.get("kind"), item, f"{where}[{i}]"))
        else:
            problems += _kind_problem(field.metadata.get("kind"), value, where)
    return problems


def _kind_problem(kind: Kind | None, value: Any, where: str) -> list[str]:
    if kind is None or isinstance(value, bool) or not isinstance(value, (int, float)):
        return []
    problem = kind.problem(value)
    return [f"{where}={short(value)} {problem}"] if problem else []


def _suggestion(key: str, names: list[str]) -> str:
    other = OTHER_NAMES.get(key.lower())
    if other in names:
        return f" (did you mean '{other}'?)"
    return closest(key, names)


def convert(tp, value: Any, path: str, problems: list[str]):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, value, path, problems)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # Optional[X]: X's own problems (a nested unknown key), not "is not X or null"
            if options[0] in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
                # a word where a number or null goes ('auto'): say null is the other choice (the field's doc says
                # what null means)
                problems.append(f"{path}: expected {'an integer' if options[0] is int else 'a number'} or null, "
                                f"got {short(value)}")
                return value
            return convert(options[0], value, path, problems)
        for option in args:
            trial: list[str] = []
            converted = convert(option, value, path, trial)
            if not trial:
                return converted
        numeric = [a for a in options if a in (int, float)]
        if numeric and isinstance(value, (int, float)) and not isinstance(value, bool):
            return convert(numeric[0], value, path, problems)  # a number, wrong for its kind: say how
        problems.append(f"{path}: {short(value)} is not {_type_name(tp)}")
        return value
    if origin is typing.Literal:
        if value not in args:
            problems.append(f"{path}: {short(value)} is not one of {', '.join(map(repr, args))}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            problems.append(f"{path}: expected a list, got {short(value)}")
            return value
        if origin is tuple and len(value) != len(args):
            problems.append(f"{path}: expected {len(args)} values, got {len(value)}: {short(value)}")
            return value
        items = args if origin is tuple else [args[0]] * len(value)
        converted = [convert(t, v, f"{path}[{i}]", problems) for i, (t, v) in enumerate(zip(items, value))]
        return tuple(converted) if origin is tuple else converted
    return _convert_scalar(tp, value, path, problems)


def _convert_scalar(tp, value: Any, path: str, problems: list[str]):
    if tp is type(None):
        if value is not None:
            problems.append(f"{path}: expected null, got {short(value)}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            problems.append(f"{path}: expected true/false, got {short(value)}")
        return value
    if tp is int:
        if isinstance(value, float) and value.is_integer() and abs(value) <= EXACT:
            return int(value)  # 5e8 written in YAML/JSON
        if isinstance(value, float) and value.is_integer():  # 1e30: not the integer its digits would claim
            problems.append(f"{path}: {short(value)} is too large to be an exact integer")
        elif isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{path}: expected an integer, got {short(value)}")
        elif abs(value) > INT64_MAX:
            problems.append(f"{path}: {short(value)} is beyond a 64-bit integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append(f"{path}: expected a number, got {short(value)}")
            return value
        if not math.isfinite(value):  # .inf / .nan in YAML: no DeepSpeed JSON or schedule can hold it
            problems.append(f"{path}: {value} is not a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            problems.append(f"{path}: expected a string, got {short(value)}")
        return value
    if tp is dict:
        if not isinstance(value, dict):
            problems.append(f"{path}: expected a mapping, got {short(value)}")
        return value
    problems.append(f"{path}: unsupported type {tp}")  # a schema bug, not a user error
    return value


def _type_name(tp) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    names = [getattr(a, "__name__", str(a)) for a in args]
    return " or ".join(names) + (" or null" if type(None) in typing.get_args(tp) else "")
