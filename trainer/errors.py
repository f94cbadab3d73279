"""Errors a user can fix. The CLI prints them without a traceback and exits non-zero."""
from __future__ import annotations

import difflib
import reprlib
from typing import Iterable


class UserError(Exception):
    """Bad input (a preset, a flag, a file) with a message that says what and where, and how to fix it."""


class ConfigError(UserError):
    """Every problem found in one config, reported together."""

    def __init__(self, problems: list[str], source: str = ""):
        self.problems = list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{len(self.problems)} problem(s){where}:\n{lines}")


def closest(key: str, valid: Iterable[str]) -> str:
    """' (did you mean X?)' for the nearest valid key, or '' when nothing is close."""
    match = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def short(value, limit: int = 120) -> str:
    """repr(value) cut to about `limit` characters: a message quotes what the user gave, not 39 MB of it."""
    text = _REPR.repr(value)  # reprlib: a nested value is abbreviated while it is written, not after
    if len(text) <= limit:
        return text
    return f"{text[:limit]}..."


def clip(text: str, limit: int = 120) -> str:
    """`text` cut to `limit` characters, for quoting a user's string (a `--set` item) in a message."""
    return text if len(text) <= limit else f"{text[:limit]}..."


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict, _REPR.maxset = 4, 8, 8, 8, 8
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 200
