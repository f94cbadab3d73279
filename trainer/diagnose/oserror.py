"""The operating system's answer that a failed call's message states. The same resource - /dev/shm, a checkpoint
directory, a cache - fails for want of room, of permission, or because it is not there, and each needs another fix:
a class that knows the resource asks `stated` which one the log says, instead of assuming the most common.

The words are the C library's own (`os.strerror`: "Permission denied", "No space left on device"), and the
numbers Python and the C++ libraries label as errno beside them ("[Errno 28]", "errno: 13").
"""
from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass
from typing import Optional

from .logtext import Log

# errno -> what it means for a resource the ranks use
KINDS = {
    errno.ENOSPC: "no_space", errno.EDQUOT: "no_space",
    errno.EACCES: "permission", errno.EPERM: "permission",
    errno.ENOENT: "missing",
    errno.EROFS: "read_only",
    errno.EMFILE: "open_files", errno.ENFILE: "open_files",
    errno.ENOMEM: "memory",
    errno.EIO: "io_error",
}
# longest first: "Too many open files in system" (ENFILE) before "Too many open files" (EMFILE)
WORDS = re.compile("|".join(sorted((re.escape(os.strerror(code)) for code in KINDS), key=len, reverse=True)),
                   re.IGNORECASE)
# only numbers labelled errno: NCCL's "NCCL Error 2" and CUDA's "error 2" are their own codes, not the system's
NUMBER = re.compile(r"(?:\[Errno |\berrno(?:: ?| |=))(\d+)\b", re.IGNORECASE)
BY_WORDS = {os.strerror(code).lower(): code for code in KINDS}


@dataclass(frozen=True)
class OsError:
    code: int
    line: str

    @property
    def kind(self) -> str:
        return KINDS[self.code]

    @property
    def words(self) -> str:
        return os.strerror(self.code)


def stated(log: Log, index: int, before: int = 6, after: int = 3) -> Optional[OsError]:
    """The errno the lines around `index` state, the nearest to it first (the evidence line, then the lines before
    it - the call that failed is printed before what it caused - then after); None when they state none."""
    order = [index, *range(index - 1, max(-1, index - before - 1), -1),
             *range(index + 1, min(len(log.lines), index + after + 1))]
    for at in order:
        if not 0 <= at < len(log.lines):
            continue
        line = log.lines[at]
        words = WORDS.search(line)
        if words:
            return OsError(BY_WORDS[words.group(0).lower()], line.strip())
        number = NUMBER.search(line)
        if number and int(number.group(1)) in KINDS:
            return OsError(int(number.group(1)), line.strip())
    return None
