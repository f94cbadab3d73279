"""Preemption, crashes and numerical guards on real 2-rank CPU runs (issue: reliability).

Faults are injected with TRAINER_FAULTS through the trainer's hooks (tests/workers/faults.py): `kill_at@N`
SIGKILLs rank 1 after step N, `kill_in_save@N` SIGKILLs it while checkpoint N is half written, `nan_loss@N`
poisons step N's loss.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import torch

from conftest import STAGES, TINY
from distributed import REPO, last_wins, launch, launch_command, launch_raw, read_metrics, with_faults
from trainer.train import checkpoint
from trainer.train.guards import StepGuard

pytestmark = pytest.mark.multirank

RUN = TINY + STAGES["z2"] + ["train.max_steps=12", "train.save_every=4", "train.eval_every=0"]


def train_args(out, *extra) -> list[str]:
    args = ["train.py", "--preset", "tiny_cpu"]
    for item in last_wins(RUN + [f"train.output_dir={out}", *extra]):
        args += ["--set", item]
    return args


def fp32_weights(run_dir, step):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    return get_fp32_state_dict_from_zero_checkpoint(str(run_dir / "checkpoints"), tag=f"step_{step:08d}")


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6, msg=key)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "run"
    launch(train_args(out))
    return out


def test_sigkill_between_checkpoints_then_resume_matches_uninterrupted(tmp_path, uninterrupted):
    kill_step = 7  # after the step-4 checkpoint, before step 8's: steps 5-7 are lost and redone
    out = tmp_path / "run"
    code, output = launch_raw(with_faults(train_args(out)), env={"TRAINER_FAULTS": f"kill_at@{kill_step}"})
    assert code != 0, f"kill_at@{kill_step} did not kill the run"
    saved = 8 if kill_step >= 8 else 4
    assert checkpoint.find_resume("auto", out / "checkpoints").name == f"step_{saved:08d}", kill_step
    output = launch(train_args(out, "train.resume=auto"))
    assert f"resume: continuing from {out / 'checkpoints' / f'step_{saved:08d}'}" in output
    resumed = {r["step"]: r["loss"] for r in read_metrics(out)[0]}
    straight = {r["step"]: r["loss"] for r in read_metrics(uninterrupted)[0]}
    for step in range(saved + 1, 13):
        assert resumed[step] == pytest.approx(straight[step], abs=1e-6), (kill_step, step)
    assert_same_weights(fp32_weights(out, 12), fp32_weights(uninterrupted, 12))


def test_kill_during_save_keeps_the_previous_checkpoint_as_latest(tmp_path, uninterrupted):
    out = tmp_path / "run"
    code, _ = launch_raw(with_faults(train_args(out)), env={"TRAINER_FAULTS": "kill_in_save@8"})
    assert code != 0
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000004"
    assert (ckpts / "step_00000008.partial").is_dir() and not (ckpts / "step_00000008").exists()
    assert checkpoint.find_resume("auto", ckpts) == ckpts / "step_00000004"
    output = launch(train_args(out, "train.resume=auto"))
    assert "continuing from" in output and "step_00000004" in output
    assert not (ckpts / "step_00000008.partial").exists()  # the next save cleared the debris
    assert_same_weights(fp32_weights(out, 12), fp32_weights(uninterrupted, 12))


def sigterm_after_step(out, step: int, *extra) -> str:
    """Start a long run in its own process group, SIGTERM the group once `step` is logged; the output."""
    cmd, env = launch_command(train_args(out, "train.max_steps=400", "train.save_every=0", "logging.log_every=1",
                                         *extra))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group, like a Slurm job step
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            rows = read_metrics(out)[0] if (out / "metrics.jsonl").exists() else []
            if rows and rows[-1]["step"] >= step:
                break
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGTERM)  # the scheduler signals every process of the job
        return proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_sigterm_finishes_the_step_saves_and_resumes(tmp_path):
    out = tmp_path / "run"
    output = sigterm_after_step(out, 3)
    assert "SIGTERM received: finishing this step, saving a checkpoint" in output
    latest = (out / "checkpoints" / "latest").read_text().strip()
    stopped = int(latest.split("_")[1])
    assert 3 <= stopped < 400 and f"stopped at step {stopped}" in output
    state = json.loads((out / "checkpoints" / latest / "trainer_state.json").read_text())
    assert state["trainer"]["step"] == stopped
    output = launch(train_args(out, "train.max_steps=400", "train.save_every=0", "train.resume=auto",
                               "train.stop_after=2"))
    assert f"continuing from {out / 'checkpoints' / latest}" in output
    assert [r["step"] for r in read_metrics(out)[0]][-2:] == [stopped + 1, stopped + 2]


def test_sigterm_with_on_signal_exit_stops_without_saving(tmp_path):
    out = tmp_path / "run"
    output = sigterm_after_step(out, 2, "train.on_signal=exit")
    assert "no checkpoint (train.on_signal=exit)" in output
    assert not (out / "checkpoints").exists()


def test_a_nonfinite_step_is_skipped_and_counted(tmp_path, uninterrupted):
    out = tmp_path / "run"
    launch(with_faults(train_args(out, "logging.log_every=1")), env={"TRAINER_FAULTS": "nan_loss@3"})
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {"step": 3, "skipped_step": True, "bad_steps_in_a_row": 1} in rows
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in rows if "loss" in r)
    state = json.loads((out / "checkpoints/step_00000012/trainer_state.json").read_text())
    assert state["trainer"]["bad_steps"] == 1


def test_consecutive_nonfinite_steps_stop_with_the_last_good_state(tmp_path):
    out = tmp_path / "run"
    code, output = launch_raw(with_faults(train_args(out, "train.save_every=2", "train.max_bad_steps=3",
                                                     "train.keep_last=5")),
                              env={"TRAINER_FAULTS": "nan_loss@3,nan_loss@4,nan_loss@5"})
    assert code != 0
    assert "stopping: 3 non-finite steps in a row (train.max_bad_steps)" in output
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000005"
    # steps 3-5 were skipped, so the saved state is the state after step 2
    assert_same_weights(fp32_weights(out, 5), fp32_weights(out, 2))


# --- pure parts --------------------------------------------------------------------------------

def test_spike_detector_reports_a_jump_over_the_moving_average():
    guard = StepGuard(max_bad_steps=3, spike_ratio=3.0, spike_window=20)
    assert all(guard.spike(2.0 + 0.01 * i) is None for i in range(12))
    assert guard.spike(9.0) == pytest.approx(2.055, abs=1e-3)
    assert guard.spike(float("nan")) is None


def make_checkpoint(root, step, complete=True, parent=None):
    path = root / checkpoint.tag_for(step)
    path.mkdir(parents=True)
    (path / checkpoint.STATE_FILE).write_text(json.dumps({"trainer": {"step": step, "parent": parent}, "config": {}}))
    if complete:
        (path / checkpoint.COMPLETE).write_text("x")
    return path


def make_history(root, steps, complete=True):
    parent = None
    for step in steps:
        make_checkpoint(root, step, complete, parent)
        parent = checkpoint.tag_for(step)


def test_retention_keeps_the_newest_and_the_resume_source(tmp_path):
    make_history(tmp_path, (1, 2, 3, 4))
    make_checkpoint(tmp_path, 5, complete=False, parent="step_00000004")  # a crashed save never counts
    removed = checkpoint.prune(tmp_path, keep_last=1, protect=str(tmp_path / "step_00000002"), newest="step_00000004")
    assert sorted(p.name for p in removed) == ["step_00000001", "step_00000003"]
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000002", "step_00000004",
                                                               "step_00000005"]


def test_retention_never_touches_another_history(tmp_path):
    make_history(tmp_path, (4, 8, 12))  # an earlier branch
    make_checkpoint(tmp_path, 5, parent="step_00000004")
    make_checkpoint(tmp_path, 6, parent="step_00000005")
    removed = checkpoint.prune(tmp_path, keep_last=1, newest="step_00000006")
    assert sorted(p.name for p in removed) == ["step_00000004", "step_00000005"]
    assert (tmp_path / "step_00000012").exists() and (tmp_path / "step_00000008").exists()


def test_resume_auto_skips_incomplete_checkpoints(tmp_path):
    make_checkpoint(tmp_path, 4)
    make_checkpoint(tmp_path, 8, complete=False, parent="step_00000004")
    (tmp_path / "latest").write_text("step_00000008")  # a pointer written before a crash
    assert checkpoint.find_resume("auto", tmp_path) == tmp_path / "step_00000004"


def test_resume_auto_takes_a_complete_descendant_of_latest_but_not_another_branch(tmp_path):
    make_history(tmp_path, (4, 8))
    (tmp_path / "latest").write_text("step_00000004")  # crashed between COMPLETE of step 8 and `latest`
    assert checkpoint.find_resume("auto", tmp_path) == tmp_path / "step_00000008"
    make_checkpoint(tmp_path, 12)  # no parent: a fresh start's checkpoint, not step 4's history
    (tmp_path / "latest").write_text("step_00000008")
    assert checkpoint.find_resume("auto", tmp_path) == tmp_path / "step_00000008"


def test_fp16_scale_stuck_at_the_minimum_is_reported_once_with_advice():
    from trainer.train.guards import LossScaleWatch
    watch = LossScaleWatch(min_loss_scale=1, hits_to_report=3)
    assert [watch.advice(s, gpu_has_bf16=True) for s in (1024, 1, 1)] == [None, None, None]
    advice = watch.advice(1, gpu_has_bf16=True)
    assert "min_loss_scale=1 for 3 steps" in advice and "switch to bf16" in advice
    assert watch.advice(1, gpu_has_bf16=True) is None  # reported once per streak
    v100 = LossScaleWatch(min_loss_scale=1, hits_to_report=1)
    assert "raise deepspeed.fp16.min_loss_scale" in v100.advice(1, gpu_has_bf16=False)


def test_an_export_of_empty_zero3_partitions_is_caught(tmp_path):
    from safetensors.torch import save_file
    full = {"embed.weight": torch.ones(8, 4), "head.weight": torch.ones(8, 4)}
    save_file({"embed.weight": torch.ones(8, 4), "head.weight": torch.empty(0)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(RuntimeError, match=r"incomplete: head.weight \(0,\) \(model: \(8, 4\)\)"):
        checkpoint.verify_export(tmp_path, full)
    save_file(full, str(tmp_path / "model.safetensors"))
    checkpoint.verify_export(tmp_path, full)  # a complete export passes


def test_a_parent_in_another_run_directory_is_recorded_by_its_path(tmp_path):
    """Resuming another run's checkpoint must not join this directory's same-named checkpoint's history."""
    ours, theirs = tmp_path / "ours" / "checkpoints", tmp_path / "theirs" / "checkpoints"
    assert checkpoint.parent_name(ours / "step_00000004", ours) == "step_00000004"
    assert checkpoint.parent_name(theirs / "step_00000004", ours) == str(theirs / "step_00000004")
    make_history(ours, (4, 8))
    assert checkpoint.lineage(ours, str(theirs / "step_00000004")) == []  # not step_4 of this directory
