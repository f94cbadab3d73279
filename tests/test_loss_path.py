"""One decision for which loss path runs (trainer.loss_path), and the planner pricing the path the code takes.

The slow test runs every objective the trainer has (pretraining/SFT, tiled logits, the DPO policy and its reference)
through its real code (trainer.train.preference objectives on a real one-rank DeepSpeed engine, a tiny Llama from
trainer.model.build_model) and reads what the model's forward was really given: labels (Liger's fused loss runs
there when Liger is applied: its forward fuses only a training forward with labels), an empty logits_to_keep (the
tiled loss) or neither (full logits). That observed path must be the one the planner priced for the same resolved
config (plan_for_resolved), with and without model.liger. Sequence parallelism needs two ranks; its decision is
checked against the plan here (SP forwards without labels: train.sequence_parallel.model_inputs).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from distributed import one_rank_process_group
from trainer import loss_path
from trainer.plan.estimate import plan_for_resolved
from trainer.presets import load_preset
from trainer.resolve import resolve

ROOT = Path(__file__).resolve().parent.parent
PREFERENCE = ["data.task=preference", f"data.source={ROOT / 'data' / 'tiny' / 'preference.jsonl'}",
              "preference.reference=engine"]


def planned(preset: str, overrides: list[str]):
    resolved = resolve(load_preset(preset, overrides))
    return resolved, plan_for_resolved(resolved).activations


def test_dpo_with_liger_is_priced_with_the_full_logits_its_policy_forward_builds():
    """The issue's case: 7b_dpo_8xa100 with model.liger=true was planned at 0.53 GB of logits (Liger's fused loss)
    while the policy, called without labels, builds ~6.3 GB of them."""
    _, plain = planned("7b_dpo_8xa100", [])
    _, liger = planned("7b_dpo_8xa100", ["model.liger=true"])
    assert liger.loss_path == plain.loss_path == loss_path.LOGITS
    assert liger.logits == plain.logits > 6e9
    _, sft = planned("7b_8xa100", ["model.liger=true"])  # where Liger's fused loss does run, it is counted
    assert sft.loss_path == loss_path.FUSED and sft.logits < planned("7b_8xa100", [])[1].logits / 10


def test_liger_under_sequence_parallelism_or_zero3_keeps_the_logits_and_so_their_tiles():
    """Liger's fused loss never runs under sequence parallelism (the shards' forwards have no labels) or ZeRO-3:
    model.tiled_logits "auto" must not stay off for it, and the plan prices what runs."""
    resolved, liger = planned("8b_128k_8xh100", ["model.liger=true"])
    assert resolved.config.model.tiled_logits >= 2 and liger.loss_path == loss_path.TILED
    assert liger.logits == planned("8b_128k_8xh100", [])[1].logits
    _, zero3 = planned("70b_8xa100", ["model.liger=true"])
    assert zero3.loss_path == loss_path.MODEL and zero3.logits == planned("70b_8xa100", [])[1].logits


def test_every_forward_has_a_path_and_the_start_up_line_names_its_kernel():
    for forward in loss_path.FORWARDS:
        for liger in (False, True):
            for stage, sp, tiles in ((0, 1, 0), (3, 1, 0), (2, 4, 0), (2, 1, 4)):
                path = loss_path.loss_path(forward, liger, stage, sp, tiles)
                assert loss_path.loss_kernel(path, liger)
    with pytest.raises(ValueError, match="forward 'eval' is not one of"):
        loss_path.loss_path("eval", False, 0)


# ------------------------------------------------------------------------- the code's own forwards, observed


@pytest.fixture(scope="module")
def one_rank():
    with one_rank_process_group():
        yield


def engine_of(cfg, micro_batch: int, frozen: bool = False):
    """A real one-rank DeepSpeed engine (ZeRO-0, fp32) around trainer.model.build_model's model for `cfg` (the
    engine reads LOCAL_RANK; conftest's process_state_restored restores the environment after the test)."""
    import os

    import deepspeed
    os.environ["LOCAL_RANK"] = "0"

    from trainer.model import build_model
    model, _ = build_model(cfg, 0)
    if frozen:
        model.requires_grad_(False)
    optimizer = None if frozen else torch.optim.SGD(model.parameters(), lr=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config={
        "train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 0}})
    return engine


def record_forwards(engine) -> list[dict]:
    """The keyword arguments of every call of the engine's transformers model, as it received them."""
    calls: list[dict] = []
    engine.module.register_forward_pre_hook(lambda module, args, kwargs: calls.append(dict(kwargs)),
                                            with_kwargs=True)
    return calls


def observed_path(call: dict, liger: bool, zero_stage: int) -> str:
    """The loss path a forward with these arguments takes in the model: an empty logits_to_keep is the tiled loss,
    labels make the model compute its loss (fused by Liger where trainer.model.maybe_apply_liger patched the fused
    forward in: Liger applied, below ZeRO-3), and no labels mean full logits."""
    keep = call.get("logits_to_keep")
    if isinstance(keep, torch.Tensor) and keep.numel() == 0:
        return loss_path.TILED
    if call.get("labels") is not None:
        return loss_path.FUSED if liger and zero_stage != 3 else loss_path.MODEL
    return loss_path.LOGITS


def causal_batch(vocab: int, rows: int = 2, length: int = 16) -> dict:
    ids = torch.randint(3, vocab, (rows, length))
    return {"input_ids": ids, "labels": ids.clone()}


def pair_batch(vocab: int, pairs: int = 1, length: int = 16) -> dict:
    ids = torch.randint(3, vocab, (pairs, 2, length))
    labels = ids.clone()
    labels[..., :4] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [[], ["model.tiled_logits=2"]], ids=["causal", "tiled"])
def test_the_causal_objective_runs_the_path_the_planner_priced(one_rank, overrides):
    from trainer.train.preference import make_objective
    for liger in (False, True):
        resolved, plan = planned("tiny_cpu", [*overrides, f"model.liger={str(liger).lower()}"])
        cfg = resolved.config
        engine = engine_of(cfg, cfg.train.micro_batch_size)
        calls = record_forwards(engine)
        make_objective(engine, cfg)(causal_batch(cfg.model.vocab_size, cfg.train.micro_batch_size))
        # on this CPU Liger falls back (a one-line warning): the forward made is the one Liger would fuse
        assert [observed_path(call, liger, 0) for call in calls] == [plan.loss_path]


@pytest.mark.slow
def test_the_dpo_policy_and_reference_run_the_path_the_planner_priced(one_rank):
    from trainer.plan import memory as mem
    from trainer.train.preference import make_objective
    for liger in (False, True):
        resolved, plan = planned("tiny_cpu", [*PREFERENCE, f"model.liger={str(liger).lower()}"])
        cfg = resolved.config
        policy, reference = engine_of(cfg, cfg.train.micro_batch_size), engine_of(cfg, 1, frozen=True)
        policy_calls, reference_calls = record_forwards(policy), record_forwards(reference)
        make_objective(policy, cfg, reference)(pair_batch(cfg.model.vocab_size))
        assert [observed_path(call, liger, 0) for call in policy_calls] == [plan.loss_path]
        assert [observed_path(call, liger, 0) for call in reference_calls] == [
            loss_path.loss_path("reference", liger, 0)]
        tokens, m = cfg.data.seq_len * 2 * cfg.train.micro_batch_size, cfg.model
        assert plan.logits == 12 * tokens * m.vocab_size  # the full logits, Liger or not
        assert mem.reference_forward_bytes(m, cfg.data.seq_len, 2 * cfg.train.micro_batch_size, "fp32") > \
            (4 + 8) * tokens * m.vocab_size  # the reference's full logits, upcast and log-softmaxed
