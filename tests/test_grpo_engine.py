"""GRPO on real 2-rank CPU launches (data.task=grpo): the shipped preset learns its 0/1 reward, the 7B preset
rehearses, and a SIGKILL in the middle of a rollout cycle followed by `--resume auto` continues the reward and loss
curves exactly. One launch runs the preset, the rehearsal and the uninterrupted reference run (tests/workers/
run_many.py); the killed run and its resume are two more.
"""
from __future__ import annotations

import json
import statistics

import pytest

from distributed import launch, launch_raw, read_metrics, run_many, with_faults
from trainer.train import checkpoint

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

# num_iterations 2: steps 1-2 train on one rollout, 3-4 on the next...; the step-3 checkpoint falls inside a cycle,
# so the resumed run must train step 4 on the saved rollout with the saved sampler state.
SMALL = ["grpo.num_iterations=2", "train.max_steps=8", "train.save_every=3", "train.eval_every=4",
         "train.warmup_steps=2", "train.export_hf=false"]


def rows(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir)[0]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    spec = [{"name": "preset", "preset": "tiny_grpo_cpu", "overrides": [f"train.output_dir={root / 'preset'}"]},
            {"name": "straight", "preset": "tiny_grpo_cpu",
             "overrides": SMALL + [f"train.output_dir={root / 'straight'}"]},
            {"name": "rehearse", "preset": "7b_grpo_8xh100", "rehearse": True,
             "overrides": [f"train.output_dir={root / 'rehearse'}"]}]
    output, _ = run_many(spec, root, timeout=1200)
    return root, output


def test_the_preset_learns_its_reward(runs):
    root, output = runs
    train = [r for r in read_metrics(root / "preset")[0]]
    rewards = [r["reward/mean"] for r in train]
    first, last = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
    print(f"tiny_grpo_cpu reward/mean: first 10 {first:.3f}, last 10 {last:.3f}")
    assert last >= first + 0.2, (first, last)
    for key in ("reward/std", "reward/exact_match", "accuracy", "kl", "clip_ratio", "entropy", "completion_length",
                "rollout_tokens_per_s", "gen_share"):
        assert key in train[-1], key
    assert 0 < train[-1]["gen_share"] < 1
    evals = [r for r in (json.loads(x) for x in (root / "preset" / "metrics.jsonl").read_text().splitlines())
             if "eval_reward/mean" in r]
    assert evals and "eval_accuracy" in evals[-1]
    assert "grpo: 8 completions per prompt" in output and "reference = a frozen DeepSpeed engine" in output
    assert (root / "preset" / "hf" / "model.safetensors").exists()


def test_the_7b_preset_rehearses_on_two_cpu_ranks(runs):
    root, output = runs
    assert "rehearsal of 7b_grpo_8xh100" in output
    assert "grpo.num_generations 8 -> 2" in output
    train = read_metrics(root / "rehearse")[0]
    assert train and all("reward/mean" in r for r in train)
    assert checkpoint.find_resume("auto", root / "rehearse" / "checkpoints") is not None


def test_sigkill_inside_a_rollout_cycle_then_resume_continues_the_curve_exactly(runs, tmp_path):
    root, _ = runs
    out = tmp_path / "run"
    args = ["tests/workers/train_with_faults.py", "--preset", "tiny_grpo_cpu"]
    for item in SMALL + [f"train.output_dir={out}"]:
        args += ["--set", item]
    code, output = launch_raw(args, env={"TRAINER_FAULTS": "kill_at@5"})
    assert code != 0, "kill_at@5 did not kill the run"
    assert checkpoint.find_resume("auto", out / "checkpoints").name == "step_00000003"
    saved = json.loads((out / "checkpoints" / "step_00000003" / "rng_rank1.json").read_text())["objective"]
    assert saved["sampler"] and saved["rollout"], "the rollout of the open cycle is saved"
    resumed_output = launch([a if a != "tests/workers/train_with_faults.py" else "train.py" for a in args]
                            + ["--set", "train.resume=auto"])
    assert "resume: continuing from" in resumed_output
    straight, resumed = rows(root / "straight"), rows(out)
    for step in range(4, 9):
        for key in ("loss", "reward/mean", "kl", "completion_length", "entropy"):
            assert resumed[step][key] == pytest.approx(straight[step][key], abs=1e-6), (step, key)
