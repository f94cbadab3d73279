"""Stale JIT-build locks (issue 24): a `lock` file that a killed op build left in the torch extensions directory
makes every later run wait for ever in silence. The trainer and preflight name such a file before DeepSpeed
loads its ops and, while a rank waits on it, print the file, its age and the removal command. Tested by planting
a lock in a private TORCH_EXTENSIONS_DIR for the op DeepSpeed builds first on CPU ranks (deepspeed_shm_comm).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from distributed import DEEPSPEED, REPO, new_port, remove_shm_buffers
from processes import stop_tree
from trainer import jit_locks
from trainer.diagnose.recognise import diagnose
from trainer.presets import load_preset
from trainer.resolve import resolve

OP = "deepspeed_shm_comm"  # DeepSpeed's CPU all-reduce op, built inside deepspeed.init_distributed on CPU ranks


def plant(root: Path, minutes_old: float, op: str = OP) -> Path:
    lock = root / op / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    then = time.time() - minutes_old * 60
    os.utime(lock, (then, then))
    return lock


def test_the_extensions_root_is_torchs(tmp_path, monkeypatch):
    """The same directory torch's cpp_extension builds in: TORCH_EXTENSIONS_DIR, else its default with the
    python/accelerator tag."""
    from torch.utils.cpp_extension import _get_build_directory
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert Path(_get_build_directory("probe", False)).parent == jit_locks.extensions_root()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    assert jit_locks.extensions_root() == tmp_path / "mine"


def test_a_lock_no_build_owns_is_stale_and_says_how_to_remove_it(tmp_path):
    lock = plant(tmp_path, minutes_old=22)
    (found,) = jit_locks.locks(tmp_path)
    assert found.stale and found.path == lock
    text = found.describe()
    assert str(lock) in text and "22 min old" in text and f"rm -f '{lock}'" in text
    young = plant(tmp_path, minutes_old=0.1, op="cpu_adam")  # a build that is only starting
    assert not jit_locks.Lock.at(young).stale


def test_a_lock_a_running_build_owns_is_not_stale(tmp_path):
    lock = plant(tmp_path, minutes_old=5)
    builder = subprocess.Popen(["sleep", "60"], cwd=lock.parent)  # ninja and the compilers work in the op's dir
    try:
        found = jit_locks.Lock.at(lock)
        assert found.builder == f"pid {builder.pid} (sleep)" and not found.stale
        assert "is being built by" in found.describe() and "rm -f" not in found.describe()
    finally:
        builder.kill()
        builder.wait()


# The first op each run loads: one training rank has no peer, so no comm op (trainer/distributed.py), and goes
# straight to its optimizer's; two preflight ranks load the comm op.
RUNS = {"train": ([sys.executable, "train.py", "--preset", "tiny_cpu", "--world-size", "1"], "fused_adam"),
        "preflight": ([str(DEEPSPEED), "--num_gpus", "2", "--master_port", "{port}", "--module", "trainer",
                       "preflight", "--preset", "tiny_cpu"], OP)}


@pytest.mark.slow
@pytest.mark.parametrize("run_name", sorted(RUNS))
def test_a_planted_lock_is_named_before_the_ops_load_and_while_the_rank_waits(run_name, tmp_path):
    command, op = RUNS[run_name]
    port = new_port()
    lock = plant(tmp_path / "ext", minutes_old=22, op=op)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "TRAINER_JIT_LOCK_REPORT_S": "1",
           "PYTHONPATH": str(REPO)}
    env.pop("RANK", None)
    run = subprocess.Popen([word.format(port=port) for word in command], cwd=REPO, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[str] = []
    try:
        deadline = time.time() + 180
        while time.time() < deadline and sum(line.startswith("[rank 0] waiting") for line in lines) < 2:
            line = run.stderr.readline()
            if not line:
                break
            lines.append(line)
    finally:
        stop_tree(run.pid)  # it waits on the planted lock: nothing is building, nothing half-written
        run.wait()
        remove_shm_buffers(port)
    named = [line for line in lines if str(lock) in line]
    assert named and "stale JIT lock" in named[0] and "22 min old" in named[0], lines[-5:]
    waits = [line for line in named if line.startswith("[rank 0] waiting")]
    assert len(waits) >= 2 and all(f"rm -f '{lock}'" in line for line in waits)
    # ... and the doctor reads that log
    d = diagnose(resolve(load_preset("tiny_cpu")), "".join(lines))
    assert d.failure == "jit_lock" and d.proposal.step == f"remove the stale lock: rm -f {lock}"


def test_the_doctor_reads_a_log_that_stops_while_loading_an_op():
    # the end of the log of deepspeedai/DeepSpeedExamples#842 ("Step3 hanging for a long time")
    text = ("[2024-01-02 07:30:41,488] [INFO] [partition_parameters.py:348:__exit__] finished initializing model - "
            "num_params = 517, num_elems = 2.78B\n"
            + "Using /root/.cache/torch_extensions/py39_cu117 as PyTorch extensions root...\n" * 4)
    d = diagnose(resolve(load_preset("7b_8xa100")), text)
    assert d.failure == "jit_lock" and "stopped while loading" in d.title
    assert d.proposal.step == "remove the stale lock: rm -f /root/.cache/torch_extensions/py39_cu117/*/lock"
    assert diagnose(resolve(load_preset("7b_8xa100")), text + "step=1, loss=2.3\n").failure != "jit_lock"
