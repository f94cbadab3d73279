"""Preference tuning on the real DeepSpeed engine, 2 CPU ranks: DPO losses equal under ZeRO-0 and ZeRO-3 (reference =
a frozen engine), the three references agree (LoRA base with the adapter disabled vs a frozen engine of the base;
log-probs precomputed once vs a frozen engine), a resume is exact (losses and rewards, with a live and with a
precomputed reference), and on the tiny synthetic preference set (data/tiny/preference.jsonl: the
answer's words reversed are rejected) rewards/accuracy passes 0.9. The precomputed reference log-probs are keyed by
content: the same sources under swapped names, and a hub model whose ref moves to other weights, start at ln 2.

All runs share one launch (tests/workers/run_many.py).
"""
from __future__ import annotations

import json
import math

import pytest

from conftest import TINY
from distributed import read_metrics, run_many
from hub_cache import commit_id, make_hub_cache

pytestmark = pytest.mark.multirank

PREFERENCE = ["data.task=preference", "data.source=data/tiny/preference.jsonl", "data.eval_source=null",
              "data.eval_fraction=0.05"]
LEARN_STEPS = 40
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy")


@pytest.fixture(scope="module")
def preference_runs(tmp_path_factory, pretrained_dir):
    root = tmp_path_factory.mktemp("preference")
    runs, dirs = [], {}

    def add(name, overrides, cache="cache"):
        dirs[name] = root / name
        runs.append({"name": name, "preset": "tiny_cpu", "overrides": TINY + PREFERENCE + overrides + [
            f"train.output_dir={root / name}", f"data.cache_dir={root / cache}"]})

    add("z0", ["deepspeed.zero_optimization.stage=0", "train.lr=3e-3"])
    add("z3", ["deepspeed.zero_optimization.stage=3", "train.lr=3e-3"])
    add("z3_offloaded_reference", ["deepspeed.zero_optimization.stage=3", "train.lr=3e-3",
                                   "preference.reference=engine", "preference.reference_offload=true"])
    lora = ["deepspeed.zero_optimization.stage=2", f"model.name_or_path={pretrained_dir}", "model.lora.enabled=true",
            "train.lr=1e-2"]
    add("lora_adapter", lora + ["preference.reference=adapter"])
    add("lora_engine", lora + ["preference.reference=engine"])
    resume = ["deepspeed.zero_optimization.stage=2", "train.max_steps=8", "train.save_every=4", "train.lr=3e-3",
              "preference.beta=0.5", "preference.label_smoothing=0.1"]
    add("straight", resume)
    add("halves", resume + ["train.stop_after=4"])
    add("halves", resume + ["train.resume=auto"])
    # (c): reference log-probs precomputed once (by a temporary engine), then read again by the next runs
    add("engine_z2", ["deepspeed.zero_optimization.stage=2", "train.lr=3e-3"])
    add("precomputed_z2", ["deepspeed.zero_optimization.stage=2", "train.lr=3e-3", "preference.reference=precomputed"])
    add("precomputed_z3", ["deepspeed.zero_optimization.stage=3", "train.lr=3e-3", "preference.reference=precomputed"])
    pc_resume = resume + ["preference.reference=precomputed"]
    add("pc_straight", pc_resume)
    add("pc_halves", pc_resume + ["train.stop_after=4"])
    add("pc_halves", pc_resume + ["train.resume=auto"])
    add("learn", ["deepspeed.zero_optimization.stage=2", "train.micro_batch_size=4", "train.grad_accum=1",
                  f"train.max_steps={LEARN_STEPS}", "train.warmup_steps=4", "train.lr=3e-3", "logging.log_every=5",
                  "train.eval_every=20", "train.eval_sequences=32", "train.save_every=0"])
    env = content_keyed_runs(root, pretrained_dir, add, runs)
    output, _ = run_many(runs, root, env=env)
    dirs["output"] = output
    return dirs


HUB_MODEL = "tiny-org/tiny-llama"
ONE_STEP = ["deepspeed.zero_optimization.stage=2", "train.max_steps=2", "train.warmup_steps=1", "train.save_every=0",
            "preference.reference=precomputed"]


def content_keyed_runs(root, pretrained_dir, add, runs) -> dict:
    """Runs whose reference log-probs a key by name or by hub id alone would mix up (issue 38): two sources under
    swapped names (the second has the first's chosen and rejected columns swapped, so their log-probs differ), and a
    hub model read again after its ref moved to other weights. Returns the launch's environment (the hub cache)."""
    original = "data/tiny/preference.jsonl"
    swapped = root / "swapped_columns.jsonl"
    with open(original) as source, open(swapped, "w") as out:
        for line in source:
            record = json.loads(line)
            record["chosen"], record["rejected"] = record["rejected"], record["chosen"]
            out.write(json.dumps(record) + "\n")
    for name, (one, two) in (("names_ab", (original, swapped)), ("names_ba", (swapped, original))):
        add(name, ONE_STEP + ["data.source=''", f"data.sources=[{{path: {one}, name: one}}, {{path: {two}, name: two}}]"],
            cache="cache_names")
    other = root / "other_weights"
    from trainer.model import hf_config, init_weights_by_name
    from trainer.presets import load_preset
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(hf_config(load_preset("tiny_cpu", TINY).model, "sdpa"))
    init_weights_by_name(model, seed=8, std=0.02, rank=0)
    model.save_pretrained(str(other))
    ref = make_hub_cache(root / "hub", HUB_MODEL, {commit_id(7): pretrained_dir, commit_id(8): other})
    hub = ONE_STEP + [f"model.name_or_path={HUB_MODEL}"]
    add("hub_first", hub, cache="cache_hub")
    runs.append({"name": "hub_ref_moves", "worker": "hub_refs", "spec": {"ref": str(ref), "commit": commit_id(8)}})
    add("hub_moved", hub, cache="cache_hub")
    return {"HF_HUB_CACHE": str(root / "hub"), "HF_HUB_OFFLINE": "1"}


def train_rows(run_dir) -> list[dict]:
    return read_metrics(run_dir)[0]


def test_dpo_losses_and_rewards_equal_under_zero0_and_zero3(preference_runs):
    z0, z3 = train_rows(preference_runs["z0"]), train_rows(preference_runs["z3"])
    assert len(z0) == len(z3) > 0
    assert z0[0]["loss"] == pytest.approx(0.693147, abs=1e-5)  # the policy starts as its reference
    assert [r["loss"] for r in z3] == pytest.approx([r["loss"] for r in z0], abs=2e-5)
    for name in REWARDS:
        assert [r[name] for r in z3] == pytest.approx([r[name] for r in z0], abs=2e-5)
    assert z0[-1]["loss"] != pytest.approx(z0[0]["loss"], abs=1e-4)  # it trains


def test_a_reference_engine_with_its_parameters_offloaded_gives_the_same_losses(preference_runs):
    """(a) as DeepSpeed-Chat runs it for large models: the frozen ZeRO-3 reference keeps its parameters in CPU
    memory (what 7b_dpo_8xa100 names as its live alternative)."""
    on_rank, offloaded = train_rows(preference_runs["z3"]), train_rows(preference_runs["z3_offloaded_reference"])
    for name in ("loss",) + REWARDS:
        assert [r[name] for r in offloaded] == pytest.approx([r[name] for r in on_rank], abs=2e-5), name
    output = preference_runs["output"]
    assert "reference = a frozen DeepSpeed engine (ZeRO-3, parameters offloaded to CPU memory)" in output
    assert "reference = a frozen DeepSpeed engine (ZeRO-3)" in output


def test_the_lora_base_and_a_frozen_engine_are_the_same_reference(preference_runs):
    adapter, engine = train_rows(preference_runs["lora_adapter"]), train_rows(preference_runs["lora_engine"])
    assert [r["loss"] for r in adapter] == pytest.approx([r["loss"] for r in engine], abs=2e-5)
    assert [r["rewards/margin"] for r in adapter] == pytest.approx([r["rewards/margin"] for r in engine], abs=2e-5)
    assert adapter[-1]["loss"] != pytest.approx(adapter[0]["loss"], abs=1e-4)


def test_a_resumed_preference_run_continues_exactly(preference_runs):
    straight, halves = train_rows(preference_runs["straight"]), train_rows(preference_runs["halves"])
    assert [r["step"] for r in halves] == [r["step"] for r in straight] == list(range(1, 9))
    for name in ("loss",) + REWARDS:
        assert [r[name] for r in halves] == pytest.approx([r[name] for r in straight], abs=1e-6)


def test_precomputed_reference_log_probs_give_the_frozen_engines_losses_and_are_computed_once(preference_runs):
    engine = train_rows(preference_runs["engine_z2"])
    for name in ("precomputed_z2", "precomputed_z3"):
        rows = train_rows(preference_runs[name])
        for key in ("loss",) + REWARDS:
            assert [r[key] for r in rows] == pytest.approx([r[key] for r in engine], abs=2e-5), (name, key)
    engine_evals = read_metrics(preference_runs["engine_z2"])[1]
    evals = read_metrics(preference_runs["precomputed_z2"])[1]
    assert [r["eval_loss"] for r in evals] == pytest.approx([r["eval_loss"] for r in engine_evals], abs=2e-5)
    lines = reference_lines(preference_runs["output"], preference_runs["engine_z2"].parent / "cache")
    assert [line.startswith("computed for") for line in lines] == [True, False, False, False, False]  # precomputed_z2
    assert lines[1:] == ["read"] * 4  # z3 and the resume runs read it


def test_a_resumed_run_with_precomputed_reference_continues_exactly(preference_runs):
    straight, halves = train_rows(preference_runs["pc_straight"]), train_rows(preference_runs["pc_halves"])
    assert [r["step"] for r in halves] == list(range(1, 9))
    for name in ("loss",) + REWARDS:
        assert [r[name] for r in halves] == pytest.approx([r[name] for r in straight], abs=1e-6)
    live = train_rows(preference_runs["straight"])
    assert [r["loss"] for r in straight] == pytest.approx([r["loss"] for r in live], abs=2e-5)


def test_rewards_accuracy_passes_0_9_on_the_tiny_preference_set(preference_runs):
    rows, evals = read_metrics(preference_runs["learn"])
    print("learn:", [(r["step"], round(r["loss"], 4), r["rewards/accuracy"], round(r["rewards/margin"], 3))
                     for r in rows], [(r["step"], r["eval_rewards/accuracy"]) for r in evals])
    assert rows[-1]["step"] == LEARN_STEPS
    assert rows[-1]["rewards/accuracy"] > 0.9 and rows[-1]["rewards/margin"] > 0
    assert evals[-1]["eval_rewards/accuracy"] > 0.9  # on held-out pairs
    assert rows[0]["rewards/accuracy"] < 0.9  # it was learnt, not there from the start


def reference_lines(output: str, cache) -> list[str]:
    """What each run that used the reference cache `cache` said of it ("computed for ..." or "read")."""
    suffix = f" ({cache}/reference-logps)"
    return [line.split("preference: reference log-probs ")[1].removesuffix(suffix) for line in output.splitlines()
            if line.endswith(suffix) and "preference: reference log-probs " in line]


def test_the_same_sources_under_swapped_names_start_at_ln_2(preference_runs):
    """Keyed by content, not by a source's name: the second run reads the first's values for the data each name
    now holds (a key by name handed each source the other's log-probs: step-1 loss 0.70344)."""
    for name in ("names_ab", "names_ba"):
        assert train_rows(preference_runs[name])[0]["loss"] == pytest.approx(math.log(2), abs=1e-5), name
    cache = preference_runs["names_ab"].parent / "cache_names"
    assert reference_lines(preference_runs["output"], cache) == [
        "computed for one-train, two-train, one-eval, two-eval", "read"]


def test_a_hub_model_whose_ref_moved_to_other_weights_starts_at_ln_2(preference_runs):
    """The hub commit and blobs are in the key: after refs/main moves to other weights the reference log-probs are
    computed again (a key by hub id alone read the old ones: step-1 loss 0.686472)."""
    for name in ("hub_first", "hub_moved"):
        assert train_rows(preference_runs[name])[0]["loss"] == pytest.approx(math.log(2), abs=1e-5), name
    cache = preference_runs["hub_first"].parent / "cache_hub"
    lines = reference_lines(preference_runs["output"], cache)
    assert len(lines) == 2 and all(line.startswith("computed for") for line in lines)
