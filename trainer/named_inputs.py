"""The files a config names, checked where the config is typed: every command that resolves a config (`show`,
`lint`, `launch --dry-run`, `export`, `doctor`, the ranks' own start) reports a data source, an eval source, a chat
template or a local model directory that is not there, with its key, before a rank starts or a tokenizer loads.

Only what needs neither a tokenizer nor weights nor the network is checked here: that a local path exists, is
readable and is a kind of file the trainer reads. A hub name ("org/name") is left to the run (this machine may be
offline); the records' fields are checked when the source is prepared, where the tokenizer is at hand.
"""
from __future__ import annotations

import os
from pathlib import Path

from .paths import what_is

FILE_FORMATS = (".jsonl", ".json", ".parquet", ".txt")  # the data files a source may be or hold
MANIFEST = "manifest.json"  # a prepared directory's index (trainer/data/shards.py writes it)
TEMPLATE_DIR = Path(__file__).resolve().parent / "data" / "templates"  # the shipped chat templates, <name>.jinja
REPO_ROOT = Path(__file__).resolve().parent.parent


def looks_like_path(source: str) -> bool:
    """Hub ids are "name" or "org/name"; anything else that does not exist is a mistyped local path, and so is
    "dir/name" when dir exists here (asking the hub would only retry and fail offline)."""
    return (Path(source).suffix in FILE_FORMATS or source.startswith((".", "/", "~"))
            or source.count("/") > 1 or ("/" in source and Path(source).parent.is_dir()))


def shipped_templates() -> list[str]:
    """The names data.chat_template takes without a file: the templates shipped with the trainer."""
    return sorted(path.stem for path in TEMPLATE_DIR.glob("*.jinja"))


def template_file(value: str) -> Path:
    """Where a data.chat_template that is not a shipped name is read from: absolute, or relative to the repo root."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else REPO_ROOT / path


def named_input_problems(cfg) -> list[str]:
    """Every local file the config names that is missing, unreadable or of a kind the trainer does not read."""
    d, m = cfg.data, cfg.model
    sources = [(f"data.sources[{i}].path", s.path) for i, s in enumerate(d.sources)] if d.sources else \
        [("data.source", d.source)]
    sources += [("data.eval_source", d.eval_source)] if d.eval_source else []
    problems = [problem for key, value in sources if value for problem in [data_source_problem(key, value)] if problem]
    problems += [problem for problem in [chat_template_problem(d.chat_template)] if problem]
    for key, value in (("model.name_or_path", m.name_or_path), ("model.tokenizer", m.tokenizer)):
        problem = model_directory_problem(key, value) if value else ""
        problems += [problem] if problem else []
    return problems


def data_source_problem(key: str, value: str) -> str:
    """'' when `value` is a readable data file, a directory holding some, a prepared directory, or a hub name."""
    path = Path(value).expanduser()
    fix = (f"give a {'/'.join(FILE_FORMATS)} file, a directory of them, a prepared directory (python -m trainer "
           f"prepare-data --out DIR) or a hub dataset name (docs/data.md)")
    found = what_is(path)
    if found == "missing":
        return f"{key}: {value!r}: no such file or directory; {fix}" if looks_like_path(value) else ""
    if found.startswith(("unreadable", "a name too long", "below a regular file")):
        return f"{key}: {value!r} is {found}; {fix}"
    if not os.access(path, os.R_OK) or (path.is_dir() and not os.access(path, os.X_OK)):
        return f"{key}: {value!r} is not readable by this user; fix its permissions or {fix}"
    if path.is_dir():
        if (path / MANIFEST).is_file() or any(p.suffix in FILE_FORMATS for p in path.rglob("*")):
            return ""
        return f"{key}: {value!r} is a directory with no {'/'.join(FILE_FORMATS)} file and no {MANIFEST}; {fix}"
    if not path.is_file():
        return f"{key}: {value!r} is not a regular file (a FIFO, a device or a socket); {fix}"
    if path.suffix not in FILE_FORMATS:
        return f"{key}: {value!r}: the trainer does not read {path.suffix or 'suffix-less'} files; {fix}"
    return ""


def chat_template_problem(value) -> str:
    """'' when data.chat_template is None, a shipped name or a readable file."""
    if value is None or value in shipped_templates():
        return ""
    path = template_file(value)
    if path.is_file() and os.access(path, os.R_OK):
        return ""
    return (f"data.chat_template: {value!r} is neither a shipped template ({', '.join(shipped_templates())}) nor a "
            f"readable file (there is none at {path}); set it to one of those names or to a Jinja file, absolute or "
            f"relative to the repo root")


def model_directory_problem(key: str, value: str) -> str:
    """'' unless `value` is written as a local path (not a hub id) and is not a readable directory."""
    path = Path(value).expanduser()
    local = value.startswith((".", "/", "~")) or value.count("/") > 1
    found = what_is(path)
    if found == "a directory" and os.access(path, os.R_OK | os.X_OK):
        return ""
    if found == "missing":
        return f"{key}: {value!r}: no such directory; give a local model directory or a hub id (org/name)" \
            if local else ""
    if found == "a regular file":  # tokenizer.json or config.json itself: transformers wants their directory
        return f"{key}: {value!r} is a file; give the directory that holds it ({str(path.parent)!r}) or a hub id"
    what = "a directory this user cannot read" if found == "a directory" else found
    return f"{key}: {value!r} is {what}; give a model directory (config.json, weights) or a hub id"
