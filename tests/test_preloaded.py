"""The preloaded interpreter's rule (tests/preloaded.py): a command is forked only when the fork cannot differ from
a fresh process - its environment equal to the server's but for variables read after the fork - and only in the
command-line shapes it knows; everything else runs as a real process."""
from __future__ import annotations

import os
import sys

import preloaded

SERVER = {"PATH": "/usr/bin", "HOME": "/root", "PYTEST_CURRENT_TEST": "tests/a.py::one (call)"}


def test_what_changes_between_tests_or_is_read_after_the_fork_does_not_stop_a_fork(monkeypatch):
    monkeypatch.delenv("TRAINER_TEST_PRELOAD", raising=False)
    env = {**SERVER, "PYTEST_CURRENT_TEST": "tests/b.py::two (call)", "TRAINER_FAULTS": "kill_at@3",
           "PYTHONPATH": "/repo", "WANDB_MODE": "offline"}
    job = preloaded.job_for([preloaded.DEEPSPEED, "--num_gpus", "2", "--master_port", "29999", "train.py", "--x"],
                            "/tmp", env, SERVER)
    assert job["kind"] == "ranks" and job["ranks"] == 2 and job["target"] == {"kind": "script", "path": "train.py"}
    assert preloaded.job_for([sys.executable, "-m", "trainer", "generate", "--model", "m"], "/tmp", env,
                             SERVER)["kind"] == "module"


def test_what_a_preloaded_package_reads_or_an_unknown_shape_runs_as_a_real_process(monkeypatch):
    monkeypatch.delenv("TRAINER_TEST_PRELOAD", raising=False)
    cmd = [sys.executable, "-m", "trainer", "evaluate", "--model", "m"]
    assert preloaded.job_for(cmd, "/tmp", {**SERVER, "TORCH_EXTENSIONS_DIR": "/x"}, SERVER) is None
    assert preloaded.job_for(cmd, "/tmp", {**SERVER, "TRAINER_TEST_PRELOAD": "0"}, SERVER) is None
    assert preloaded.job_for([sys.executable, "-m", "trainer", "show", "tiny_cpu"], "/tmp", SERVER, SERVER) is None
    assert preloaded.job_for([sys.executable, "-c", "print(1)"], "/tmp", SERVER, SERVER) is None
    assert preloaded.job_for([sys.executable, "-m", "trainer", "generate", "--help"], "/tmp", SERVER, SERVER) is None
    assert os.environ.get("TRAINER_TEST_PRELOAD") is None
