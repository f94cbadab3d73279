"""What a training does before its first step that it does not need (scripts/bench.py --first-step measures the
phases): no `datasets` import when the data is prepared, and py-cpuinfo's subprocess once per process instead of
twice per DeepSpeed op."""
from __future__ import annotations

import pytest
import json
import subprocess
import sys

from distributed import REPO


@pytest.mark.slow
def test_the_modules_a_training_imports_before_its_first_step_leave_datasets_out():
    """`datasets` (with pandas) costs ~0.8 s per rank; a training from prepared shards never calls it."""
    code = ("import json, sys; import trainer.train.run, trainer.data, trainer.data.prepare, trainer.model; "
            "print(json.dumps(sorted(m for m in ('datasets', 'pandas') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == []


def test_the_lazy_module_is_the_real_one_on_first_use(tmp_path):
    from trainer.data import records
    path = tmp_path / "a.jsonl"
    path.write_text('{"text": "one"}\n{"text": "two"}\n')
    loaded = records.load_records(str(path))
    import datasets
    assert isinstance(loaded, datasets.Dataset) and records.datasets.Dataset is datasets.Dataset
    assert [row["text"] for row in loaded] == ["one", "two"]


@pytest.mark.slow
def test_deepspeed_asks_py_cpuinfo_once_per_process_and_gets_the_same_flags(monkeypatch):
    import cpuinfo
    from deepspeed.accelerator import get_accelerator

    from trainer.distributed import cpu_info_once
    calls = []
    real = cpuinfo.get_cpu_info
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: calls.append(1) or real())
    builder = get_accelerator().create_op_builder("FusedAdamBuilder")
    flags = builder.cxx_args()  # what keys an op's build: a different answer would rebuild every op
    asked = len(calls)
    assert asked >= 1  # this DeepSpeed does ask py-cpuinfo (else the test tests nothing)
    cpu_info_once()
    cpu_info_once()  # idempotent: not wrapped twice
    assert [builder.cxx_args() for _ in range(3)] == [flags] * 3
    assert len(calls) == asked + 1
    first = cpuinfo.get_cpu_info()
    first["flags"].clear()  # a caller changing its answer does not change the next caller's
    assert cpuinfo.get_cpu_info()["flags"]


def _threads_in_a_rank(env: dict) -> tuple[int, str]:
    code = ("import os, torch; from trainer.distributed import threads_per_rank; threads_per_rank(); "
            "print(torch.get_num_threads(), os.environ.get('OMP_NUM_THREADS', '-'))")
    clean = {k: v for k, v in __import__("os").environ.items()
             if k not in ("OMP_NUM_THREADS", "LOCAL_SIZE", "LOCAL_WORLD_SIZE")}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**clean, **env}, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    threads, omp = out.stdout.split()
    return int(threads), omp


@pytest.mark.slow
def test_ranks_on_one_node_share_its_cores_instead_of_each_taking_all_of_them():
    """DeepSpeed's launcher sets OMP_NUM_THREADS only with --bind_cores_to_rank: without this, 2 CPU ranks ran 2 x
    cores threads and a TP=2 generate was 3-10x slower. A user's OMP_NUM_THREADS is kept."""
    import os
    cores = len(os.sched_getaffinity(0))
    alone, _ = _threads_in_a_rank({})
    assert alone == min(cores, alone) and alone >= 1  # one rank keeps torch's own count (one per core)
    assert _threads_in_a_rank({"LOCAL_SIZE": "2"}) == (max(1, cores // 2), str(max(1, cores // 2)))
    assert _threads_in_a_rank({"LOCAL_WORLD_SIZE": str(2 * cores)}) == (1, "1")  # torchrun's name; never 0
    assert _threads_in_a_rank({"LOCAL_SIZE": "1", "OMP_NUM_THREADS": "1"}) == (1, "1")  # not cores // 1
    assert _threads_in_a_rank({"LOCAL_SIZE": "two"}) == (alone, "-")  # not a count: torch's own choice, no crash
