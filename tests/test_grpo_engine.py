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
             "overrides": [f"train.output_dir={root / 'rehearse'}"]},
            {"name": "rehearse_tiny", "preset": "tiny_grpo_cpu", "rehearse": True,
             "overrides": [f"train.output_dir={root / 'rehearse_tiny'}"]}]
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
    assert "grpo.num_generations 8 -> 2" in output  # the 7B rehearsal's group fits its micro-batch
    assert (root / "preset" / "hf" / "model.safetensors").exists()


@pytest.mark.parametrize("preset,run", [("7b_grpo_8xh100", "rehearse"), ("tiny_grpo_cpu", "rehearse_tiny")])
def test_the_grpo_presets_rehearse_on_two_cpu_ranks(runs, preset, run):
    root, output = runs
    assert f"rehearsal of {preset}" in output
    train = read_metrics(root / run)[0]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6] and all("reward/mean" in r for r in train)
    assert checkpoint.find_resume("auto", root / run / "checkpoints").name == "step_00000006"
    assert any((root / run / "hf").glob("*.safetensors"))


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


@pytest.mark.gpu
def test_vllm_as_the_external_rollout_engine_takes_pushed_weights():
    """The external interface (train/rl/external.py) against vLLM on a GPU: after push_weights, vLLM's greedy
    completions are the policy's own (the trainer's sampler at temperature 0)."""
    vllm = pytest.importorskip("vllm")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.presets import REPO_ROOT
    from trainer.train.rl.external import ExternalRollouts, SamplingSettings, push_weights
    from trainer.train.rl.rollout import sample

    start = str(REPO_ROOT / "data" / "tiny_grpo" / "start")
    policy = AutoModelForCausalLM.from_pretrained(start).cuda().eval()
    with torch.no_grad():  # the policy moves away from the weights vLLM loaded
        for p in policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    tokenizer = AutoTokenizer.from_pretrained(start)

    class Vllm:
        def __init__(self):
            self.llm = vllm.LLM(model=start, dtype="float32", gpu_memory_utilization=0.2, enforce_eager=True)

        def load_weights(self, named_tensors):
            tensors = list(named_tensors)
            self.llm.collective_rpc(lambda worker: worker.model_runner.model.load_weights(tensors))

        def generate(self, prompt_ids, n, params):
            sampling = vllm.SamplingParams(n=n, max_tokens=params.max_new_tokens, temperature=params.temperature,
                                           seed=params.seed)
            out = self.llm.generate([vllm.TokensPrompt(prompt_token_ids=p) for p in prompt_ids], sampling)
            return [list(c.token_ids) for o in out for c in o.outputs]

    engine = Vllm()
    push_weights(type("Engine", (), {"module": policy})(), engine)
    prompts = [tokenizer(f"{a}+{b}=")["input_ids"] for a, b in ((1, 2), (7, 8))]
    ids, mask = ExternalRollouts(engine, tokenizer.pad_token_id, "cuda").complete(
        prompts, 1, SamplingSettings(4, temperature=0.0))
    ours, kept = sample(policy, torch.tensor(prompts).cuda(), torch.ones(2, 4, dtype=torch.long).cuda(), 4,
                        [tokenizer.eos_token_id], tokenizer.pad_token_id, temperature=0.0)
    assert (ids * mask).tolist()[0][:int(kept[0].sum())] == (ours * kept).tolist()[0][:int(kept[0].sum())]
