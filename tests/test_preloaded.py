"""The preloaded interpreter's rule (tests/preloaded.py): a command is forked only when the fork cannot differ from
a fresh process - its environment equal to the server's but for variables read after the fork - and only in the
command-line shapes it knows; everything else runs as a real process."""
from __future__ import annotations

import os
import sys

import pytest

import preloaded
from distributed import new_port

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


@pytest.mark.slow
def test_a_job_in_another_environment_is_forked_from_a_server_that_imported_under_it(tmp_path, monkeypatch):
    """A test's HF_HOME is read by huggingface_hub at import: the fork must come from a server started under it.
    A 2-rank launch gets that server at once; a single command the second time its environment comes."""
    monkeypatch.delenv("TRAINER_TEST_PRELOAD", raising=False)
    script = tmp_path / "where.py"
    script.write_text("import os, huggingface_hub.constants as c\n"
                      "print(os.environ.get('RANK'), c.HF_HOME, os.environ['HF_HOME'], flush=True)\n")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hub")}
    ranks = preloaded.start([preloaded.DEEPSPEED, "--num_gpus", "2", "--master_port", str(new_port()), str(script)],
                            tmp_path, env)
    assert isinstance(ranks, preloaded.Forked)
    assert ranks.wait(timeout=120) == 0
    lines = sorted(ranks.stdout.read().split("\n"))[-2:]
    assert lines == [f"0 {tmp_path / 'hub'} {tmp_path / 'hub'}", f"1 {tmp_path / 'hub'} {tmp_path / 'hub'}"], lines
    other = {**os.environ, "HF_HOME": str(tmp_path / "other")}
    command = [sys.executable, str(script)]
    assert preloaded.start(command, tmp_path, other) is None  # the first time: a server would cost what it saves
    second = preloaded.start(command, tmp_path, other)
    assert isinstance(second, preloaded.Forked) and second.wait(timeout=120) == 0
    assert second.stdout.read().split() == ["None", str(tmp_path / "other"), str(tmp_path / "other")]
