"""Measurements for tests/test_gpu_check.py's items. They run in the spawned process each item gets, which
imports this module to find them: it imports nothing heavy, so an item's process starts in a fraction of a second."""
from __future__ import annotations

import subprocess
import sys
import time

import gpu_check_items as gi


def measure_fine(ctx, prepared, deadline):
    return "passed", {"value": 1}, "fine"


def measure_low(ctx, prepared, deadline):
    return "missed", {}, "low"


def measure_odd(ctx, prepared, deadline):
    return "great", {}, ""


def measure_nan(ctx, prepared, deadline):
    return "missed", {"loss": [1.0, float("nan")], "mfu": float("inf")}, "x"


def measure_half(ctx, prepared, deadline):
    raise gi.PartialFailure("z3_ckpt_mb2: exit 1", {"rows": [{"name": "z2_mb1", "ratio": 1.02}]})


def measure_stuck_with_a_tree(ctx, prepared, deadline):
    """A launch that hangs: a child, a grandchild, and a daemon that left the session (as ninja's compilers and
    DeepSpeed's ranks leave the group), all sleeping past any budget."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
    subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                      f"subprocess.Popen({sleeper!r}); time.sleep(600)"])
    subprocess.Popen(sleeper, start_new_session=True)
    time.sleep(600)
