"""`python -m trainer evaluate` on preference pairs (2 CPU ranks for training): the loss, preference accuracy and
reward margin it reports for a run's checkpoint are the eval_loss and eval_rewards/* the training loop logged at
that step, on 1 and on 2 ranks, for a full fine-tune (reference: the seeded init, live or precomputed) and for
LoRA (reference: the base); what it cannot know is a named error.
"""
from __future__ import annotations

import json
import math

import pytest

from conftest import TINY
from distributed import launch, read_metrics, run_cli, run_many

pytestmark = pytest.mark.multirank

PREFERENCE = ["data.task=preference", "data.source=data/tiny/preference.jsonl", "data.eval_source=null",
              "data.eval_fraction=0.05", "train.export_hf=true", "train.lr=3e-3"]
SCORES = ("eval_loss", "eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/margin", "eval_rewards/accuracy")


@pytest.fixture(scope="module")
def preference_runs(tmp_path_factory, pretrained_dir):
    root = tmp_path_factory.mktemp("preference_eval")
    runs = [{"name": "full", "preset": "tiny_cpu", "overrides": TINY + PREFERENCE + [
                "deepspeed.zero_optimization.stage=3", f"train.output_dir={root / 'full'}",
                f"data.cache_dir={root / 'cache'}"]},
            {"name": "lora", "preset": "tiny_cpu", "overrides": TINY + PREFERENCE + [
                "deepspeed.zero_optimization.stage=2", f"model.name_or_path={pretrained_dir}",
                "model.lora.enabled=true", "train.lr=1e-2", "preference.reference=adapter",
                f"train.output_dir={root / 'lora'}", f"data.cache_dir={root / 'cache'}"]},
            {"name": "precomputed", "preset": "tiny_cpu", "overrides": TINY + PREFERENCE + [
                "deepspeed.zero_optimization.stage=2", "preference.reference=precomputed",
                f"train.output_dir={root / 'precomputed'}", f"data.cache_dir={root / 'cache'}"]}]
    run_many(runs, root)
    return {"full": root / "full", "lora": root / "lora", "precomputed": root / "precomputed",
            "pretrained": pretrained_dir}


def logged_at(run_dir, step: int) -> dict:
    return next(row for row in read_metrics(run_dir)[1] if row["step"] == step)


def evaluated(*args: str) -> dict:
    proc = run_cli("evaluate", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def assert_same_scores(result: dict, logged: dict) -> None:
    for key in SCORES:
        assert result[key] == pytest.approx(logged[key], abs=1e-5), (key, result, logged)
    assert result["tokens"] == logged["eval_tokens"]


def test_evaluate_gives_the_loops_eval_rewards_for_a_checkpoint_and_the_export(preference_runs):
    run = preference_runs["full"]
    middle = evaluated("--model", str(run / "checkpoints" / "step_00000003"))
    assert_same_scores(middle, logged_at(run, 3))
    final = evaluated("--model", str(run))
    assert_same_scores(final, logged_at(run, 6))
    assert final["pairs"] == 8  # train.eval_sequences in conftest's TINY
    assert "seeded init" in final["reference"]
    assert final["eval_rewards/margin"] > middle["eval_rewards/margin"]  # it moved: the numbers are the step's own
    itself = evaluated("--model", str(run), "--reference", str(run / "hf"))  # the policy as its own reference
    assert itself["eval_loss"] == pytest.approx(math.log(2), abs=1e-7) and itself["eval_rewards/margin"] == 0
    assert "--reference" in itself["reference"]


def test_the_scores_do_not_depend_on_how_the_pairs_are_cut_into_batches(preference_runs):
    """The loss is a mean over pairs, so 8 pairs scored 1, 3 (3+3+2) or 8 at a time give the loop's numbers."""
    run, logged = preference_runs["full"], logged_at(preference_runs["full"], 6)
    for size in ("1", "3", "8"):
        assert_same_scores(evaluated("--model", str(run), "--batch-size", size), logged)


def test_evaluate_on_2_ranks_gives_the_same_scores(preference_runs, tmp_path):
    run = preference_runs["full"]
    out = tmp_path / "two.json"
    launch(["--module", "trainer", "evaluate", "--model", str(run), "-o", str(out)])
    assert_same_scores(json.loads(out.read_text()), logged_at(run, 6))


def test_a_run_on_precomputed_reference_log_probs_is_scored_against_the_same_reference(preference_runs):
    run = preference_runs["precomputed"]
    assert_same_scores(evaluated("--model", str(run)), logged_at(run, 6))


def test_a_lora_run_is_scored_against_its_base(preference_runs):
    run, base = preference_runs["lora"], preference_runs["pretrained"]
    result = evaluated("--model", str(run))
    assert_same_scores(result, logged_at(run, 6))
    assert str(base) in result["reference"]
    named = evaluated("--model", str(run), "--reference", str(base))
    assert [named[k] for k in SCORES] == [result[k] for k in SCORES]


def test_what_evaluate_cannot_know_is_a_named_error(preference_runs, tmp_path):
    export = preference_runs["full"] / "hf"  # a plain HF model: no training config, so no known reference
    proc = run_cli("evaluate", "--model", str(export), "--data", "data/tiny/preference.jsonl", "--task", "preference",
                   "--seq-len", "64")
    assert proc.returncode != 0 and "pass --reference SRC" in proc.stderr, proc.stderr[-2000:]
    proc = run_cli("evaluate", "--model", str(preference_runs["full"]), "--data", "data/tiny/sft.jsonl", "--task",
                   "sft", "--reference", str(export))
    assert proc.returncode != 0 and "--reference is the reference model of preference pairs" in proc.stderr
    from transformers import LlamaConfig
    other = tmp_path / "other_vocab"  # its config is all that is read before the refusal
    LlamaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=176).save_pretrained(other)
    proc = run_cli("evaluate", "--model", str(preference_runs["full"]), "--reference", str(other))
    assert proc.returncode != 0 and "a reference must share the model's tokenizer" in proc.stderr, proc.stderr[-2000:]
