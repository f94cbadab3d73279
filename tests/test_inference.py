"""Inference and evaluation on real DeepSpeed engines (2 CPU ranks): `trainer generate` and `trainer evaluate`
on runs trained by this suite (conftest's engine_runs: ZeRO-2, ZeRO-3, LoRA, sample prompts).

What a user relies on: TP=2 gives the tokens TP=1 gives; a checkpoint generates what its HF export generates,
whatever the ZeRO stage; ZeRO-Inference computes what the plain model computes; batching does not change a
completion; `evaluate` on a run reproduces the run's own final eval loss on 1 and on 2 ranks.
"""
from __future__ import annotations

import json

import pytest

from conftest import SAMPLE_PROMPTS
from distributed import eval_losses, launch, read_metrics, run_cli

pytestmark = pytest.mark.multirank

# mixed lengths: a batch of these is left-padded
PROMPTS = ["Once upon a time", "The", "She said that the little dog was very happy and", "Tom and"]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def generate(model, prompts, out, *extra, ranks=1, new_tokens=16):
    args = ["generate", "--model", str(model), "--prompts", str(prompts), "--greedy", "--max-new-tokens",
            str(new_tokens), "--format", "jsonl", "-o", str(out), *extra]
    if ranks == 1:
        proc = run_cli(*args)
        assert proc.returncode == 0, proc.stderr[-3000:]
    else:
        launch(["--module", "trainer", *args], ranks=ranks)
    return [json.loads(line) for line in out.read_text().splitlines()]


def completions(rows):
    return [(r["completion"], r["tokens"]) for r in rows]


def test_tp2_greedy_equals_tp1(engine_runs, prompts_file, tmp_path):
    run = engine_runs[0]["export_z2"]
    one = generate(run, prompts_file, tmp_path / "tp1.jsonl")
    two = generate(run, prompts_file, tmp_path / "tp2.jsonl", "--tp", "2", ranks=2)
    assert [r["prompt"] for r in one] == PROMPTS
    assert all(r["tokens"] > 0 for r in one)
    assert completions(two) == completions(one)


def test_two_replicas_split_the_prompts_and_agree(engine_runs, prompts_file, tmp_path):
    """--tp 1 on 2 ranks: each rank completes half of the prompts; rank 0 writes all of them, in order."""
    run = engine_runs[0]["export_z2"]
    one = generate(run, prompts_file, tmp_path / "one.jsonl")
    replicas = generate(run, prompts_file, tmp_path / "replicas.jsonl", "--tp", "1", ranks=2)
    assert completions(replicas) == completions(one)


@pytest.mark.parametrize("stage", ["z2", "z3"])
def test_checkpoint_generates_what_the_export_generates(engine_runs, prompts_file, tmp_path, stage):
    run = engine_runs[0][f"export_{stage}"]
    checkpoint = run / "checkpoints" / "step_00000006"
    assert (checkpoint / "COMPLETE").is_file()
    exported = generate(run / "hf", prompts_file, tmp_path / "hf.jsonl")
    direct = generate(checkpoint, prompts_file, tmp_path / "ckpt.jsonl")
    assert completions(direct) == completions(exported)


def test_batched_equals_one_by_one(engine_runs, prompts_file, tmp_path):
    run = engine_runs[0]["export_z3"]
    batched = generate(run, prompts_file, tmp_path / "batched.jsonl", "--batch-size", "4")
    alone = generate(run, prompts_file, tmp_path / "alone.jsonl", "--batch-size", "1")
    assert completions(batched) == completions(alone)


def test_zero_inference_cpu_offload_gives_the_plain_logits(engine_runs, tmp_path):
    out = tmp_path / "logits.json"
    launch(["tests/workers/zero_inference_logits.py", str(engine_runs[0]["export_z3"] / "hf"), str(out)])
    result = json.loads(out.read_text())
    assert result["offloaded"] == "zero-cpu"
    assert len(result["max_diff"]) == 2 and max(result["max_diff"]) < 1e-5, result


def test_jsonl_stdout_is_pure_jsonl(engine_runs):
    proc = run_cli("generate", "--model", str(engine_runs[0]["export_z2"]), "--prompt", "Once", "--prompt", "The",
                   "--max-new-tokens", "4", "--format", "jsonl")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["prompt"] for r in rows] == ["Once", "The"]
    assert set(rows[0]) == {"prompt", "completion", "tokens", "time_to_first_token_s", "tokens_per_s"}
    assert all(r["time_to_first_token_s"] > 0 and r["tokens_per_s"] > 0 for r in rows)


def test_sampling_is_seeded(engine_runs, prompts_file):
    run = engine_runs[0]["export_z2"]

    def sampled(seed: int) -> list[str]:
        proc = run_cli("generate", "--model", str(run), "--prompts", str(prompts_file), "--format", "jsonl",
                       "--temperature", "1.5", "--top-p", "0.95", "--seed", str(seed))
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [json.loads(line)["completion"] for line in proc.stdout.splitlines()]

    first = sampled(1)
    assert sampled(1) == first
    assert sampled(2) != first


def test_evaluate_reproduces_the_runs_final_eval_loss_on_1_and_2_ranks(engine_runs, tmp_path):
    run = engine_runs[0]["export_z2"]
    final = eval_losses(run)[-1]
    proc = run_cli("evaluate", "--model", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = json.loads(proc.stdout)
    out = tmp_path / "eval2.json"
    launch(["--module", "trainer", "evaluate", "--model", str(run), "-o", str(out)])
    two = json.loads(out.read_text())
    assert abs(one["eval_loss"] - final) < 1e-4, (one, final)
    assert abs(two["eval_loss"] - final) < 1e-4, (two, final)
    assert one["sequences"] == two["sequences"] == 8  # train.eval_sequences in conftest's TINY
    assert one["tokens"] == two["tokens"] == 8 * 63  # the model predicts 63 of a sequence's 64 tokens


def test_evaluate_a_checkpoint_directly(engine_runs):
    run = engine_runs[0]["export_z3"]
    proc = run_cli("evaluate", "--model", str(run / "checkpoints" / "step_00000006"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert abs(json.loads(proc.stdout)["eval_loss"] - eval_losses(run)[-1]) < 1e-4


def test_lora_adapter_merged_export_and_checkpoint_agree(engine_runs, prompts_file, tmp_path):
    run = engine_runs[0]["lora_z2"]
    assert (run / "hf" / "adapter_config.json").is_file() and (run / "hf_merged" / "config.json").is_file()
    adapter = generate(run / "hf", prompts_file, tmp_path / "adapter.jsonl")
    merged = generate(run / "hf_merged", prompts_file, tmp_path / "merged.jsonl")
    direct = generate(run / "checkpoints" / "step_00000006", prompts_file, tmp_path / "ckpt.jsonl")
    assert completions(adapter) == completions(merged) == completions(direct)


def test_sample_prompts_are_generated_at_every_eval_under_zero3(engine_runs, tmp_path):
    run = engine_runs[0]["samples_z3"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    samples = {r["step"]: r["samples"] for r in rows if "samples" in r}
    assert sorted(samples) == [r["step"] for r in read_metrics(run)[1]] == [3, 6]
    assert [s["prompt"] for s in samples[6]] == SAMPLE_PROMPTS
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in SAMPLE_PROMPTS))
    again = generate(run / "checkpoints" / "step_00000006", prompts, tmp_path / "again.jsonl", new_tokens=8)
    assert [s["completion"] for s in samples[6]] == [r["completion"] for r in again]


def test_torchrun_tp2_stdout_is_pure_jsonl(engine_runs, prompts_file, tmp_path):
    """Under torchrun (no --local_rank argument; env only), rank 0 alone prints, and only JSON lines."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from distributed import REPO, new_port, remove_shm_buffers
    run = engine_runs[0]["export_z2"]
    port = new_port()
    torchrun = Path(sys.executable).parent / "torchrun"
    proc = subprocess.run([str(torchrun), "--nproc_per_node", "2", "--master_port", str(port), "-m", "trainer",
                           "generate", "--model", str(run), "--prompts", str(prompts_file), "--greedy",
                           "--max-new-tokens", "16", "--format", "jsonl", "--tp", "2"],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=600)
    remove_shm_buffers(port)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    one = generate(run, prompts_file, tmp_path / "tp1.jsonl")
    assert completions(rows) == completions(one)
