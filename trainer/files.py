"""Writing output files so that a failure never leaves a half-written or truncated one behind."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from .errors import UserError


def check_target(target: str, flag: str = "-o") -> Path:
    """The path to write, refused early (before any work) when it cannot be a file."""
    path = Path(target).expanduser()
    if not target or path.is_dir():
        raise UserError(f"{flag} {target!r}: " + ("a directory" if target else "empty") + "; give a file path")
    if not path.parent.is_dir():
        raise UserError(f"{flag} {target}: directory {path.parent} does not exist")
    return path


def write_text_atomic(target: str, text: str, flag: str = "-o") -> Path:
    """Write `text` to a temporary file beside `target`, then rename it over `target`: a full disk or a crash
    leaves the old file (or none), never part of the new one. Problems are a UserError naming the flag."""
    path = check_target(target, flag)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as err:
        raise UserError(f"{flag} {target}: cannot write it ({err.strerror}); nothing was written") from None
    return path
