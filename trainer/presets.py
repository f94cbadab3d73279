"""Preset files -> a typed `Config`, strictly.

A preset is a YAML file under presets/ (or any path). It may name one shared DeepSpeed template
(`deepspeed_template: zero3_offload.json`, a plain DeepSpeed JSON under presets/deepspeed/) that its
own `deepspeed:` section overrides key by key (`key: null` removes a template key). There is no deeper inheritance: copy a preset to make
a new one. Precedence: `--set section.key=value` > preset file > template > schema defaults.

Unknown keys and wrong types anywhere in the trainer's own sections are errors that name the key,
the file and the closest valid key; all of them are reported together (`trainer.strict`). The `deepspeed` section is
checked against the installed DeepSpeed by `trainer.ds` during resolution.
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import yaml

from . import strict
from .config import Config
from .errors import UserError, closest
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
    return strict.from_dict(Config, raw, source)


# --- strict dict -> dataclass conversion -------------------------------------------------------