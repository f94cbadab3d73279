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

import contextlib
import copy
import re
from pathlib import Path
from typing import Any, Callable, Optional

from . import strict
from .config import Config
from .errors import ConfigError, UserError, clip, closest
from .paths import missing_or_what, what_is
from .files import parse_yaml, read_json_object, read_yaml_mapping
from .redact import resolve_env_refs


REPO_ROOT = Path(__file__).resolve().parent.parent
PRESET_DIR = REPO_ROOT / "presets"
TEMPLATE_DIR = PRESET_DIR / "deepspeed"


def list_presets(directory: Path = PRESET_DIR) -> list[tuple[str, str]]:
    """(name, description) of every preset in presets/ (or `directory`), sorted by name."""
    rows = []
    for path in sorted(directory.glob("*.yaml")):
        raw = read_yaml_mapping(path, "preset")
        rows.append((path.stem, str(raw.get("description", ""))))
    return rows


def preset_path(name_or_path: str) -> Path:
    """A shipped preset name (`70b_8xa100`) or a path to a YAML file."""
    path = Path(name_or_path).expanduser()
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    shipped = PRESET_DIR / f"{name_or_path}.yaml"
    if "/" not in name_or_path and shipped.is_file():
        return shipped
    if path.suffix in (".yaml", ".yml") or "/" in name_or_path:
        hint = ("`python -m trainer presets` lists the shipped ones" if what_is(path) == "missing"
                else "give a preset .yaml file")
        raise UserError(f"preset file {name_or_path!r} {missing_or_what(path)}; {hint}")
    names = [p.stem for p in PRESET_DIR.glob("*.yaml")]
    raise UserError(
        f"unknown preset {name_or_path!r}{closest(name_or_path, names)}; "
        f"`python -m trainer presets` lists them, or pass a path to a .yaml file")


def load_template(name: str) -> dict:
    """A shared DeepSpeed JSON template: a file name in presets/deepspeed/, or a path to a .json file."""
    return read_json_object(template_path(name), "deepspeed_template")


def template_path(name: str) -> Path:
    """A bare file name is looked up in presets/deepspeed/ only (`../` cannot climb out of it); anything with a
    directory part is a path the user wrote on purpose (relative to the current directory) and must be .json."""
    if "/" not in name and name not in ("", ".", ".."):
        path = TEMPLATE_DIR / name
        if not path.is_file():
            known = [p.name for p in TEMPLATE_DIR.glob("*.json")]
            raise UserError(f"deepspeed_template {name!r} not found in {TEMPLATE_DIR}{closest(name, known)}; "
                            f"known: {', '.join(sorted(known))} (or give a path to a .json file)")
        return path
    path = Path(name).expanduser()
    if path.suffix != ".json":
        raise UserError(f"deepspeed_template {name!r}: a path must name a DeepSpeed .json file (or give a file name "
                        f"from {TEMPLATE_DIR})")
    return path


def template_source(name: str) -> str:
    """What `deepspeed_template` records after loading: the shipped name, or the absolute path that was read."""
    path = template_path(name)
    return name if path.parent == TEMPLATE_DIR else str(path.resolve())


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


REPLACE = ":="  # `--set train:={...}`: replace a whole mapping on purpose (plain `=` refuses to drop its keys)


def apply_overrides(raw: dict, overrides: list[str], null_deletes: bool = False) -> dict:
    """Apply `section.key=value` strings (values parsed as YAML) to the raw preset dict. A key given twice, or a
    key and a section holding it, is an error naming both items; a mapping value that would drop keys the preset
    sets needs the explicit `section.key:={...}`. `null_deletes`: `key=null` removes the key (the DeepSpeed
    section's rule, as in a preset's own `deepspeed:` over its template)."""
    raw = copy.deepcopy(raw)
    seen: dict[str, str] = {}
    for item in overrides:
        keys, replace = _override_key(item)
        _refuse_repeats(".".join(keys), item, seen)
        text = item.split("=", 1)[1]
        node = raw
        for key in keys[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise UserError(f"--set {clip(item, 100)!r}: {key!r} holds a value, not a section")
            node = child
        value = parse_yaml(text, f"--set {clip(item, 100)}")
        if not replace:
            _refuse_dropped_keys(node.get(keys[-1]), value, ".".join(keys), item)
        if value is None and null_deletes:
            node.pop(keys[-1], None)
        else:
            node[keys[-1]] = value
    return raw


def _override_key(item: str) -> tuple[list[str], bool]:
    """(the dotted key of a `--set` item as a list, whether it is the replacing `:=` form)."""
    if "=" not in item:
        raise UserError(f"--set {clip(item, 100)!r}: expected section.key=value, e.g. --set train.lr=1e-4")
    dotted = item.split("=", 1)[0]
    keys = dotted.rstrip(":").strip().split(".")
    if not all(keys):
        raise UserError(f"--set {clip(item, 100)!r}: empty key in {clip(dotted, 100)!r}")
    return keys, dotted.endswith(":")


def _refuse_repeats(dotted: str, item: str, seen: dict[str, str]) -> None:
    """The same key twice (or a section and a key inside it) would silently keep the last: say which two."""
    for earlier, earlier_item in seen.items():
        if dotted == earlier or dotted.startswith(earlier + ".") or earlier.startswith(dotted + "."):
            shorter = min(dotted, earlier, key=len)
            raise UserError(f"--set {clip(item, 100)!r} and --set {clip(earlier_item, 100)!r} both set {shorter}: "
                            f"give it once")
    seen[dotted] = item


def _refuse_dropped_keys(current, value, dotted: str, item: str) -> None:
    """`--set train={lr: 1}` would replace the preset's whole train section (every other key back to its default)."""
    if not isinstance(current, dict) or not isinstance(value, dict):
        return
    dropped = sorted(str(k) for k in current if k not in value)
    if dropped:
        shown = ", ".join(dropped[:6]) + (", ..." if len(dropped) > 6 else "")
        raise UserError(f"--set {clip(item, 100)!r} would replace all of {dotted}, dropping {shown} (set by the "
                        f"preset or its template): set the keys one by one (--set {dotted}.KEY=VALUE), or write "
                        f"{dotted}{REPLACE}{{...}} to replace it on purpose")


ACCEPTED_WARNING = "Accepted warning"
ACCEPTED_LINE = re.compile(rf"^# {ACCEPTED_WARNING} \[([^\]]+)\]: (.+)$")


def accepted_warnings(path: Path) -> dict[str, str]:
    """The lint warnings a preset's header names as accepted trade-offs, check -> reason: one line each,
    `# Accepted warning [CHECK]: why` (CHECK as lint prints it in brackets). Lint still reports them, marked
    accepted; the header comment ends at the first line that is not a comment."""
    found = {}
    with open(path, errors="replace") as handle:
        for line in handle:
            if not line.startswith("#"):
                break
            match = ACCEPTED_LINE.match(line.rstrip("\n"))
            if match:
                found[match.group(1)] = match.group(2).strip()
    return found


def load_preset(name_or_path: str, overrides: list[str] | None = None) -> Config:
    """Read a preset (plus its template and `--set` overrides) into a typed, not yet resolved Config."""
    path = preset_path(name_or_path)
    raw = read_yaml_mapping(path, "preset", hint="a mapping of sections (hardware, model, data, train, deepspeed, "
                                                 "logging)")
    overrides = overrides or []
    apply_overrides({}, overrides)  # every item well-formed, no key twice, before any is applied
    # DeepSpeed keys are set on the preset's section merged over its template, so `=` with a mapping sees (and
    # refuses to drop) the template's keys too, `:=` replaces all of it, and null removes a key
    in_deepspeed = [item for item in overrides if _override_key(item)[0][0] == "deepspeed" and
                    len(_override_key(item)[0]) > 1]
    raw = one_run_length(raw, overrides, str(path))
    raw = apply_overrides(raw, [item for item in overrides if item not in in_deepspeed])
    raw.setdefault("name", path.stem)
    template = raw.get("deepspeed_template")
    section = raw.get("deepspeed")
    with blamed(str(path), overrides):
        if isinstance(template, str) and (section is None or isinstance(section, dict)):  # else reported below
            raw["deepspeed"] = deep_merge(load_template(template), section or {})
            raw["deepspeed_template"] = template_source(template)
        raw = apply_overrides(raw, in_deepspeed, null_deletes=True)
        resolve_env_refs(raw)
        return config_from_dict(raw, source=str(path))


RUN_LENGTHS = ("max_steps", "epochs")  # train.*: each says how long the run trains, so one is given


def one_run_length(raw: dict, overrides: list[str], source: str) -> dict:
    """A --set of train.epochs replaces the preset's train.max_steps and the other way round (the preset's own
    length gives way to the one typed); both in the same place are refused."""
    values = {item.split("=", 1)[0].strip().rstrip(":"): item.split("=", 1)[1].strip() for item in overrides
              if "=" in item}
    typed = [key for key in RUN_LENGTHS if values.get(f"train.{key}", "null") not in ("null", "~", "")]
    if len(typed) == 2:
        raise ConfigError(["--set train.max_steps and --set train.epochs both say how long the run trains: give one"],
                          "the command line")
    train = raw.get("train")
    if not isinstance(train, dict):
        return raw
    if typed:
        other = RUN_LENGTHS[1 - RUN_LENGTHS.index(typed[0])]
        return {**raw, "train": {k: v for k, v in train.items() if k != other}}
    if all(train.get(key) is not None for key in RUN_LENGTHS):
        raise ConfigError(["train.max_steps and train.epochs both say how long the run trains: give one"], source)
    return raw


def with_overrides(overrides: list[str], changes: list[str]) -> list[str]:
    """`overrides` with `changes` (the trainer's own --set items: a resume, the doctor's proposal, a batch kept
    across topologies) taking the place of any item that sets the same key or a section around it -- and a later
    change the place of an earlier one -- so the result never sets a key twice."""
    result = list(overrides)
    for change in changes:
        key = _override_key(change)[0]
        result = [item for item in result if not _overlap(_override_key(item)[0], key)] + [change]
    return result


def _overlap(a: list[str], b: list[str]) -> bool:
    """One key is the other or lies inside it (`train` and `train.lr`)."""
    return a[:len(b)] == b or b[:len(a)] == a


def set_keys(overrides: list[str]) -> set[str]:
    """The dotted keys the `--set` items name (`train.max_steps`), for code that must not replace them."""
    return {item.split("=", 1)[0].strip().rstrip(":") for item in overrides if "=" in item}


# a problem's first words name its key: "unknown key 'train.x'", "train.lr: ...", "train.lr=-1 must be ..."
_PROBLEM_KEY = re.compile(r"^(?:unknown key ')?([A-Za-z_][\w.\[\]]*)")


def blame_overrides(problem: str, overrides: list[str]) -> str:
    """`problem` with the `--set` item that wrote its key appended (the last one wins, as in apply_overrides)."""
    match = _PROBLEM_KEY.match(problem)
    key = match.group(1).split("[")[0] if match else ""
    for item in reversed(overrides):
        dotted = item.split("=", 1)[0].strip()
        if key and (key == dotted or key.startswith(dotted + ".") or dotted.startswith(key + ".")):
            return f"{problem} (from --set {clip(item.strip(), 100)})"
    return problem


@contextlib.contextmanager
def blamed(path: str, overrides: list[str], alone: Optional[Callable[[], Any]] = None):
    """Problems of a preset read with `--set` items say which came from which item, and the source names the
    preset file only for the rest: a `--set` mistake is not blamed on the file. A problem that names no key
    (the batch triad, a group size that does not divide) is put on the `--set` items when `alone` -- the same
    step on the preset without them -- succeeds: the file was fine, the items made it fail."""
    try:
        yield
    except ConfigError as err:
        problems = [blame_overrides(p, overrides) for p in err.problems]
        if any(not _attributed(p) for p in problems) and _fine_alone(overrides, alone):
            problems = [p if _attributed(p) else f"{p} ({_from_items(overrides)})" for p in problems]
        from_set = sum(_attributed(p) for p in problems)
        source = "the command line" if from_set == len(problems) else path + (" and the command line" if from_set
                                                                              else "")
        raise ConfigError(problems, source) from None
    except UserError as err:
        text = str(err)
        if text.startswith("deepspeed_template"):
            text = blame_overrides(text, overrides)
            raise UserError(text if "(from --set" in text else f"{path}: {text}") from None
        if overrides and not text.startswith("--") and _fine_alone(overrides, alone):
            raise UserError(f"{text}\n({_from_items(overrides)}: {path} alone is fine)") from None
        raise


def _attributed(problem: str) -> bool:
    return "(from --set " in problem or "(from the --set items " in problem or problem.startswith("--")  # --world-size


def _from_items(overrides: list[str]) -> str:
    return "from the --set items " + " ".join(f"--set {clip(item, 60)}" for item in overrides)


def _fine_alone(overrides: list[str], alone: Optional[Callable[[], Any]]) -> bool:
    if not overrides or alone is None:
        return False
    try:
        alone()
    except UserError:
        return False
    return True


def config_from_dict(raw: dict, source: str = "<dict>") -> Config:
    return strict.from_dict(Config, raw, source)


# --- strict dict -> dataclass conversion -------------------------------------------------------