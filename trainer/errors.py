"""Errors a user can fix. The CLI prints them without a traceback and exits non-zero."""
from __future__ import annotations

import difflib
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
