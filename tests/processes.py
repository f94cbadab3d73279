"""Processes a test starts, and nothing left of them afterwards.

`run_group` starts a command in its own session (a fork of the worker's preloaded interpreter where it can be one,
tests/preloaded.py), streams its output (lines saying what a launch waits for -
op builds, lock waits, a fixture's runs - and a line a minute reach the terminal through `progress`, which
conftest sets), and on a timeout, a `stop_on` line or any exception stops the command with everything it
started (`stop_tree`, trainer/process_tree.py: frozen, then killed, its JIT build locks removed).
"""
from __future__ import annotations

import os
import queue
import re
import subprocess
import threading
import time
from typing import Callable, Optional

import preloaded
from trainer.process_tree import leftovers, stop_tree, tree  # noqa: F401 - the tests import them from here

progress: Optional[Callable[[str], None]] = None  # set by conftest: a line on the terminal while a test runs
HEARTBEAT_S = 60.0
# What a launch waits for, said by the trainer (trainer/jit_ops.py, jit_locks.py, the first eval) and by the
# test workers (run_many's runs): the lines the terminal gets while a test runs.
NOTABLE = re.compile(r"(op \w+: (not built|still|built in|rebuilt)|waiting \S+( \S+)? on a JIT build's lock|"
                     r"stale JIT lock|eval at step \d+: still|^run_many: )")


def say(line: str) -> None:
    if progress is not None:
        progress(line)


def current_test() -> str:
    """The running test (pytest's PYTEST_CURRENT_TEST, without the file path), for the progress lines."""
    return os.environ.get("PYTEST_CURRENT_TEST", "").split("::", 1)[-1]


def run_group(cmd: list[str], *, cwd, env: Optional[dict] = None, timeout: float, merge: bool = True,
              stop_on: Optional[re.Pattern] = None) -> subprocess.CompletedProcess:
    """Run `cmd` in its own session; stdout and stderr merged into stdout (or kept apart with merge=False).
    A timeout or a line matching `stop_on` stops the whole tree and raises subprocess.TimeoutExpired (with the
    output); whatever ends the run, nothing it started is left running."""
    proc = preloaded.start(cmd, cwd, env, merge) or subprocess.Popen(
        cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge else subprocess.PIPE, text=True, errors="replace", start_new_session=True)
    lines: "queue.Queue[tuple[int, str]]" = queue.Queue()
    streams = [proc.stdout] if merge else [proc.stdout, proc.stderr]
    readers = [threading.Thread(target=_read, args=(stream, index, lines), daemon=True)
               for index, stream in enumerate(streams)]
    for reader in readers:
        reader.start()
    collected: list[list[str]] = [[] for _ in streams]
    stopped = False
    try:
        stopped = _follow(proc, lines, collected, time.monotonic() + timeout, stop_on)
    finally:
        stop_tree(proc.pid)  # also after a normal exit: what the command left in its session goes with it
        proc.wait()
        for reader in readers:
            reader.join(timeout=10)
        _drain(lines, collected, None)
    out = ["".join(part) for part in collected]
    if stopped:
        raise subprocess.TimeoutExpired(cmd, timeout, output=out[0], stderr=None if merge else out[1])
    return subprocess.CompletedProcess(cmd, proc.returncode, out[0], None if merge else out[1])


def _read(stream, index: int, lines: queue.Queue) -> None:
    for line in stream:
        lines.put((index, line))


def _follow(proc, lines: queue.Queue, collected, deadline: float, stop_on) -> bool:
    """Until the command exits: collect its lines, say the notable ones, and a line a minute. True when it was
    stopped (the deadline passed or a line matched `stop_on`)."""
    started = last_said = time.monotonic()
    while proc.poll() is None:
        matched, said = _drain(lines, collected, stop_on)
        if matched:
            return True
        now = time.monotonic()
        last_said = now if said else last_said
        if now > deadline:
            say(f"{current_test()}: timed out after {now - started:.0f} s; stopping it and everything it started")
            return True
        if now - last_said >= HEARTBEAT_S:
            tail = next((line.strip() for part in collected for line in reversed(part) if line.strip()), "")
            say(f"{current_test()}: still running ({(now - started) / 60:.0f} min); last line: {tail[-120:]}")
            last_said = now
        try:
            proc.wait(timeout=0.2)  # back as soon as it exits: a short command is not held to the next 0.2 s
        except subprocess.TimeoutExpired:
            pass
    return _drain(lines, collected, stop_on)[0]


def _drain(lines: queue.Queue, collected, stop_on) -> tuple[bool, bool]:
    """Take the lines read so far; (a line matched `stop_on`, a line was said)."""
    matched = said = False
    while True:
        try:
            index, line = lines.get_nowait()
        except queue.Empty:
            return matched, said
        collected[index].append(line)
        if NOTABLE.search(line):
            say(f"{current_test()}: {line.strip()[:240]}")
            said = True
        if stop_on is not None and stop_on.search(line):
            matched = True
