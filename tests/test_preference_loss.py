"""The preference loss (trainer/train/preference.py): DPO sigmoid (with cDPO label smoothing) and IPO against the
papers' formulas computed by hand in float64, against TRL's when TRL is installed, and on a real tiny model with both
references (a frozen copy; the LoRA base with the adapter disabled).

Fast and local: no DeepSpeed, no distributed.
"""
from __future__ import annotations

import copy
import math
import types

import pytest
import torch

from trainer.config import PreferenceConfig
from trainer.train.preference import (
    REWARDS, Objective, PreferenceObjective, RewardMeter, adapter_disabled, preference_losses, sequence_logps,
)

# summed response log-probs of 4 pairs: policy chosen/rejected, reference chosen/rejected
LOGPS = torch.tensor([[-14.2, -17.9, -15.0, -16.1],
                      [-3.5, -2.25, -3.0, -2.0],
                      [-40.0, -39.5, -41.75, -38.0],
                      [-7.0, -7.0, -7.5, -6.5]], dtype=torch.float64)
LENGTHS = (torch.tensor([5, 2, 11, 3]), torch.tensor([7, 2, 9, 4]))


def by_hand(settings: PreferenceConfig) -> list[float]:
    """The DPO paper's (and cDPO's) formula, and IPO's, one pair at a time in Python floats."""
    def log_sigmoid(x: float) -> float:
        return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))
    out = []
    for (pc, pr, rc, rr), lc, lr in zip(LOGPS.tolist(), LENGTHS[0].tolist(), LENGTHS[1].tolist()):
        if settings.loss == "sigmoid":
            margin = (pc - rc) - (pr - rr)
            ls = settings.label_smoothing
            out.append(-log_sigmoid(settings.beta * margin) * (1 - ls) - log_sigmoid(-settings.beta * margin) * ls)
        else:
            margin = (pc - rc) / lc - (pr - rr) / lr
            out.append((margin - 1 / (2 * settings.beta)) ** 2)
    return out


SETTINGS = [PreferenceConfig(beta=0.1), PreferenceConfig(beta=0.5, label_smoothing=0.2),
            PreferenceConfig(loss="ipo", beta=0.1), PreferenceConfig(loss="ipo", beta=2.0)]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: f"{s.loss}-b{s.beta}-ls{s.label_smoothing}")
def test_losses_equal_the_papers_formulas(settings):
    out = preference_losses(*LOGPS.T, settings, LENGTHS)
    assert out["losses"].tolist() == pytest.approx(by_hand(settings), abs=1e-6, rel=0)
    assert out["chosen"].tolist() == pytest.approx((settings.beta * (LOGPS[:, 0] - LOGPS[:, 2])).tolist(), abs=1e-12)
    assert out["rejected"].tolist() == pytest.approx((settings.beta * (LOGPS[:, 1] - LOGPS[:, 3])).tolist(),
                                                     abs=1e-12)


def test_sequence_logps_sum_only_labelled_tokens():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11, dtype=torch.float64)
    labels = torch.tensor([[-100, -100, 3, 4, 5, -100], [-100, 7, 7, -100, -100, -100]])
    sums, counts = sequence_logps(logits, labels)
    logp = torch.log_softmax(logits, -1)
    expected = [sum(float(logp[row, t - 1, labels[row, t]]) for t in range(1, 6) if labels[row, t] != -100)
                for row in range(2)]
    assert sums.tolist() == pytest.approx(expected, abs=1e-9) and counts.tolist() == [3, 2]


def test_reward_meter_averages_pairs_and_starts_again_after_each_take():
    meter = RewardMeter()
    meter.add(torch.tensor([1.0, 0.5]), torch.tensor([0.0, 1.0]))
    meter.add(torch.tensor([2.0]), torch.tensor([-1.0]))
    taken = meter.take("cpu")
    assert list(taken) == list(REWARDS)
    assert taken == pytest.approx({"rewards/chosen": 3.5 / 3, "rewards/rejected": 0.0, "rewards/margin": 3.5 / 3,
                                   "rewards/accuracy": 2 / 3})
    assert meter.take("cpu") == {}


# ------------------------------------------------------------------------------------------- on a real model

class Engine:
    """What the objective uses of a DeepSpeed engine: calling it, and its module."""

    def __init__(self, module):
        self.module = module

    def __call__(self, **batch):
        return self.module(**batch)


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=50, max_position_embeddings=32)
    return LlamaForCausalLM(config).eval()


def pair_batch() -> dict:
    torch.manual_seed(1)
    ids = torch.randint(3, 50, (3, 2, 12))
    mask = torch.ones_like(ids)
    mask[:, 1, 10:] = 0
    labels = ids.clone()
    labels[..., :5] = -100
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.slow  # a real model's forwards, ~3.5 s of CPU in the quick tier
def test_objective_on_a_real_model_equals_the_formula_on_separate_forwards():
    policy = tiny_model()
    reference = copy.deepcopy(policy)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    settings = PreferenceConfig(beta=0.3, label_smoothing=0.1)
    batch = pair_batch()
    objective = PreferenceObjective(Engine(policy),
                                    lambda ids, mask: reference(input_ids=ids, attention_mask=mask).logits, settings)
    loss = objective(batch)
    per_pair = []
    with torch.no_grad():
        for i in range(3):
            logps = []
            for model in (policy, reference):
                for side in (0, 1):
                    out = model(input_ids=batch["input_ids"][i, side:side + 1],
                                attention_mask=batch["attention_mask"][i, side:side + 1])
                    logps.append(sequence_logps(out.logits, batch["labels"][i, side:side + 1])[0])
            per_pair.append(preference_losses(*logps, settings)["losses"])
    assert loss.item() == pytest.approx(float(torch.cat(per_pair).mean()), abs=1e-5)
    assert set(objective.metrics("cpu")) == set(REWARDS)


def test_at_the_start_the_policy_is_its_reference_for_both_kinds_of_reference():
    """DPO starts at log 2 with every reward 0: the LoRA adapter starts as a no-op, and a frozen copy is the
    policy itself."""
    from peft import LoraConfig, get_peft_model
    base = tiny_model()
    copy_reference = copy.deepcopy(base)
    lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    settings = PreferenceConfig(beta=0.1)
    engine = Engine(lora)
    for reference in (adapter_disabled(engine),
                      lambda ids, mask: copy_reference(input_ids=ids, attention_mask=mask).logits):
        objective = PreferenceObjective(engine, reference, settings)
        assert objective(pair_batch()).item() == pytest.approx(math.log(2), abs=1e-6)
        rewards = objective.metrics("cpu")
        assert rewards["rewards/chosen"] == pytest.approx(0, abs=1e-6) and rewards["rewards/accuracy"] == 0
    # once the adapter has moved, the adapter-disabled reference still is the base model
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.add_(0.5)
    batch = pair_batch()
    ids, mask = batch["input_ids"].flatten(0, 1), batch["attention_mask"].flatten(0, 1)
    expected = copy_reference(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(adapter_disabled(engine)(ids, mask), expected, atol=1e-6)
    assert not torch.allclose(lora(input_ids=ids, attention_mask=mask).logits, expected, atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("settings", [PreferenceConfig(beta=0.3), PreferenceConfig(loss="ipo", beta=0.4)],
                         ids=["sigmoid", "ipo"])
def test_the_loss_and_rewards_equal_trls_dpo_trainer_on_the_same_batch(settings):
    """TRL (a test-only dependency; skipped where it is not installed) computes its DPO loss inside
    DPOTrainer._compute_loss from the policy's outputs and precomputed reference log-probs: it is called here on the
    same tiny model and batch (TRL's layout: every chosen row, then every rejected row). TRL 1.x has no label
    smoothing in its sigmoid loss (it moved to its 'robust' loss), so that is compared with the formula above."""
    trl = pytest.importorskip("trl")
    from collections import defaultdict
    from trl import DPOTrainer
    # in float64: the two sides sum the same log-probs in other orders (TRL's rows are concatenated), which in
    # float32 differs by ~1e-6 from machine to machine (IPO squares it); in float64 they agree to ~1e-12
    policy, reference = tiny_model().double(), tiny_model().double()
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.05 * torch.randn(p.shape).to(p.dtype))
    batch = pair_batch()
    objective = PreferenceObjective(Engine(policy),
                                    lambda ids, mask: reference(input_ids=ids, attention_mask=mask).logits, settings)
    ours = objective(batch).item()
    rewards = objective.metrics("cpu")

    trl_order = {key: torch.cat([batch[key][:, 0], batch[key][:, 1]]) for key in batch}  # chosen rows, rejected rows
    with torch.no_grad():
        ref = sequence_logps(reference(input_ids=trl_order["input_ids"],
                                       attention_mask=trl_order["attention_mask"]).logits, trl_order["labels"])[0]
    identity = types.SimpleNamespace(device="cpu", gather_for_metrics=lambda t: t, gather=lambda t: t)
    trainer = types.SimpleNamespace(
        model=policy, accelerator=identity, aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
        f_divergence_type="reverse_kl", loss_types=[settings.loss], loss_weights=[1.0], beta=settings.beta,
        label_smoothing=0.0, use_weighting=False, _metrics=defaultdict(lambda: defaultdict(list)),
        _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": trl_order["input_ids"], "attention_mask": trl_order["attention_mask"],
              "completion_mask": (trl_order["labels"] != -100).long(),
              "ref_chosen_logps": ref[:3], "ref_rejected_logps": ref[3:]}
    with torch.no_grad():
        theirs = DPOTrainer._compute_loss(trainer, policy, inputs, return_outputs=False)
    assert ours == pytest.approx(float(theirs), abs=1e-9, rel=0), trl.__version__
    at_start = {"sigmoid": math.log(2), "ipo": 1 / (2 * settings.beta) ** 2}[settings.loss]
    assert abs(ours - at_start) > 1e-3  # the policy has moved away from its reference
    logged = trainer._metrics["eval"]
    for name in ("rewards/chosen", "rewards/rejected"):
        assert rewards[name] == pytest.approx(logged[name][-1], abs=1e-9)


def test_eval_metrics_are_kept_apart_from_the_training_window():
    policy = tiny_model()
    objective = PreferenceObjective(Engine(policy), lambda ids, mask: policy(input_ids=ids, attention_mask=mask).logits,
                                    PreferenceConfig())
    objective(pair_batch())
    with objective.apart():
        objective(pair_batch())
        objective(pair_batch(), record=False)  # a filler batch of an evaluation
        assert objective.meter.sums[-1] == 3
    assert objective.meter.sums[-1] == 3  # the training window's three pairs, untouched
    assert Objective(Engine(policy)).metrics("cpu") == {}
