"""Preset files -> a typed `Config`, strictly.

A preset is a YAML file under presets/ (or any path). It may name one shared DeepSpeed template
(`deepspeed_template: zero3_offload.json`, a plain DeepSpeed JSON under presets/deepspeed/) that its
own `deepspeed:` section overrides key by key (`key: null` removes a template key). There is no deeper inheritance: copy a preset to make
a new one. Precedence: `--set section.key=value` > preset file > template > schema defaults.

Unknown keys and wrong types anywhere in the trainer's own sections are errors that name the key,
the file and the closest valid key; all of them are reported together. The `deepspeed` section is
checked against the installed DeepSpeed by `trainer.ds_config` during resolution.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import re
import typing
from pathlib import Path
from typing import Any

import yaml

from .config import Config
from .errors import ConfigError, UserError, closest
from .redact import resolve_env_refs


REPO_ROOT = Path(__file__).resolve().parent.parent
PRESET_DIR = REPO_ROOT / "presets"
TEMPLATE_DIR = PRESET_DIR / "deepspeed"


class _Loader(yaml.SafeLoader):
    """SafeLoader that reads 5e8 and 1e-4 as floats (YAML 1.1 wants a dot), as JSON and DeepSpeed users write them."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str, source: str = "<text>") -> Any:
    try:
        return yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as err:
        raise UserError(f"{source}: not valid YAML: {err}") from None


def list_presets() -> list[tuple[str, str]]:
    """(name, description) of every shipped preset, sorted by name."""
    rows = []
    for path in sorted(PRESET_DIR.glob("*.yaml")):
        raw = parse_yaml(path.read_text(), str(path)) or {}
        rows.append((path.stem, str(raw.get("description", ""))))
    return rows


def preset_path(name_or_path: str) -> Path:
    """A shipped preset name (`70b_8xa100`) or a path to a YAML file."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    shipped = PRESET_DIR / f"{name_or_path}.yaml"
    if shipped.exists():
        return shipped
    names = [p.stem for p in PRESET_DIR.glob("*.yaml")]
    raise UserError(
        f"unknown preset {name_or_path!r}{closest(name_or_path, names)}; "
        f"`python -m trainer presets` lists them, or pass a path to a .yaml file")


def load_template(name: str) -> dict:
    """A shared DeepSpeed JSON template from presets/deepspeed/ (by file name)."""
    path = TEMPLATE_DIR / name
    if not path.exists():
        known = [p.name for p in TEMPLATE_DIR.glob("*.json")]
        raise UserError(f"deepspeed_template {name!r} not found in {TEMPLATE_DIR}{closest(name, known)}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{path}: not valid JSON: {err}") from None


def deep_merge(base: dict, override: dict) -> dict:
    """`override` on top of `base`, recursively for nested dicts; a null value deletes the key
    (to drop a template key, e.g. a scheduler parameter the preset's scheduler does not take)."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if value is None:
            merged.pop(key, None)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply `section.key=value` strings (values parsed as YAML) to the raw preset dict."""
    raw = copy.deepcopy(raw)
    for item in overrides:
        if "=" not in item:
            raise UserError(f"--set {item!r}: expected section.key=value, e.g. --set train.lr=1e-4")
        dotted, text = item.split("=", 1)
        keys = dotted.strip().split(".")
        if not all(keys):
            raise UserError(f"--set {item!r}: empty key in {dotted!r}")
        node = raw
        for key in keys[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise UserError(f"--set {item!r}: {key!r} holds a value, not a section")
            node = child
        node[keys[-1]] = parse_yaml(text, f"--set {item}")
    return raw


def load_preset(name_or_path: str, overrides: list[str] | None = None) -> Config:
    """Read a preset (plus its template and `--set` overrides) into a typed, not yet resolved Config."""
    path = preset_path(name_or_path)
    raw = parse_yaml(path.read_text(), str(path)) or {}
    if not isinstance(raw, dict):
        raise UserError(f"{path}: a preset is a mapping of sections (hardware, model, data, train, deepspeed, logging)")
    raw = apply_overrides(raw, overrides or [])
    resolve_env_refs(raw)
    raw.setdefault("name", path.stem)
    template = raw.get("deepspeed_template")
    section = raw.get("deepspeed")
    if isinstance(template, str) and (section is None or isinstance(section, dict)):  # else reported below
        raw["deepspeed"] = deep_merge(load_template(template), section or {})
    return config_from_dict(raw, source=str(path))


def config_from_dict(raw: dict, source: str = "<dict>") -> Config:
    problems: list[str] = []
    config = _build(Config, raw, "", problems)
    if problems:
        raise ConfigError(problems, source)
    return config


# --- strict dict -> dataclass conversion -------------------------------------------------------

def _build(cls, data: Any, path: str, problems: list[str]):
    if not isinstance(data, dict):
        problems.append(f"{path or 'top level'}: expected a mapping, got {type(data).__name__} {data!r}")
        return cls()
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            where = f"{path}.{key}" if path else key
            problems.append(f"unknown key '{where}'{closest(str(key), names)}")
    values = {}
    for name in names:
        if name in data:
            values[name] = _convert(hints[name], data[name], f"{path}.{name}" if path else name, problems)
    try:
        return cls(**values)
    except TypeError as err:  # only reachable if a conversion above let a bad value through
        problems.append(f"{path}: {err}")
        return cls()


def _convert(tp, value: Any, path: str, problems: list[str]):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path, problems)
    if origin is typing.Union:
        if value is None and type(None) in args:
            return None
        for option in args:
            trial: list[str] = []
            converted = _convert(option, value, path, trial)
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
        converted = [_convert(t, v, f"{path}[{i}]", problems) for i, (t, v) in enumerate(zip(items, value))]
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
