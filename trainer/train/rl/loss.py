"""Group-normalised advantages and the clipped policy-gradient loss of GRPO, as TRL 1.13's GRPOTrainer computes them
(`_generate_and_score_completions` and `_compute_loss`, token-level importance sampling, no entropy mask or bonus);
tests/test_grpo_loss.py checks the equality in float64 for every loss type.

    rewards     = sum_f weight_f x reward_f                          (per completion)
    advantage   = rewards - mean(group)   [ / (std(group or step) + 1e-4) unless scale_rewards=none ]
    ratio       = exp(logp - logp_old)    (logp_old = logp.detach() with one iteration per rollout batch)
    per token   = -min(ratio x A, clip(ratio, 1 - eps_low, 1 + eps_high) x A) + beta x KL
    KL          = exp(ref - logp) - (ref - logp) - 1                 (the k3 estimator, per token)
    grpo        : mean over sequences of (sum over the sequence's tokens / its length)
    bnpo        : sum over the micro-batch's tokens / their count
    dr_grpo     : sum over the micro-batch's tokens / (sequences x max_new_tokens)
    dapo        : sum over the micro-batch's tokens / (tokens of the whole step on every rank / ranks)

TRL divides grpo/bnpo/dr_grpo by the gradient-accumulation steps itself; DeepSpeed's engine.backward does here, so
`grpo_loss` returns TRL's value times `accumulation` for those (and for dapo, whose normaliser spans the step, the
same factor undoes DeepSpeed's division): the gradient of an optimizer step is TRL's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

EPS_STD = 1e-4  # TRL's


def nanstd(tensor: torch.Tensor, dim=None) -> torch.Tensor:
    """TRL's nanstd (Bessel-corrected), written out so the float64 comparison is exact."""
    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True)
    variance = variance * (count / (count - 1))
    out = torch.sqrt(variance)
    return out.squeeze(dim) if dim is not None else out.squeeze()


def weighted_rewards(per_function: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(completions,) the weighted sum of each completion's rewards ((completions, functions) in)."""
    return (per_function * weights.to(per_function).unsqueeze(0)).nansum(dim=1)


def group_advantages(rewards: torch.Tensor, group: int, scale: str, batch_std: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """Each completion's reward minus its group's mean (groups are `group` consecutive completions), divided by the
    group's std (scale=group), the step's (scale=batch: `batch_std`, taken over every rank's rewards) or nothing."""
    mean = torch.nanmean(rewards.view(-1, group), dim=1).repeat_interleave(group, dim=0)
    advantages = rewards - mean
    if scale == "group":
        std = nanstd(rewards.view(-1, group), dim=1).repeat_interleave(group, dim=0)
    elif scale == "batch":
        std = (batch_std if batch_std is not None else nanstd(rewards)).expand_as(rewards)
    else:
        return advantages
    return advantages / (std + EPS_STD)


def completion_logps(logits: torch.Tensor, input_ids: torch.Tensor, width: int, temperature: float,
                     entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(per-token log-probs of the last `width` tokens of `input_ids`, their entropies) from the logits of the whole
    sequences; the logits are divided by the sampling temperature first, as TRL does."""
    logits = logits[:, :-1, :][:, -width:, :]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    tokens = input_ids[:, -width:]
    picked = torch.gather(logits, dim=-1, index=tokens.unsqueeze(-1)).squeeze(-1)
    logps = picked - torch.stack([torch.logsumexp(rows, dim=-1) for rows in logits])
    entropies = None
    if entropy:
        with torch.no_grad():
            all_logps = torch.log_softmax(logits, dim=-1)
            entropies = -(all_logps.exp() * all_logps).sum(-1)
    return logps, entropies


@dataclass
class LossSettings:
    beta: float
    epsilon_low: float
    epsilon_high: float
    loss_type: str
    max_new_tokens: int


def grpo_loss(logps: torch.Tensor, old_logps: torch.Tensor | None, ref_logps: torch.Tensor | None,
              advantages: torch.Tensor, mask: torch.Tensor, s: LossSettings, accumulation: int = 1,
              step_tokens: float | None = None, ranks: int = 1) -> tuple[torch.Tensor, dict]:
    """The micro-batch's loss (see the module's docstring) and its statistics as tensors: `kl` (per token, summed
    over completion tokens), `low`/`high`/`region` clipped tokens, `tokens`. `step_tokens`: the completion tokens of
    the whole optimizer step across every rank (dapo)."""
    mask = mask.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    ratio = torch.exp(logps - old)
    clipped = torch.clamp(ratio, 1 - s.epsilon_low, 1 + s.epsilon_high)
    per_token = -torch.min(ratio * advantages, clipped * advantages)
    stats = {}
    if s.beta != 0.0:
        delta = ref_logps - logps
        kl = torch.exp(delta) - delta - 1
        per_token = per_token + s.beta * kl
        stats["kl"] = (kl.detach() * mask).sum()
    if s.loss_type == "grpo":
        loss = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
    elif s.loss_type == "bnpo":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
    elif s.loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (per_token.size(0) * s.max_new_tokens) / accumulation
    elif s.loss_type == "dapo":
        total = mask.sum() * ranks * accumulation if step_tokens is None else torch.as_tensor(step_tokens)
        loss = (per_token * mask).sum() / (total.to(logps.dtype).clamp(min=1.0) / ranks)
    else:
        raise ValueError(f"unknown grpo.loss_type {s.loss_type!r}")
    with torch.no_grad():
        low = ((ratio < 1 - s.epsilon_low) & (advantages < 0)).to(mask.dtype)
        high = ((ratio > 1 + s.epsilon_high) & (advantages > 0)).to(mask.dtype)
        stats.update(low=(low * mask).sum(), high=(high * mask).sum(),
                     region=(((low + high) > 0).to(mask.dtype) * mask).sum(), tokens=mask.sum())
    return loss * accumulation, stats
