"""The installed libraries' own source, read as text (never imported: the doctor stays a light command).

A log's traceback names files and functions of the libraries that ran; the same libraries are installed where the
doctor runs (DeepSpeed at this trainer's pin). Reading their source answers what the log cannot:
- which library a frame belongs to when the file sits outside site-packages (DeepSpeed's `ds_to_universal.py` or
  `zero_to_fp32.py` run as scripts, the latter copied into every checkpoint directory);
- whether the installed release still runs the line that raised: the same line in the same function (a newer
  release does not fix it), another line there (the code changed since), or no such function;
- where a line the log quotes without its frame comes from (a traceback cut to its last line and carets).
"""
from __future__ import annotations

import ast
import difflib
import functools
import importlib.util
import re
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Optional

from .logtext import Frame

LIBRARIES = ("deepspeed", "accelerate", "peft", "trl", "transformers")  # searched in this order (transformers: largest)
NAME = re.compile(r"[A-Za-z_]\w*")
SAME_LINE = 0.8  # difflib ratio from which a quoted line is the installed one with a renamed attribute or two


@dataclass(frozen=True)
class Place:
    """A line of an installed library: the package, the file (relative to the package), the function around it."""
    package: str
    file: str
    function: str
    line: int
    code: str

    @property
    def version(self) -> str:
        return installed_version(self.package)

    def short(self) -> str:
        return f"{self.package}/{self.file}:{self.line} in {self.function}"


@dataclass(frozen=True)
class Compared:
    """The raising frame against the installed release: `same` (that function still runs that line), `changed` (the
    function is there, the line is not), `gone` (no such function in that file)."""
    place: Place
    state: str


def installed_version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""


@functools.lru_cache(maxsize=None)
def root(package: str) -> Optional[Path]:
    try:
        spec = importlib.util.find_spec(package)  # a top-level name: found, not imported
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@functools.lru_cache(maxsize=None)
def sources(package: str) -> tuple[Path, ...]:
    base = root(package)
    return tuple(sorted(base.rglob("*.py"))) if base else ()


@functools.lru_cache(maxsize=256)
def _text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


@functools.lru_cache(maxsize=64)
def _functions(path: Path) -> dict[str, list[tuple[int, int]]]:
    """Every function (methods and nested ones included) of a file -> its (first, last) line spans."""
    try:
        tree = ast.parse(_text(path))
    except (SyntaxError, ValueError):
        return {}
    out: dict[str, list[tuple[int, int]]] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.setdefault(node.name, []).append((node.lineno, node.end_lineno or node.lineno))
    return out


def file_of(frame: Frame) -> Optional[tuple[str, Path]]:
    """(package, installed file) of a frame: by its path under site-packages, else (a library's script run from
    elsewhere) by a file of the same name in an installed library that defines the frame's function."""
    parts = re.split(r"[\\/]", frame.file)
    if frame.package and root(frame.package) is not None and frame.package in parts:
        relative = parts[len(parts) - 1 - parts[::-1].index(frame.package) + 1:]
        path = root(frame.package).joinpath(*relative)
        return (frame.package, path) if path.is_file() else None
    name = parts[-1]
    if not name.endswith(".py") or frame.package:
        return None
    for package in LIBRARIES:
        for path in sources(package):
            if path.name == name and frame.func in _functions(path):
                return package, path
    return None


def compare(frame: Frame) -> Optional[Compared]:
    """The frame's line against the installed release of its library; None when neither the file nor its code is
    known here."""
    found = file_of(frame)
    code = frame.code.strip()
    if found is None or not code:
        return None
    package, path = found
    relative = path.relative_to(root(package)).as_posix()
    spans = _functions(path).get(frame.func)
    if not spans:
        return Compared(Place(package, relative, frame.func, 0, ""), "gone")
    lines = _text(path).split("\n")
    body = [(n, lines[n - 1].strip()) for first, last in spans for n in range(first, last + 1) if n <= len(lines)]
    exact = next(((n, c) for n, c in body if c == code), None)
    if exact:
        return Compared(Place(package, relative, frame.func, *exact), "same")
    near = max(body, key=lambda nc: difflib.SequenceMatcher(None, nc[1], code).ratio())
    return Compared(Place(package, relative, frame.func, *near), "changed")


def locate(code: str) -> Optional[Place]:
    """The installed line a quoted line of code is (exactly, or but for a renamed name or two), found by its rarest
    name: the longest identifier it uses."""
    code = code.strip()
    names = sorted({n for n in NAME.findall(code) if len(n) >= 8}, key=len, reverse=True)
    if not names:
        return None
    best: Optional[tuple[float, Place]] = None
    for package in LIBRARIES:
        for path in sources(package):
            text = _text(path)
            if names[0] not in text:
                continue
            for number, line in enumerate(text.split("\n"), 1):
                if names[0] in line:
                    ratio = difflib.SequenceMatcher(None, line.strip(), code).ratio()
                    if ratio >= SAME_LINE and (best is None or ratio > best[0]):
                        best = (ratio, Place(package, path.relative_to(root(package)).as_posix(),
                                             _around(path, number), number, line.strip()))
        if best:
            return best[1]
    return None


def _around(path: Path, number: int) -> str:
    """The innermost function whose lines hold `number`."""
    inside = [(first, name) for name, spans in _functions(path).items() for first, last in spans
              if first <= number <= last]
    return max(inside)[1] if inside else "<module>"


def script(name: str) -> Optional[tuple[str, Path]]:
    """(package, file) of an installed library's script by its file name (`zero_to_fp32.py`)."""
    for package in LIBRARIES:
        for path in sources(package):
            if path.name == name and "add_argument(" in _text(path):
                return package, path
    return None


def positionals(path: Path) -> list[tuple[str, str]]:
    """(name, help) of each positional argument the script's argparse declares, in source order."""
    try:
        tree = ast.parse(_text(path))
    except (SyntaxError, ValueError):
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str) and not first.value.startswith("-"):
                help_text = next((kw.value for kw in node.keywords if kw.arg == "help"), None)
                found.append((node.lineno, first.value, help_text.value if isinstance(help_text, ast.Constant) else ""))
    return [(name, help_text) for _, name, help_text in sorted(found)]
