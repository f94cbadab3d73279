"""Every path a user gives on the command line, checked for what it is before the command does anything.

`what_is(path)` says what is at a path in the words an error needs (missing, a directory, a FIFO, a device, below
a regular file, unreadable, ...), so no message calls a FIFO "missing". The flag types below (argparse calls them
while parsing, so a bad path is exit 2 naming the flag) check inputs are there and readable, and outputs can be
written -- the parent is a writable directory, the target is not a directory or a device -- without creating
anything. `check_distinct` refuses one command's two outputs naming the same file, or an output naming one of
its inputs (`plan -o X --chart X`, `report -o RUN/metrics.jsonl`).
"""
from __future__ import annotations

import argparse
import errno
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .errors import UserError

STDOUT = "-"
# C0/C1 controls and the Unicode line separators (str.splitlines breaks at them too): none belongs in a name or path
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def control_characters(text: str) -> str:
    """'' for one-line text, else what it holds: 'a newline (U+000A)'."""
    found = sorted(set(CONTROL.findall(text)))
    names = {"\n": "a newline", "\r": "a carriage return", "\t": "a tab"}
    return ", ".join(f"{names.get(c, 'a control character')} (U+{ord(c):04X})" for c in found)


def what_is(path: str | Path) -> str:
    """'a regular file', 'a directory', 'a FIFO', 'a character device', 'a block device', 'a socket', 'missing',
    'below a regular file' (a parent is a file), or 'unreadable (...)'."""
    try:
        mode = os.stat(Path(path).expanduser()).st_mode
    except FileNotFoundError:
        return "missing"
    except NotADirectoryError:
        return "below a regular file (a parent in the path is a file, not a directory)"
    except OSError as err:
        if err.errno == errno.ENAMETOOLONG:
            return "a name too long for the file system"
        return f"unreadable ({err.strerror})"
    for test, name in ((stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def is_there(path: str | Path, what: str) -> bool:
    """Whether something is at `path` (Path.exists() says False for a symlink loop, a name too long or a parent
    that is a file: each then read as "no such file"). False only when it is missing; a UserError naming `what` and
    what stands in the way when it cannot be looked at."""
    found = what_is(path)
    if found == "missing":
        return False
    if found.startswith(("unreadable", "a name too long", "below a regular file")):
        raise UserError(f"{what} {str(path)!r} is {found}")
    return True


def missing_or_what(path: str | Path) -> str:
    """`what_is` phrased after the path: 'does not exist', 'is a directory', ..."""
    found = what_is(path)
    return "does not exist" if found == "missing" else f"is {found}"


@dataclass(frozen=True)
class PathKind:
    """A flag's path: an input file or directory that must be there, or an output file or directory that must be
    writable. Called by argparse with the text; returns it unchanged (the command opens it)."""
    role: str                    # "input" or "output"
    want: str                    # "file" or "directory"
    what: str                    # "prompts file", "output directory": the words of an error
    stdout_ok: bool = False      # an output file that may be '-' (stdout)
    suffixes: tuple[str, ...] = ()  # an output file's allowed suffixes ('.png', '.html'); () = any

    @property
    def __name__(self) -> str:
        return self.what

    def __call__(self, text: str) -> str:
        try:
            self.check(text)
        except UserError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
        return text

    def check(self, text: str) -> None:
        if not text.strip():
            raise UserError(f"{self.what}: empty; give a path")
        if "\0" in text:
            raise UserError(f"{self.what} {text!r}: a path cannot hold a NUL byte")
        if self.role == "output" and CONTROL.search(text):  # `--out "x<newline>"` (a pasted line) made "x\n"
            raise UserError(f"{self.what} {text!r} holds {control_characters(text)}: it would become part of the "
                            f"name of what is written; remove it (a line pasted with its newline?)")
        if self.role == "input":
            self._check_input(text)
        elif self.want == "file":
            self._check_output_file(text)
        else:
            self._check_output_dir(text)

    def _check_input(self, text: str) -> None:
        found = what_is(text)
        wanted = "a regular file" if self.want == "file" else "a directory"
        if found != wanted:
            hint = "give a file" if self.want == "file" else "give a directory"
            raise UserError(f"{self.what} {text!r} {missing_or_what(text)}: {hint}")
        if not os.access(Path(text).expanduser(), os.R_OK | (os.X_OK if self.want == "directory" else 0)):
            raise UserError(f"{self.what} {text!r} is not readable by this user")

    def _check_output_file(self, text: str) -> None:
        if text == STDOUT and self.stdout_ok:
            return
        path = Path(text).expanduser()
        if self.suffixes and path.suffix.lower() not in self.suffixes:
            raise UserError(f"{self.what} {text!r}: the name must end in {' or '.join(self.suffixes)}")
        found = what_is(path)
        if found not in ("missing", "a regular file"):
            hint = " (or '-' for stdout)" if self.stdout_ok else ""
            raise UserError(f"{self.what} {text!r} {missing_or_what(path)}: give a file path{hint}")
        _writable_directory(path.parent, f"{self.what} {text!r}")

    def _check_output_dir(self, text: str) -> None:
        path = Path(text).expanduser()
        found = what_is(path)
        if found == "a directory":
            if not os.access(path, os.W_OK | os.X_OK):
                raise UserError(f"{self.what} {text!r} is not writable by this user")
            return
        if found != "missing":
            raise UserError(f"{self.what} {text!r} {missing_or_what(path)}: give a directory (new or existing)")
        _writable_directory(_nearest_existing(path), f"{self.what} {text!r}")


def _nearest_existing(path: Path) -> Path:
    """The closest ancestor that exists (where a new directory would be made)."""
    for parent in path.absolute().parents:
        if what_is(parent) != "missing":
            return parent
    return Path("/")


def _writable_directory(directory: Path, subject: str) -> None:
    found = what_is(directory)
    if found == "missing":
        raise UserError(f"{subject}: directory {directory} does not exist; create it first")
    if found != "a directory":
        raise UserError(f"{subject}: {directory} is {found}, not a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UserError(f"{subject}: directory {directory} is not writable by this user")


def input_file(what: str) -> PathKind:
    return PathKind("input", "file", what)


def input_dir(what: str) -> PathKind:
    return PathKind("input", "directory", what)


def output_file(what: str, stdout_ok: bool = False, suffixes: tuple[str, ...] = ()) -> PathKind:
    return PathKind("output", "file", what, stdout_ok, suffixes)


def output_dir(what: str) -> PathKind:
    return PathKind("output", "directory", what)


def check_distinct(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Optional[str]:
    """A message when two output paths of this command are one file, or an output is one of its inputs (through
    a link or another spelling too); None when all are distinct."""
    seen: list[tuple[str, str, str]] = []  # (flag, path, role)
    for action in parser._actions:
        if not isinstance(action.type, PathKind):
            continue
        values = getattr(args, action.dest, None)
        for value in values if isinstance(values, list) else [values]:
            if isinstance(value, str) and value != STDOUT:
                flag = action.option_strings[0] if action.option_strings else action.dest.upper()
                seen.append((flag, value, action.type.role))
    for i, (flag, value, role) in enumerate(seen):
        for other_flag, other, other_role in seen[:i]:
            if "output" in (role, other_role) and _same(value, other):
                return (f"{other_flag} {other!r} and {flag} {value!r} are the same file: one would overwrite the "
                        f"other; give different paths")
    return None


def _same(a: str, b: str) -> bool:
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    try:
        return os.path.samefile(pa, pb)
    except OSError:
        return os.path.abspath(pa) == os.path.abspath(pb)
