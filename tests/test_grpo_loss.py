"""The GRPO loss equals TRL 1.13's on the same completions, rewards and weights (float64, every loss type).

TRL's own `GRPOTrainer._compute_loss` and `_get_per_token_logps_and_entropies` run on a stand-in trainer object that
holds only the attributes they read; the trainer's loss (train/rl/loss.py) runs on the same tiny Llama and inputs.
Advantages are compared with TRL's formula (its `_generate_and_score_completions` arithmetic, written out in TRL's
words below since that method also samples). Quick tier: no ranks, no engine.
"""
from __future__ import annotations

import functools
import types

import pytest
import torch

from trainer.train.rl import loss as grpo



@functools.cache
def trl_grpo():
    """TRL's GRPO module, imported by the first test that compares with it: at module level every test worker paid
    its import (~6 s of CPU) while collecting, whether or not it ran this file."""
    return pytest.importorskip("trl.trainer.grpo_trainer")


def trl_nanstd(*args, **kwargs):
    trl_grpo()
    from trl.trainer.utils import nanstd
    return nanstd(*args, **kwargs)

G, PROMPTS, PROMPT_LEN, WIDTH, VOCAB = 4, 3, 5, 7, 48


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="sdpa", use_cache=False)
    return LlamaForCausalLM(config).double().eval()


def batch(seed: int, old: bool, ref: bool):
    g = torch.Generator().manual_seed(seed)
    rows = G * PROMPTS
    prompt_ids = torch.randint(3, VOCAB, (rows, PROMPT_LEN), generator=g)
    prompt_mask = torch.ones(rows, PROMPT_LEN, dtype=torch.long)
    prompt_mask[::3, :2] = 0  # left padding
    completion_ids = torch.randint(3, VOCAB, (rows, WIDTH), generator=g)
    lengths = torch.randint(1, WIDTH + 1, (rows,), generator=g)
    completion_mask = (torch.arange(WIDTH).unsqueeze(0) < lengths.unsqueeze(1)).long()
    rewards_per_func = torch.randint(0, 2, (rows, 2), generator=g).double()
    rewards_per_func[:, 1] = torch.rand(rows, generator=g, dtype=torch.float64)
    out = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
           "completion_mask": completion_mask, "rewards_per_func": rewards_per_func,
           "num_items_in_batch": completion_mask.sum().double() * 2}  # as if another rank held as many tokens
    if old:
        out["old_per_token_logps"] = -torch.rand(rows, WIDTH, generator=g, dtype=torch.float64) * 3
    if ref:
        out["ref_per_token_logps"] = -torch.rand(rows, WIDTH, generator=g, dtype=torch.float64) * 3
    return out


def trl_advantages(rewards_per_func, weights, scale):
    """TRL 1.13 `_generate_and_score_completions`, multi_objective_aggregation=sum_then_normalize."""
    rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    if scale in ("group", "none"):
        std = trl_nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    else:
        std = trl_nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean
    return advantages / (std + 1e-4) if scale != "none" else advantages


class FakeAccelerator:
    num_processes = 2  # dapo divides the step's tokens by the ranks
    is_main_process = True

    def gather(self, x):
        return x

    gather_for_metrics = gather

    def reduce(self, x, reduction="sum"):
        return x


def trl_stand_in(loss_type, beta, temperature, eps_low, eps_high):
    from collections import defaultdict
    t = types.SimpleNamespace(
        model_kwarg_keys={"input_ids", "attention_mask"}, temperature=temperature, _entropy_bonus_enabled=False,
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=beta, loss_type=loss_type, epsilon_low=eps_low,
        epsilon_high=eps_high, use_vllm=False, vllm_importance_sampling_correction=False,
        model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1, max_completion_length=WIDTH,
        accelerator=FakeAccelerator(), _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1))
    cls = trl_grpo().GRPOTrainer
    t._get_per_token_logps_and_entropies = functools.partial(cls._get_per_token_logps_and_entropies, t)
    return t


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trl(scale):
    data = batch(1, False, False)
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    ours = grpo.group_advantages(grpo.weighted_rewards(data["rewards_per_func"], weights), G, scale)
    theirs = trl_advantages(data["rewards_per_func"], weights, scale)
    assert (ours - theirs).abs().max().item() <= 1e-12


CASES = [(loss_type, beta, old) for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo")
         for beta, old in ((0.0, False), (0.04, True))]


@pytest.mark.parametrize("loss_type,beta,old", CASES)
def test_loss_and_gradient_equal_trl(loss_type, beta, old):
    temperature, eps_low, eps_high = 0.7, 0.2, 0.28
    data = batch(2, old, beta != 0.0)
    weights = torch.tensor([1.0, 0.5], dtype=torch.float64)
    data["advantages"] = trl_advantages(data["rewards_per_func"], weights, "group")
    model = tiny_model()

    theirs_loss = trl_grpo().GRPOTrainer._compute_loss(trl_stand_in(loss_type, beta, temperature, eps_low, eps_high),
                                                     model, data)
    theirs_grad = torch.autograd.grad(theirs_loss, list(model.parameters()))

    ids = torch.cat([data["prompt_ids"], data["completion_ids"]], dim=1)
    mask = torch.cat([data["prompt_mask"], data["completion_mask"]], dim=1)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
    logps, _ = grpo.completion_logps(logits, ids, WIDTH, temperature)
    settings = grpo.LossSettings(beta, eps_low, eps_high, loss_type, WIDTH)
    ours_loss, stats = grpo.grpo_loss(logps, data.get("old_per_token_logps"), data.get("ref_per_token_logps"),
                                      data["advantages"], data["completion_mask"], settings, accumulation=1,
                                      step_tokens=float(data["num_items_in_batch"]), ranks=2)
    ours_grad = torch.autograd.grad(ours_loss, list(model.parameters()))

    assert abs(ours_loss.item() - theirs_loss.item()) <= 1e-9, (ours_loss.item(), theirs_loss.item())
    worst = max((a - b).abs().max().item() for a, b in zip(ours_grad, theirs_grad))
    assert worst <= 1e-9, worst
    assert ours_loss.item() != 0.0  # a comparison of two zeros would prove nothing


def test_accumulation_scales_back_what_deepspeed_divides():
    """DeepSpeed's engine.backward divides by the accumulation steps: grpo_loss returns TRL's per-micro-batch loss times
    them, so the step's gradient is TRL's (whose loss is already divided)."""
    logps = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    mask = torch.ones(1, 2)
    settings = grpo.LossSettings(0.0, 0.2, 0.2, "grpo", 2)
    one, _ = grpo.grpo_loss(logps, logps - 0.1, None, torch.tensor([1.0], dtype=torch.float64), mask, settings, 1)
    four, _ = grpo.grpo_loss(logps, logps - 0.1, None, torch.tensor([1.0], dtype=torch.float64), mask, settings, 4)
    assert four.item() == pytest.approx(one.item(), abs=1e-15)


def test_the_kv_cache_sampler_continues_left_padded_prompts_as_transformers_generate_does():
    from trainer.train.rl.rollout import sample
    model = tiny_model().float()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, VOCAB, (3, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2], ids[0, :2] = 0, 0
    ours, kept = sample(model, ids, mask, 5, [1], 0, temperature=0.0)
    theirs = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, eos_token_id=1,
                            pad_token_id=0, use_cache=True)[:, 6:]
    assert ours.tolist() == theirs.tolist()
    assert kept.tolist() == [[1] * 5] * 3


def test_sampling_is_reproducible_from_the_generator_state():
    from trainer.train.rl.rollout import sample
    model = tiny_model().float()
    ids, mask = torch.randint(3, VOCAB, (4, 5)), torch.ones(4, 5, dtype=torch.long)
    generator = torch.Generator().manual_seed(1)
    state = generator.get_state()
    first = sample(model, ids, mask, 6, [1], 0, temperature=1.0, top_k=10, top_p=0.9, generator=generator)[0]
    generator.set_state(state)
    again = sample(model, ids, mask, 6, [1], 0, temperature=1.0, top_k=10, top_p=0.9, generator=generator)[0]
    assert first.tolist() == again.tolist()
