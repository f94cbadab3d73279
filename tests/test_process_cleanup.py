"""Tests clean up after themselves (issue 31): a launch that times out is stopped with everything it started -
the launcher, the ranks, and the compilers of a JIT build they run (ninja gives those process groups of their own,
so killing the launch's group alone leaves them) - and the lock file of that build goes with it. Over pdsh/ssh
(tests/test_multinode.py) the "remote" logins are stopped the same way.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid

import pytest

from distributed import REPO, launch_raw
from processes import leftovers, run_group, stop_tree


# a rank says the comm op is being compiled: its own heartbeat, or the lock wait of the rank whose peer compiles it
BUILDING = re.compile(r"op deepspeed_shm_comm: still building \(pid|deepspeed_shm_comm is being built by pid")


@pytest.mark.slow
def test_a_timed_out_two_rank_launch_leaves_no_process_and_no_lock(tmp_path):
    """Stopped while its ranks compile DeepSpeed's comm op (in a private extensions directory: this test kills a
    build midway), as a timeout would: nothing that carried the run's marker is left, nor the build's lock. Real
    processes (not forks of a preloaded server, tests/preloaded.py): the marker must be in each one's /proc environ."""
    marker = f"cleanup-{uuid.uuid4().hex[:12]}"
    ext = tmp_path / "ext"
    with pytest.raises(subprocess.TimeoutExpired) as stopped:
        launch_raw(["train.py", "--preset", "tiny_cpu", "--set", f"train.output_dir={tmp_path / marker}"],
                   timeout=900, env={"TORCH_EXTENSIONS_DIR": str(ext), "TRAINER_WAIT_REPORT_S": "3",
                                     "TEST_MARKER": marker, "TRAINER_TEST_PRELOAD": "0"},
                   stop_on=BUILDING)
    output = stopped.value.output
    assert "op deepspeed_shm_comm: not built for this environment yet" in output  # killed mid-build, as planned
    time.sleep(1)
    assert leftovers(marker) == []
    assert list(ext.glob("*/lock")) == [], "the killed build's lock would make every later run wait"


@pytest.mark.slow
def test_what_a_finished_command_left_in_its_session_is_stopped(tmp_path):
    """A command that exits leaving a child behind (a daemon, a rank its launcher forgot) does not leave it to the
    rest of the suite."""
    marker = f"orphan-{uuid.uuid4().hex[:12]}"
    script = f"import subprocess; subprocess.Popen(['sleep', '300']); print('{marker}')"
    proc = run_group([sys.executable, "-c", script], cwd=REPO, env={**os.environ, "TEST_MARKER": marker}, timeout=60)
    assert proc.returncode == 0 and marker in proc.stdout
    assert leftovers(marker) == []


@pytest.mark.slow
def test_stop_tree_follows_children_that_left_the_session(tmp_path):
    """A descendant in a session of its own (as sshd gives each login) is still stopped with its ancestor."""
    marker = f"setsid-{uuid.uuid4().hex[:12]}"
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, time; subprocess.Popen(['setsid', 'sleep', "
                               "'300']); time.sleep(300)"], env={**os.environ, "TEST_MARKER": marker},
                              start_new_session=True)
    try:
        deadline = time.time() + 30
        while time.time() < deadline and len(leftovers(marker)) < 2:
            time.sleep(0.2)
        assert len(leftovers(marker)) == 2
    finally:
        stop_tree(parent.pid)
        parent.wait()
    assert leftovers(marker) == []
