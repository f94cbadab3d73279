"""Stale JIT-build locks, named instead of waited on in silence.

DeepSpeed builds its ops (cpu_adam, fused_adam, the CPU shared-memory all-reduce, ...) with torch's
cpp_extension.load, which lets one process build while the others wait: the builder creates
`<extensions dir>/<op>/lock`, builds, and removes it; the rest poll until the file is gone (torch's
FileBaton). A build killed midway (a timeout, a preempted job, Ctrl-C) leaves the file, and every later run
that needs the op waits on it for ever, printing nothing.

So before DeepSpeed loads its ops the ranks look for lock files in the extensions directory
(TORCH_EXTENSIONS_DIR: this environment's, trainer/jit_env.py, or the user's; else torch's default) that no running
build owns, and name them; and while a rank waits on a lock, a watcher prints the file, its age and the
removal command every 30 s (trainer/waits.py's watcher). torch's builder holds the lock file open for as long as it
builds (FileBaton keeps the descriptor of the file it created), so the lock's holder is the live process with that
file open, read from /proc - not any process that happens to sit in the op's directory - and a lock no live process
holds is stale. A stale lock beside an op that is already built is removed, and said: the build it guarded finished.
The printed removal command is quoted by the one shell-quoting function (an op directory named `'$(...)'` stays a
name when pasted).
"""
from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from . import waits
from .shell import quote

GRACE_S = 30.0  # a lock younger than this may be a build that is still writing its ninja file


def extensions_root() -> Path:
    """Where torch builds JIT extensions (the same rule as torch.utils.cpp_extension._get_build_directory)."""
    chosen = os.environ.get("TORCH_EXTENSIONS_DIR")
    if chosen:
        return Path(chosen)
    import torch
    from torch.utils.cpp_extension import get_default_build_root
    accelerator = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip else
                   f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
    tag = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}_{accelerator}"
    return Path(get_default_build_root()) / tag


def holder_of(lock: Path) -> Optional[str]:
    """The live process holding `lock` open (the build that created it), as 'pid N (name)', or None. Reads /proc:
    only processes of this user are visible, as are the builds that could own this user's lock."""
    try:
        target = str(lock.resolve())
    except OSError:
        return None
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if _state(proc) == "Z" or not any(os.readlink(fd) == target for fd in (proc / "fd").iterdir()):
                continue
            return f"pid {proc.name} ({(proc / 'comm').read_text().strip()})"
        except OSError:
            continue
    return None


def builder_in(directory: Path) -> Optional[str]:
    """The build of the op in `directory`: the holder of its lock, or None."""
    return holder_of(directory / "lock")


def _state(proc: Path) -> str:
    """A process's state letter from /proc/PID/stat (Z: a zombie, whose descriptors are closed)."""
    return (proc / "stat").read_text().rsplit(")", 1)[-1].split()[0]


@dataclass(frozen=True)
class Lock:
    path: Path
    age_s: float
    builder: Optional[str]

    @property
    def stale(self) -> bool:
        return self.builder is None and self.age_s >= GRACE_S

    @classmethod
    def at(cls, path: Path) -> Optional["Lock"]:
        try:
            age = time.time() - path.stat().st_mtime
        except OSError:
            return None  # removed meanwhile
        return cls(path, max(0.0, age), holder_of(path))

    def describe(self) -> str:
        op = self.path.parent.name
        built = " its .so is already built;" if (self.path.parent / f"{op}.so").exists() else ""
        if self.builder is not None:
            return (f"JIT lock {self.path} ({_age(self.age_s)} old): {op} is being built by {self.builder} - the "
                    f"ranks wait until it finishes")
        return (f"stale JIT lock {self.path} ({_age(self.age_s)} old, no build running;{built} a killed build left "
                f"it): every run that loads {op} waits on it for ever. Remove it: rm -f {quote(str(self.path))}")

    @property
    def built(self) -> bool:
        return (self.path.parent / f"{self.path.parent.name}.so").exists()


def removed_if_built(lock: Lock) -> Optional[str]:
    """A stale lock beside a built op: removed (no process holds it, the op's .so is there, so the build it guarded
    ended), and what was done; None when the op is not built or the lock could not be removed."""
    if not lock.built:
        return None
    try:
        lock.path.unlink()
    except FileNotFoundError:
        pass  # another rank removed it first
    except OSError:
        return None
    op = lock.path.parent.name
    return (f"removed stale JIT lock {lock.path} ({_age(lock.age_s)} old, no process holds it): {op} is already "
            f"built, so the build that left it had finished; loading {op}")


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def locks(root: Path) -> list[Lock]:
    found = (Lock.at(path) for path in sorted(root.glob("*/lock")))
    return [lock for lock in found if lock is not None]


def waiting_on() -> Optional[Path]:
    """The lock file the main thread is waiting on (its stack is inside torch's FileBaton.wait), or None."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:
        if frame.f_code.co_name == "wait" and frame.f_code.co_filename.endswith("file_baton.py"):
            baton = frame.f_locals.get("self")
            path = getattr(baton, "lock_file_path", None)
            return Path(path) if path else None
        frame = frame.f_back
    return None


class LockProbe:
    """For trainer/waits.py's watcher: the lock the main thread waits on, every `every` seconds while it waits."""

    def __init__(self) -> None:
        self.since: Optional[float] = None
        self.reported = 0.0

    def __call__(self, now: float, every: float) -> Optional[str]:
        path = waiting_on()
        if path is None:
            self.since = None
            return None
        if self.since is None:
            self.since = self.reported = now
        if now - self.reported < every:
            return None
        self.reported = now
        lock = Lock.at(path)
        return None if lock is None else (f"waiting {_age(now - self.since)} on a JIT build's lock - "
                                          f"{lock.describe()}")


_probe = LockProbe()


def check_and_watch(emit: Callable[[str], None]) -> list[Lock]:
    """Before DeepSpeed loads its ops: name the stale locks there are now, and start (once per process) the
    watcher that names the lock a rank waits on, every waits.report_every() seconds, while it waits."""
    try:
        stale = [lock for lock in locks(extensions_root()) if lock.stale]
    except OSError:
        stale = []
    for lock in stale:
        emit(removed_if_built(lock) or lock.describe())
    waits.watch(emit, _probe)
    return stale
