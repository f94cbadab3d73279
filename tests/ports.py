"""TCP ports for the suite's jobs, from one allocator that holds them.

Every port a test hands to a job (a launch's --master_port, a private sshd, a one-rank process group) comes from
`take_port`. A port is taken by an exclusive `flock` on its file in one machine-wide directory, kept until this
test session ends, so two pytest sessions on one machine (two people, a helper beside CI, `-n` workers) never hand
out the same port, and one session never hands out a port twice: DeepSpeed names its /dev/shm buffers by port, and a
port reused inside one session could meet a buffer a killed job left on it. A taken port must also be bindable
right now (nothing outside the allocator listens on it, no TIME_WAIT left on it). Ports come from below Linux's
ephemeral range (32768-60999), which the kernel hands out to outgoing connections - gloo's among them.
"""
from __future__ import annotations

import fcntl
import os
import socket
import tempfile
from pathlib import Path

LOCKS = Path(tempfile.gettempdir()) / "trainer-test-ports"
FIRST, LAST = 20000, 32000
_held: dict[int, int] = {}  # port -> the open lock file holding it, for this session


def _start() -> int:
    """TRAINER_TEST_PORT, else a start spread by pid (sessions started together look in different places first)."""
    chosen = os.environ.get("TRAINER_TEST_PORT")
    if chosen:
        return int(chosen)
    return FIRST + (os.getpid() * 37) % (LAST - FIRST)


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("0.0.0.0", port))  # no SO_REUSEADDR: a port in TIME_WAIT is skipped too
        except OSError:
            return False
    return True


def take_port() -> int:
    """A port no other job of this machine's test sessions has, free now; held until the session ends."""
    LOCKS.mkdir(mode=0o1777, exist_ok=True)
    start = _start()
    span = LAST - FIRST
    for offset in range(span):
        port = FIRST + (start - FIRST + offset) % span
        if port in _held:
            continue
        fd = os.open(LOCKS / str(port), os.O_CREAT | os.O_RDWR, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        if not _bindable(port):
            os.close(fd)  # closing drops the lock
            continue
        _held[port] = fd
        return port
    raise RuntimeError(f"no free port in {FIRST}-{LAST}: {len(_held)} held by this session")


def taken() -> list[int]:
    """The ports this session took (for the clean-up of what their jobs left behind)."""
    return sorted(_held)


def release_all() -> None:
    for fd in _held.values():
        os.close(fd)
    _held.clear()
