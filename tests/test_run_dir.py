"""Issue 37 item 1: nothing a user already has is overwritten. A fresh start in a run directory that holds a previous
run moves that whole run to previous/<time>/ (the training and a fresh `launch` alike: trainer/run_dir.py); a
directory holding files but no run is refused with the flag to give; a resume touches nothing."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from distributed import run_cli
from trainer.errors import UserError
from trainer.run_dir import PREVIOUS, set_aside_previous_run

REPO = Path(__file__).resolve().parent.parent


def previous_run(run: Path, weights: bytes = b"first run's weights") -> None:
    """What a finished run leaves (the names the trainer writes) plus its launch's record and a file of the user's."""
    for name, text in (("config.resolved.yaml", "train: {lr: 0.001}\n"), ("configs/0001.yaml", "# invocation 1\n"),
                       ("metrics.jsonl", '{"step": 1}\n'), ("checkpoints/step_00000002/COMPLETE", "{}"),
                       ("launch.json", '{"launcher": "deepspeed"}\n'), ("notes.txt", "mine\n")):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text(text)
    (run / "hf").mkdir()
    (run / "hf" / "model.safetensors").write_bytes(weights)


def test_a_fresh_start_moves_the_whole_previous_run_aside(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    previous_run(run)
    moved = set_aside_previous_run(run)  # the training's call: this start's launch record stays
    assert moved.destination.parent == run / PREVIOUS
    assert (moved.destination / "hf" / "model.safetensors").read_bytes() == b"first run's weights"
    assert (moved.destination / "notes.txt").read_text() == "mine\n"
    assert sorted(p.name for p in run.iterdir()) == ["launch.json", PREVIOUS]
    assert "moved whole to" in moved.message("train") and "--resume auto would have continued it" in \
        moved.message("train")
    previous_run(run, b"second")  # a second fresh start in the same second: its own folder, the first kept
    (run / "launch.json").unlink()
    again = set_aside_previous_run(run, keep_startup_files=False)
    assert again.destination != moved.destination and again.destination.name.startswith(moved.destination.name)
    assert (moved.destination / "hf" / "model.safetensors").read_bytes() == b"first run's weights"
    assert (again.destination / "hf" / "model.safetensors").read_bytes() == b"second"
    assert set_aside_previous_run(run) is None and set_aside_previous_run(tmp_path / "new") is None


def test_a_directory_that_holds_no_run_is_refused_and_left_alone(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("x")
    (home / "model.safetensors").write_bytes(b"someone's")
    with pytest.raises(UserError, match=r"holds files that no run of this trainer wrote \(\.bashrc, model\.safet"):
        set_aside_previous_run(home)
    assert sorted(p.name for p in home.iterdir()) == [".bashrc", "model.safetensors"]
    proc = run_cli("launch", "tiny_cpu", "--dry-run", "--set", f"train.output_dir={home}")
    assert proc.returncode == 2 and "--set train.output_dir=runs/NAME, new or empty" in proc.stderr


@pytest.mark.slow  # 3-9 s in the quick tier's list of tests slower than 2 s (issue 36's 120 s budget)
def test_a_launch_that_failed_before_training_left_a_run_directory_and_node_1_leaves_node_0s_alone(tmp_path):
    """A launch whose ranks died before training wrote anything left only its launch.json: launching again sets it
    aside, it is not refused as somebody else's. Under torchrun every node is launched into the one shared directory:
    node 1 finds node 0's fresh launch.json there and neither refuses it nor moves it (CI saw node 1 refuse it)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "launch.json").write_text('{"launcher": "torchrun"}\n')
    torchrun = ["--launcher", "torchrun", "--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                "--resume", "off", "--set", f"train.output_dir={run}"]
    node1 = run_cli("launch", "tiny_cpu", *torchrun, "--node-rank", "1", "--dry-run")
    assert node1.returncode == 0, node1.stderr
    node0 = run_cli("launch", "tiny_cpu", *torchrun, "--node-rank", "0", "--dry-run")
    assert node0.returncode == 0, node0.stderr
    assert set_aside_previous_run(run, keep_startup_files=False).names == ("launch.json",)
    (run / "notes.txt").write_text("mine\n")  # with no launch record left, the same directory is the user's
    assert run_cli("launch", "tiny_cpu", *torchrun, "--node-rank", "0", "--dry-run").returncode == 2
    assert run_cli("launch", "tiny_cpu", *torchrun, "--node-rank", "1", "--dry-run").returncode == 0


SBATCH = "#!/bin/sh\necho \"Submitted batch job 7\"\n"


@pytest.mark.slow
def test_a_fresh_launch_sets_the_previous_run_aside_and_a_resuming_one_does_not(tmp_path):
    """`launch --launcher slurm` writes job.sbatch and launch.json into the run directory (sbatch is a stand-in):
    with --resume off the previous run, its old launch record too, is set aside first; by default (resume) it is
    not touched."""
    tools = tmp_path / "bin"
    tools.mkdir()
    (tools / "sbatch").write_text(SBATCH)
    (tools / "sbatch").chmod(0o755)
    env = {**os.environ, "PATH": f"{tools}:{os.environ['PATH']}", "PYTHONPATH": str(REPO)}
    run = tmp_path / "run"
    run.mkdir()
    previous_run(run)

    def launch(*words: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "trainer", "launch", "tiny_cpu", "--launcher", "slurm",
                               "--set", f"train.output_dir={run}", *words], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=300)

    resumed = launch()
    assert resumed.returncode == 0, resumed.stderr
    assert not (run / PREVIOUS).exists() and (run / "hf" / "model.safetensors").read_bytes() == b"first run's weights"
    # Both launches may start within one second, so their records can be equal byte for byte: tell the first apart
    first_record = json.loads((run / "launch.json").read_text())
    (run / "launch.json").write_text(json.dumps({**first_record, "test": "the first launch's record"}))
    fresh = launch("--resume", "off")
    assert fresh.returncode == 0, fresh.stderr
    [shelf] = (run / PREVIOUS).iterdir()
    assert (shelf / "hf" / "model.safetensors").read_bytes() == b"first run's weights"
    assert json.loads((shelf / "launch.json").read_text())["test"] == "the first launch's record"  # it went along
    assert "test" not in json.loads((run / "launch.json").read_text())  # and this launch wrote its own
    assert sorted(p.name for p in run.iterdir()) == ["job.sbatch", "launch.json", PREVIOUS]
    assert f"launch: starting fresh in {run}, which held a previous run" in fresh.stderr


@pytest.mark.slow
def test_training_twice_into_one_directory_keeps_the_first_export(tmp_path):
    """The issue's journey: a second example with other settings and no train.output_dir of its own trains into the
    first run's directory; the first run's export stays, byte for byte, under previous/."""
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)  # a plain single-rank run

    def train(*overrides: str) -> subprocess.CompletedProcess:
        words = [w for item in ("model.num_layers=1", "model.hidden_size=64", "model.intermediate_size=176",
                                "data.seq_len=64", "train.warmup_steps=1", "train.eval_every=0", "train.save_every=0",
                                "logging.progress_bar=false", f"train.output_dir={run}", *overrides)
                 for w in ("--set", item)]
        proc = subprocess.run([sys.executable, "train.py", "--preset", "tiny_cpu", "--world-size", "1", *words],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
        return proc

    train("train.max_steps=2")
    first = (run / "hf" / "model.safetensors").read_bytes()
    # the second example: other data, lr and length (train.epochs, item 6: resolved from the data to max_steps)
    lines = (REPO / "data" / "tiny" / "pretrain.jsonl").read_text().splitlines()[:40]
    (tmp_path / "mine.jsonl").write_text("\n".join(lines) + "\n")
    mine = [f"data.source={tmp_path / 'mine.jsonl'}", f"data.cache_dir={tmp_path / 'cache'}", "train.lr=1e-2"]
    second = train(*mine, "train.epochs=1")
    [shelf] = (run / PREVIOUS).iterdir()
    assert (shelf / "hf" / "model.safetensors").read_bytes() == first
    assert (shelf / "checkpoints" / "step_00000002").is_dir() and (shelf / "config.resolved.yaml").is_file()
    assert (run / "hf" / "model.safetensors").read_bytes() != first
    assert "lr: 0.01" in (run / "config.resolved.yaml").read_text() and len(list((run / "configs").iterdir())) == 1
    assert f"train: starting fresh in {run}, which held a previous run" in second.stdout + second.stderr
    # one epoch: every train sequence once, in ceil(sequences / global batch) steps
    from trainer.options import resolve_run
    from trainer.presets import load_preset
    expected = resolve_run(load_preset("tiny_cpu", [f"train.output_dir={run}", "data.seq_len=64", *mine,
                                                    "train.epochs=1", "train.warmup_steps=1"]), 1)
    steps = expected.config.train.max_steps
    assert f"-> train.max_steps={steps}" in second.stdout + second.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.startswith("step_")) == \
        [f"step_{steps:08d}"]
