"""What a resume does with damaged, branched, finished or half-committed checkpoints, on real 2-rank runs
(issue: reliability round 2). One base run (steps 4, 8, 12) is copied for each case."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time

import pytest
import torch
import yaml

from conftest import STAGES, TINY
from distributed import REPO, last_wins, launch, launch_command, launch_raw, read_metrics, run_many, with_faults
from trainer.train import checkpoint, integrity

pytestmark = pytest.mark.multirank

BASE = TINY + STAGES["z2"] + ["train.max_steps=12", "train.save_every=4", "train.keep_last=5", "train.eval_every=0",
                               "logging.progress_bar=false"]


# Bitwise comparisons use torch's Adam: DeepSpeed's compiled CPU Adam keeps beta^t as a running product in a
# straight run but recomputes it with pow() after a resume (csrc/includes/cpu_adam.h), so a resumed run agrees
# with a straight one only to float32 rounding (~1e-7), data-dependently.
LOG_EVERY_5 = ["logging.log_every=5", "train.eval_every=3", "deepspeed.optimizer.params.torch_adam=true"]


def tag(step: int) -> str:
    return checkpoint.tag_for(step)


def train_args(out, *extra) -> list[str]:
    args = ["train.py", "--preset", "tiny_cpu"]
    for item in last_wins(BASE + [f"train.output_dir={out}", *extra]):
        args += ["--set", item]
    return args


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("base")
    run_many([{"name": "base", "preset": "tiny_cpu", "overrides": BASE + [f"train.output_dir={root / 'run'}"]}], root)
    return root / "run"


def damage(path, how: str) -> None:
    if how == "delete":
        path.unlink()
    elif how == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif how == "flip":  # one byte inside tensor data: the file still loads, with other weights
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))


CASES = {  # name: (file in step_12, damage, overrides)
    "optimizer_missing": ("zero_pp_rank_1_mp_rank_00_optim_states.pt", "delete", []),
    "optimizer_truncated": ("zero_pp_rank_0_mp_rank_00_optim_states.pt", "truncate", []),
    "weights_bit_flip": ("mp_rank_00_model_states.pt", "flip", []),
    "rng_missing": ("rng_rank1.json", "delete", []),
    "past_max_steps": (None, None, ["train.max_steps=8"]),
    "already_finished": (None, None, []),
}


@pytest.fixture(scope="module")
def cases(base, tmp_path_factory):
    """Every damaged copy resumed with --resume auto, plus the branch case, in one launch."""
    root = tmp_path_factory.mktemp("cases")
    runs, dirs = [], {}
    for name, (file, how, extra) in CASES.items():
        dirs[name] = root / name
        shutil.copytree(base, dirs[name])
        if file:
            damage(dirs[name] / "checkpoints" / tag(12) / file, how)
        runs.append({"name": name, "preset": "tiny_cpu", "expect_error": name not in ("rng_missing", "already_finished"),
                     "overrides": BASE + extra + [f"train.output_dir={dirs[name]}", "train.resume=auto",
                                                  "train.max_steps=" + ("8" if extra else "13")
                                                  if name != "already_finished" else "train.max_steps=12"]})
    # resume step 4 of a run that reached 12, saving every step with keep_last 1; then --resume auto
    dirs["branch"] = root / "branch"
    shutil.copytree(base, dirs["branch"])
    branch = BASE + [f"train.output_dir={dirs['branch']}", "train.save_every=1", "train.keep_last=1"]
    runs.append({"name": "branch", "preset": "tiny_cpu",
                 "overrides": branch + [f"train.resume={dirs['branch'] / 'checkpoints' / tag(4)}", "train.stop_after=2"]})
    runs.append({"name": "branch_auto", "preset": "tiny_cpu", "overrides": branch + ["train.resume=auto",
                                                                                     "train.stop_after=1"]})
    # the same 12 steps straight, and stopped at step 6 (neither a save nor a log boundary) then resumed
    for name, extra in (("log_straight", []), ("log_halves", ["train.stop_after=6"]), ("log_halves", ["train.resume=auto"])):
        dirs[name] = root / name
        runs.append({"name": name, "preset": "tiny_cpu",
                     "overrides": BASE + LOG_EVERY_5 + extra + [f"train.output_dir={dirs[name]}"]})
    output, report = run_many(runs, root)
    return dirs, {row["name"]: row["error"] for row in report}, output


def test_retention_follows_the_resumed_branch_and_sets_the_old_one_aside(cases):
    dirs, errors, output = cases
    # train.stop_after says what it did and how to go on (issue 37)
    assert (f"stopped at step 6 of 12 (train.stop_after=6 steps this invocation); checkpoint saved: "
            f"{dirs['log_halves'] / 'checkpoints' / tag(6)}; continue with the same command and --resume auto") in output
    ckpts = dirs["branch"] / "checkpoints"
    assert errors["branch"] is None and errors["branch_auto"] is None
    # the new branch's newest checkpoint is kept, pointed at, and continued by --resume auto
    # keep_last 1, plus step 6: the checkpoint this invocation resumed from is kept until its next save
    assert sorted(p.name for p in checkpoint.complete_checkpoints(ckpts)) == [tag(6), tag(7)]
    assert (ckpts / "latest").read_text().strip() == tag(7)
    assert f"resume: continuing from {ckpts / tag(6)} (step 6)" in output
    # the abandoned branch (steps 8, 12) is kept aside, whole, not deleted
    shelved = sorted(p.name for p in (ckpts / "abandoned").glob("*/step_*"))
    assert shelved == [tag(8), tag(12)], shelved
    assert all((p / checkpoint.COMPLETE).exists() for p in (ckpts / "abandoned").glob("*/step_*"))
    assert "set aside in" in output and "nothing was deleted" in output
    steps = [r["step"] for r in read_metrics(dirs["branch"])[0]]
    assert steps[-3:] == [5, 6, 7]


def test_each_checkpoint_records_its_parent(cases):
    dirs, _, _ = cases
    state = json.loads((dirs["branch"] / "checkpoints" / tag(7) / checkpoint.STATE_FILE).read_text())
    assert state["trainer"]["parent"] == tag(6)


@pytest.mark.parametrize("name, expected", [
    ("optimizer_missing", "zero_pp_rank_1_mp_rank_00_optim_states.pt is missing"),
    ("optimizer_truncated", "zero_pp_rank_0_mp_rank_00_optim_states.pt is truncated ({half:,} of {full:,} bytes)"),
    ("weights_bit_flip", "mp_rank_00_model_states.pt is corrupt or was changed after it was saved"),
])
def test_a_damaged_checkpoint_is_a_named_error_with_the_one_to_resume(cases, base, name, expected):
    dirs, errors, _ = cases
    error = errors[name]
    full = (base / "checkpoints" / tag(12) / CASES[name][0]).stat().st_size  # the intact file's size
    expected = expected.format(half=full // 2, full=full)
    assert error and f"checkpoint {dirs[name] / 'checkpoints' / tag(12)} must not be resumed" in error, error
    assert expected in error, error
    previous = dirs[name] / "checkpoints" / tag(8)
    assert f"the previous complete checkpoint is {previous}: resume it with --resume {previous}" in error, error
    assert not (dirs[name] / "configs" / "0002.yaml").exists()  # refused before the run directory was touched


def test_a_missing_rng_file_resumes_with_a_warning(cases):
    dirs, errors, output = cases
    assert errors["rng_missing"] is None
    assert f"warning: {dirs['rng_missing'] / 'checkpoints' / tag(12)}: rng_rank1.json is missing" in output
    assert [r["step"] for r in read_metrics(dirs["rng_missing"])[0]][-1] == 13


def test_resuming_past_max_steps_is_refused_and_writes_nothing(cases, base):
    dirs, errors, _ = cases
    assert "is at step 12, past train.max_steps=8" in errors["past_max_steps"]
    assert "--set train.max_steps=24" in errors["past_max_steps"]
    resolved = yaml.safe_load((dirs["past_max_steps"] / "config.resolved.yaml").read_text())
    assert resolved["train"]["max_steps"] == 12
    assert sorted(p.name for p in (dirs["past_max_steps"] / "configs").iterdir()) == ["0001.yaml"]


def test_an_already_finished_run_says_so_and_does_nothing(cases):
    dirs, errors, output = cases
    assert errors["already_finished"] is None
    assert "is at step 12 = train.max_steps: this run is already finished; nothing was done" in output
    assert sorted(p.name for p in (dirs["already_finished"] / "configs").iterdir()) == ["0001.yaml"]


def test_every_invocation_keeps_its_resolved_config(cases):
    dirs, _, _ = cases
    history = sorted(p.name for p in (dirs["rng_missing"] / "configs").iterdir())
    assert history == ["0001.yaml", "0002.yaml"]
    second = yaml.safe_load((dirs["rng_missing"] / "configs" / "0002.yaml").read_text())
    assert second["train"]["max_steps"] == 13 and second["train"]["resume"] == "auto"
    assert yaml.safe_load((dirs["rng_missing"] / "config.resolved.yaml").read_text()) == second


def test_a_crash_between_complete_and_latest_resumes_the_newer_checkpoint(tmp_path):
    """Rank 0 dies after writing COMPLETE of step 8 and before replacing `latest` (still step 4): the step-8
    checkpoint is complete and continues step 4's history, so --resume auto takes it."""
    out = tmp_path / "run"
    code, _ = launch_raw(with_faults(train_args(out)), env={"TRAINER_FAULTS": "kill_before_latest@8"})
    assert code != 0
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == tag(4)
    assert (ckpts / tag(8) / checkpoint.COMPLETE).exists()
    assert checkpoint.find_resume("auto", ckpts) == ckpts / tag(8)


def test_nonfinite_weights_are_never_marked_complete(tmp_path):
    out = tmp_path / "run"
    code, output = launch_raw(with_faults(train_args(out, "train.save_every=3")),
                              env={"TRAINER_FAULTS": "nan_weights@6"})
    assert code != 0
    assert "not saving step 6: the weights hold inf/NaN values (model.embed_tokens.weight (1,024)" in output
    assert f"resume the last complete checkpoint with --resume {out / 'checkpoints' / tag(3)}" in output
    assert [p.name for p in checkpoint.complete_checkpoints(out / "checkpoints")] == [tag(3)]
    assert (out / "checkpoints" / "latest").read_text().strip() == tag(3)


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=5m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_is_named_and_the_previous_checkpoint_survives(small_disk):
    out = small_disk / "run"
    code, output = launch_raw(train_args(out, "train.keep_last=1"))
    assert code != 0
    assert f"no space left on {out / 'checkpoints'}" in output and "while saving step_00000008" in output
    assert f"The last complete checkpoint, {out / 'checkpoints' / tag(4)}, is intact" in output
    assert not (out / "checkpoints" / f"{tag(8)}.partial").exists()
    assert checkpoint.find_resume("auto", out / "checkpoints") == out / "checkpoints" / tag(4)


def logged(run_dir) -> dict:
    """{step: loss} of the last line logged for each step (a resumed run's lines come later)."""
    return {row["step"]: row["loss"] for row in read_metrics(run_dir)[0]}


def test_a_stop_between_log_and_save_boundaries_resumes_bitwise(cases):
    """The logged loss is a window mean over log_every steps; the open window is saved per rank, so the first
    line after the resume averages the same steps as the uninterrupted run's."""
    dirs, _, _ = cases
    straight, halves = logged(dirs["log_straight"]), logged(dirs["log_halves"])
    assert sorted(straight) == [5, 10, 12]
    assert {step: halves[step] for step in straight} == straight  # bitwise, not approx


def test_sigterm_between_boundaries_resumes_bitwise(cases, tmp_path):
    dirs, _, _ = cases
    out = tmp_path / "run"
    cmd, env = launch_command(train_args(out, *LOG_EVERY_5))
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        while not (out / "checkpoints" / tag(4) / checkpoint.COMPLETE).exists():
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)  # what Ctrl-C (SIGINT) does to the terminal's process group, alike
        output = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stopped = int((out / "checkpoints" / "latest").read_text().strip().split("_")[1])
    assert stopped in (5, 6, 7), stopped  # after the step-4 save, before the next one
    # what docs/checkpoints.md says of the README's `deepspeed` line: the ranks saved and exited 0, yet DeepSpeed's
    # per-node launcher (launcher/launch.py sigkill_handler) terminates them and exits 1, and its runner, with no
    # handler of its own on one node, dies of the signal: the command fails; `python -m trainer launch` exits 0
    assert proc.returncode != 0 and "Killing subprocess" in output and f"stopped at step {stopped}" in output, \
        output[-3000:]
    launch(train_args(out, *LOG_EVERY_5, "train.resume=auto"))
    straight, resumed = logged(dirs["log_straight"]), logged(out)
    assert {step: resumed[step] for step in straight} == straight, stopped


# --- pure parts ------------------------------------------------------------------------------------

def test_a_truncated_file_of_a_checkpoint_without_manifest_is_called_truncated(base, tmp_path):
    ckpt = tmp_path / tag(12)
    shutil.copytree(base / "checkpoints" / tag(12), ckpt)
    (ckpt / checkpoint.COMPLETE).write_text(tag(12) + "\n")  # written before manifests existed
    damage(ckpt / "zero_pp_rank_0_mp_rank_00_optim_states.pt", "truncate")
    with pytest.raises(integrity.CheckpointError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt is truncated or "
                                                        "corrupt"):
        integrity.verify_checkpoint(ckpt, torch.device("cpu"))


def test_the_manifest_lists_every_file_with_size_and_sha256(base):
    ckpt = base / "checkpoints" / tag(12)
    manifest = integrity.read_manifest(ckpt)
    assert manifest["tag"] == tag(12)
    assert set(manifest["files"]) == set(integrity.checkpoint_files(ckpt))
    entry = manifest["files"]["mp_rank_00_model_states.pt"]
    assert entry["bytes"] == (ckpt / "mp_rank_00_model_states.pt").stat().st_size
    assert entry["sha256"] == integrity.sha256_file(ckpt / "mp_rank_00_model_states.pt")


def test_a_fresh_start_refuses_a_directory_that_holds_no_run_on_every_rank(tmp_path):
    """A fresh start (or a resume of another directory's checkpoint) in a directory of someone else's files stops
    before anything is built, on every rank alike (a run's own previous files are set aside instead:
    tests/test_run_dir.py); continuing the directory's own checkpoint touches nothing."""
    from trainer.errors import UserError
    from trainer.train.run import starts_afresh
    assert starts_afresh(tmp_path / "new", None)
    (tmp_path / "thesis.tex").write_text("mine")
    for elsewhere in (None, tmp_path / "other" / "checkpoints" / tag(4)):
        with pytest.raises(UserError, match="holds files that no run of this trainer wrote"):
            starts_afresh(tmp_path, elsewhere)
    assert not starts_afresh(tmp_path, tmp_path / "checkpoints" / tag(4))
