"""Measurement (TRAINER_TEST_CPU=1, docs/tests.md "where the time goes"): the CPU seconds each test costs, its
fixtures and every process it starts included.

The suite is CPU-bound on two cores, so a test's wall time says little: it stretches with whatever the other worker
runs. Each worker (or the one process, with -n 0) moves itself into a cpuacct cgroup of its own before any test
starts; every process it starts after that - preloaded servers, their forked ranks, real launchers and their ranks -
is born in that cgroup, and the kernel counts their CPU there, reaped or not. A test's cost is the cgroup's usage
over its setup, call and teardown, recorded as the JUnit property `cpu_s` (scripts/test_durations.py sums it per
file). Processes started through sshd (the pdsh tests' remote side) are sshd's children and are not counted.

Needs a writable cgroup v1 cpuacct hierarchy (root in a container here); without one nothing is recorded."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

ROOT = Path("/sys/fs/cgroup/cpuacct")
PREFIX = "trainer-tests-"


def enter() -> Optional[Path]:
    """This process (and all it starts from now on) in a fresh cgroup; None when cgroups cannot be written."""
    if not os.environ.get("TRAINER_TEST_CPU") or not (ROOT / "cgroup.procs").exists():
        return None
    _remove_empty_leftovers()
    group = ROOT / f"{PREFIX}{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        return None
    return group


def usage_s(group: Optional[Path]) -> Optional[float]:
    if group is None:
        return None
    try:
        return int((group / "cpuacct.usage").read_text()) / 1e9
    except (OSError, ValueError):
        return None


def leave(group: Optional[Path]) -> None:
    """Back to the parent cgroup; the group itself is removed once nothing runs in it (now, or at a later session's
    start)."""
    if group is None:
        return
    try:
        (ROOT / "cgroup.procs").write_text(str(os.getpid()))
        group.rmdir()
    except OSError:
        pass


def _remove_empty_leftovers() -> None:
    for group in ROOT.glob(f"{PREFIX}*"):
        try:
            if not (group / "cgroup.procs").read_text().strip():
                group.rmdir()
        except OSError:
            pass
