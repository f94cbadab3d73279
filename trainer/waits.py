"""Long waits said out loud: what the process is waiting for, every 30 s while it lasts.

Some waits are long and print nothing of their own: a DeepSpeed op compiling (1.5-3 min on 2 cores), the first
eval, a rank polling the `lock` file of another rank's build. The code that starts such a wait says so in one
line and wraps it in `during(...)`; one watcher thread per process (started by `watch`) then prints, every
report_every() seconds (TRAINER_WAIT_REPORT_S, default 30), what the main thread is still waiting for and for
how long. Probes (trainer/jit_locks.py's "waiting on a lock") are asked first: they know more than the activity.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

REPORT_EVERY_S = 30.0
ENV_VARS = ("TRAINER_WAIT_REPORT_S", "TRAINER_JIT_LOCK_REPORT_S")  # the second: its name before it covered more

TICK_S = 1.0  # how often the watcher looks: a wait is reported report_every() seconds after it began, not later
Probe = Callable[[float, float], Optional[str]]  # (now, every) -> a line when one is due, else None


@dataclass
class Activity:
    """What the main thread is doing; `still(seconds so far)` is the heartbeat line."""
    still: Callable[[float], str]
    started: float = field(default_factory=time.monotonic)
    reported: float = 0.0  # when it was last reported (0: never; counted from `started`)


_activities: list[Activity] = []  # a stack: the innermost wait is the one reported
_probes: list[Probe] = []
_emit: Optional[Callable[[str], None]] = None
_watcher: Optional[threading.Thread] = None
_lock = threading.Lock()


def duration(seconds: float) -> str:
    """'0.4 s', '42 s', '3.4 min': how the wait lines say a length of time."""
    if seconds < 1:
        return f"{seconds:.1f} s"
    if seconds < 100:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min"


def report_every() -> float:
    for name in ENV_VARS:
        if os.environ.get(name):
            try:
                return max(0.1, float(os.environ[name]))
            except ValueError:
                break
    return REPORT_EVERY_S


@contextlib.contextmanager
def during(still: Callable[[float], str]) -> Iterator[Activity]:
    """While the block runs, the watcher reports `still(seconds so far)` every report_every() seconds."""
    activity = Activity(still)
    with _lock:
        _activities.append(activity)
    try:
        yield activity
    finally:
        with _lock:
            _activities.remove(activity)


def watch(emit: Callable[[str], None], probe: Optional[Probe] = None) -> None:
    """Start (once per process) the watcher that prints through `emit`; `probe` is asked before the activities."""
    global _watcher, _emit
    with _lock:
        if probe is not None and probe not in _probes:
            _probes.append(probe)
        _emit = _emit or emit
        if _watcher is None:
            _watcher = threading.Thread(target=_watch, args=(report_every(),), name="waits-watch", daemon=True)
            _watcher.start()


def report_now(every: float, now: Optional[float] = None) -> Optional[str]:
    """The line due at `now`, if any: a probe's, else the innermost activity's once `every` seconds have passed
    since it began or was last reported."""
    now = time.monotonic() if now is None else now
    with _lock:
        current = _activities[-1] if _activities else None
    for probe in list(_probes):
        line = probe(now, every)
        if line:
            if current is not None:
                current.reported = now  # the probe said it (a lock wait inside a build): no second line
            return line
    if current is None or now - (current.reported or current.started) < every:
        return None
    current.reported = now
    return current.still(now - current.started)


def _watch(every: float) -> None:
    while True:
        time.sleep(min(TICK_S, every))
        line = report_now(every)
        if line and _emit is not None:
            _emit(line)
