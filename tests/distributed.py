"""Run the project from tests: `python -m trainer ...` in a subprocess (`run_cli`), and real DeepSpeed jobs
on 2 CPU ranks, each on its own --master_port.

Every process a test starts runs in its own session and is stopped with everything below it when the test
times out or fails (`run_group`, `stop_tree`; tests/processes.py). While a launch runs, what it is waiting for
(op builds, lock waits, a fixture's runs) and a line a minute reach the terminal (`progress`, set by conftest).
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

from ports import take_port, taken
from processes import run_group, say
from trainer import shm_buffers

REPO = Path(__file__).resolve().parent.parent
DEEPSPEED = Path(sys.executable).parent / "deepspeed"
def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m trainer <args>` from the repository root, as a user types it."""
    return run_group([sys.executable, "-m", "trainer", *args], cwd=REPO, timeout=120, merge=False)


def new_port() -> int:
    """A --master_port for one job, held for the session (tests/ports.py): never another job's, never reused."""
    return take_port()


# Every op the suite's launches load (tiny_cpu: the CPU all-reduce and fused_adam; CPU offload: cpu_adam; NVMe:
# async_io), built before the first launch: on a fresh machine that takes ~10 min, which inside a launch would
# count against its timeout (and a build stopped by a timeout would start over in the next launch).
# On a CUDA machine the launches are the GPU tests' (one rank, fused Adam on the GPU): the CPU ops would be built
# for the wrong accelerator (deepspeed_shm_comm has no CUDA builder). TRAINER_TEST_OPS=op,... names them instead
# (scripts/gpu_check.py passes the ops its preflight built).
CPU_SUITE_OPS = ("deepspeed_shm_comm", "fused_adam", "cpu_adam", "async_io")
GPU_SUITE_OPS = ("fused_adam",)
_ops_ready = False


def suite_ops() -> tuple[str, ...]:
    named = os.environ.get("TRAINER_TEST_OPS")
    if named is not None:
        return tuple(op for op in named.split(",") if op)
    import torch
    on_gpu = torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") == "cuda"
    return GPU_SUITE_OPS if on_gpu else CPU_SUITE_OPS


@contextlib.contextmanager
def one_rank_process_group():
    """A one-rank gloo process group in this process, as DeepSpeed's in-process users (its config parser, a one-rank
    engine) need; one that another test left up is used as it is."""
    import deepspeed.comm as ds_comm
    import torch.distributed as td
    if td.is_initialized():
        yield
        return
    port = take_port()
    td.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    ds_comm.init_distributed(dist_backend="gloo", dist_init_required=False, verbose=False)
    assert ds_comm.is_initialized()
    try:
        yield
    finally:
        ds_comm.destroy_process_group()


def ensure_ops_built() -> None:
    global _ops_ready
    if _ops_ready:
        return
    ops = suite_ops()
    if not ops:
        _ops_ready = True
        return
    say(f"building or loading DeepSpeed's ops for the suite's launches ({', '.join(ops)}); "
        f"a fresh environment builds them once, ~10 min on 2 cores")
    proc = run_group([sys.executable, "scripts/build_ops.py", "--ops", ",".join(ops)], cwd=REPO,
                     env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"scripts/build_ops.py failed (exit {proc.returncode}):\n{proc.stdout[-4000:]}")
    _ops_ready = True


def launch_command(script_args: list[str], ranks: int = 2, env: dict | None = None) -> tuple[list[str], dict]:
    if "TORCH_EXTENSIONS_DIR" not in (env or {}):  # a test with its own extensions directory builds there itself
        ensure_ops_built()
    if "--set" in script_args and "--" not in script_args:
        script_args = argv_last_wins(script_args)  # a test's base config plus its changes: each key set once
    cmd = [str(DEEPSPEED), "--num_gpus", str(ranks), "--master_port", str(new_port()), *script_args]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true",
                **(env or {})}
    return cmd, full_env


def launch_raw(script_args: list[str], timeout: int = 1500, ranks: int = 2, env: dict | None = None,
               stop_on=None):
    """(returncode, output) of `deepspeed --num_gpus N --master_port P <script_args>`; a timeout (or a line
    matching `stop_on`) stops the whole job and raises subprocess.TimeoutExpired."""
    cmd, full_env = launch_command(script_args, ranks, env)
    try:
        proc = run_group(cmd, cwd=REPO, env=full_env, timeout=timeout, stop_on=stop_on)
    finally:
        remove_shm_buffers(cmd[cmd.index("--master_port") + 1])
    return proc.returncode, proc.stdout


def with_faults(script_args: list[str]) -> list[str]:
    """The same training launch with TRAINER_FAULTS injected through the trainer's hooks (tests/workers/faults.py)."""
    return ["tests/workers/train_with_faults.py" if arg == "train.py" else arg for arg in script_args]


def remove_shm_buffers(port) -> None:
    """DeepSpeed's CPU all-reduce buffers (69 MB each in /dev/shm) that a killed job on `port` leaves behind; a
    finished run removes its own (trainer.distributed.end_distributed)."""
    shm_buffers.remove(shm_buffers.job_buffers(port))


def remove_every_jobs_buffers() -> None:
    """What every job of this session left in /dev/shm (conftest runs it when the session ends)."""
    for port in taken():
        remove_shm_buffers(port)


def launch(script_args: list[str], timeout: int = 1500, ranks: int = 2, env: dict | None = None) -> str:
    """Run `deepspeed --num_gpus N --master_port P <script_args>`; returns the output, fails with its tail."""
    code, output = launch_raw(script_args, timeout, ranks, env)
    assert code == 0, f"{' '.join(script_args)} failed ({code}):\n{output[-6000:]}"
    return output


def last_wins(items: list[str]) -> list[str]:
    """Test configs are a base plus changes (TINY + a stage + this test's keys): each later item replaces an earlier
    one of the same key, as the trainer's own changes do (`with_overrides`), so the command line sets each key once
    (the trainer refuses a key given twice)."""
    from trainer.presets import with_overrides
    folded: list[str] = []
    for item in items:
        folded = with_overrides(folded, [item])
    return folded


def argv_last_wins(argv: list[str]) -> list[str]:
    """A command line whose `--set` items are folded by `last_wins` (the other words kept in place)."""
    items = [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == "--set"]
    rest, skip = [], False
    for i, word in enumerate(argv):
        if skip:
            skip = False
        elif word == "--set" and i + 1 < len(argv):
            skip = True
        else:
            rest.append(word)
    return rest + [word for item in last_wins(items) for word in ("--set", item)]


def run_many(runs: list[dict], workdir: Path, timeout: int = 1500, ranks: int = 2,
             env: dict | None = None) -> tuple[str, list]:
    """Run several trainings in one launch of `ranks` ranks (tests/workers/run_many.py); returns (output, report).
    `env`: variables the launch adds (a local hub cache, say)."""
    runs = [{**run, "overrides": last_wins(run["overrides"])} if "overrides" in run else run for run in runs]
    spec = workdir / "spec.json"
    report = workdir / "report.json"
    spec.write_text(json.dumps({"runs": runs, "report": str(report)}))
    output = launch(["tests/workers/run_many.py", str(spec)], timeout=timeout, ranks=ranks, env=env)
    return output, json.loads(report.read_text())


def read_metrics(run_dir: Path) -> tuple[list[dict], list[dict]]:
    """(train rows, eval rows) of a run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], [r for r in rows if "eval_loss" in r]


def losses(run_dir) -> list[float]:
    return [row["loss"] for row in read_metrics(run_dir)[0]]


def eval_losses(run_dir) -> list[float]:
    return [row["eval_loss"] for row in read_metrics(run_dir)[1]]
