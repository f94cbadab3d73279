"""Permission to run a model's own Python code, and only the user gives it.

transformers runs code shipped with a model or tokenizer (`auto_map` in its config, `*.py` files beside it) when
it is loaded with `trust_remote_code=True`. Here that permission comes from the user, never from a file the
trainer reads on the way:

  train              the preset the user names, or `--set model.trust_remote_code=true`
  generate/evaluate  `--trust-remote-code` on the command line; a checkpoint's or run's saved config that says
                     `model.trust_remote_code: true` is not obeyed (a copied checkpoint is not a trusted preset)

Every load passes the decision explicitly (`load_kwargs`): `False`, not "unset", so transformers never asks on
stdin (a piped "y" would answer it). When permission is given, the notice names the code that may run.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

from .errors import UserError


CONFIG_FILES = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json",
                "adapter_config.json")
_ANNOUNCED: set[tuple[str, str]] = set()


def load_kwargs(allowed: bool, location: str, what: str) -> dict:
    """The keyword transformers' `from_pretrained` gets for `location` (a directory or hub id): always an explicit
    bool, with a notice naming the code when it is True."""
    if allowed:
        announce(location, what)
    return {"trust_remote_code": bool(allowed)}


def announce(location: str, what: str) -> None:
    """One notice per location and purpose: which code transformers may run."""
    if (location, what) in _ANNOUNCED:
        return
    _ANNOUNCED.add((location, what))
    found = code_in(location)
    listed = ", ".join(found) if found else "none found on disk (a hub repo's code is known only once downloaded)"
    print(f"notice: trust_remote_code is on for the {what} {location}: transformers may run its own Python code: "
          f"{listed}", file=sys.stderr, flush=True)


def code_in(location: str) -> list[str]:
    """The code a model directory can make transformers run: its `*.py` files and the classes its configs'
    `auto_map` names (for a hub id: only what is known without downloading, i.e. nothing)."""
    directory = Path(location).expanduser()
    if not directory.is_dir():
        return []
    found = sorted(str(p) for p in directory.glob("*.py"))
    for name in CONFIG_FILES:
        found += [f"{directory / name}: auto_map {key} -> {ref}" for key, ref in _auto_map(directory / name)]
    return found


def _auto_map(path: Path) -> list[tuple[str, str]]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    mapping = raw.get("auto_map") if isinstance(raw, dict) else None
    if not isinstance(mapping, dict):
        return []
    return [(str(key), ref if isinstance(ref, str) else ", ".join(str(r) for r in ref if r) if isinstance(ref, list)
             else str(ref)) for key, ref in mapping.items()]


def refused(err: BaseException, location: str, how_to_allow: str) -> Optional[UserError]:
    """The error to raise when transformers refused to load `location` because it needs its own code (None when
    `err` is about something else)."""
    text = str(err)
    if "trust_remote_code" not in text and "custom code" not in text:
        return None
    found = code_in(location)
    listed = f" ({', '.join(found[:4])}{', ...' if len(found) > 4 else ''})" if found else ""
    return UserError(f"{location} needs its own Python code to load{listed}, and permission to run it was not "
                     f"given; read that code, and if you trust it {how_to_allow}")


def saved_permission_ignored(saved: bool, allowed: bool, where: str) -> None:
    """A saved config that asks for code permission the command line did not give: said, not obeyed."""
    if saved and not allowed:
        print(f"notice: {where} was saved with model.trust_remote_code: true; permission to run a model's code is "
              f"not taken from a saved file, so it is off (pass --trust-remote-code if you trust the model's code)",
              file=sys.stderr, flush=True)
