"""The per-test CPU measurement (tests/cpu_account.py, TRAINER_TEST_CPU=1) counts what a test's processes spend,
children included - here a child that burns CPU and exits before the count is read."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import cpu_account

pytestmark = pytest.mark.quick

PROBE = """
import os, subprocess, sys
sys.path.insert(0, {tests!r})
import cpu_account
group = cpu_account.enter()
if group is None:
    print("no-cgroup"); raise SystemExit(0)
before = cpu_account.usage_s(group)
subprocess.run([sys.executable, "-c", "import time\\nend = time.process_time() + 0.6\\nwhile time.process_time() < end: pass"], check=True)
print(round(cpu_account.usage_s(group) - before, 2))
cpu_account.leave(group)
"""


def test_a_childs_cpu_is_counted_in_the_workers_group():
    env = {**os.environ, "TRAINER_TEST_CPU": "1"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(tests=str(Path(__file__).parent))], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    if out.stdout.strip() == "no-cgroup":
        pytest.skip("no writable cgroup v1 cpuacct hierarchy here: the measurement records nothing")
    assert 0.55 <= float(out.stdout) < 5, out.stdout


def test_without_the_variable_nothing_is_entered(monkeypatch):
    monkeypatch.delenv("TRAINER_TEST_CPU", raising=False)
    assert cpu_account.enter() is None
