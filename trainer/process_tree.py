"""Stop a command and everything it started, leaving nothing behind: the session and every descendant are frozen
first (SIGSTOP: a frozen parent neither exits, orphaning its children to PID 1, nor starts new ones), then killed.
A descendant can leave the session - ninja puts each compiler in a process group of its own, sshd gives each login
a session, DeepSpeed's launcher starts ranks - so both are followed. A JIT build killed that way leaves its `lock`
file, which every later run would wait on: the lock of a build that was running in the stopped tree is removed with
it. A process that left both the tree and the session (a daemon) is found by a marker in its environment
(`leftovers`). Used by the tests (tests/processes.py) and by scripts/gpu_check.py's item budgets.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Optional

import psutil


def tree(pid: int) -> dict[int, psutil.Process]:
    """`pid`, its descendants, and every process in the sessions of those (an orphan stays in its session)."""
    found: dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(pid)
        found[pid] = root
        found.update({p.pid: p for p in root.children(recursive=True)})
    except psutil.NoSuchProcess:
        pass
    sessions = {_session(p) for p in found.values()} | {pid}
    sessions.discard(None)
    sessions.discard(os.getsid(0))  # never the test runner's own session
    for proc in psutil.process_iter():
        if proc.pid not in found and proc.pid != os.getpid() and _session(proc) in sessions:
            found[proc.pid] = proc
    return found


def _session(proc: psutil.Process) -> Optional[int]:
    try:
        return os.getsid(proc.pid)
    except OSError:
        return None


def stop_tree(pid: int) -> int:
    """Freeze, then kill, `pid` and everything it started (see `tree`); remove the lock files of the JIT builds
    that were running in it. Returns how many processes were stopped."""
    frozen: dict[int, psutil.Process] = {}
    while True:  # until a pass finds no process that was not frozen yet
        new = {p: proc for p, proc in tree(pid).items() if p not in frozen}
        new.update({p: proc for f in list(frozen) for p, proc in tree(f).items() if p not in frozen})
        if not new:
            break
        for proc in new.values():
            _signal(proc, signal.SIGSTOP)
        frozen.update(new)
    locks = _build_locks(frozen.values())
    for proc in frozen.values():
        _signal(proc, signal.SIGKILL)
    psutil.wait_procs(list(frozen.values()), timeout=10)
    for lock in locks:
        lock.unlink(missing_ok=True)
    return len(frozen)


def _signal(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        pass


def _build_locks(procs) -> list[Path]:
    """The `lock` files of torch JIT builds whose ninja or compiler is among `procs` (they work in the op's
    directory): killing them leaves the file, and every later run that needs the op would wait on it."""
    locks = []
    for proc in procs:
        try:
            cwd = Path(proc.cwd())
        except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
            continue
        if (cwd / "lock").is_file() and (cwd / "build.ninja").is_file():
            locks.append(cwd / "lock")
    return locks


def marked(marker: str) -> list[psutil.Process]:
    """Live processes (other than this one) whose command line or environment holds `marker`."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            text = " ".join(proc.cmdline()) + "\0" + Path(f"/proc/{proc.pid}/environ").read_text(errors="replace")
        except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
            continue
        if marker in text:
            found.append(proc)
    return found


def leftovers(marker: str) -> list[str]:
    """`marked(marker)` as 'pid name' lines, for a test's failure message."""
    names = []
    for proc in marked(marker):
        try:
            names.append(f"{proc.pid} {proc.name()}")
        except psutil.NoSuchProcess:
            continue
    return names


def stop_all(pid: int, marker: str) -> int:
    """`stop_tree(pid)`, then every process still carrying `marker` with its own tree (one that left both the tree
    and the session, a daemon, still inherited the environment). Returns how many processes were stopped."""
    stopped = stop_tree(pid)
    for proc in marked(marker):
        stopped += stop_tree(proc.pid)
    return stopped
