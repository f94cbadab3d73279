"""Preference tuning's loss (data.task=preference): DPO (sigmoid, with cDPO label smoothing) or IPO, against a frozen
reference model, and the `rewards/*` metrics.

A micro-batch holds pairs as rows of shape (2, seq_len) (trainer/data/samples.py PreferenceSamples); both sequences of
every pair go through the policy as one batch, and through the reference without gradients. A sequence's log-prob is
the sum over its response tokens (labels != -100) of log p(token); with r = policy - reference log-prob:

    margin  = r_chosen - r_rejected
    sigmoid = -(1 - eps) log sigmoid(beta margin) - eps log sigmoid(-beta margin)      (DPO; eps = label_smoothing)
    ipo     = (margin' - 1 / (2 beta))^2, margin' on r / response tokens               (IPO, as TRL normalises it)
    rewards/chosen = beta r_chosen, rewards/rejected = beta r_rejected, rewards/margin = their difference,
    rewards/accuracy = share of pairs with rewards/chosen > rewards/rejected.

The reference is the LoRA base with the adapter disabled ('adapter': no second copy) or a second DeepSpeed engine
without optimizer ('engine'), chosen by preference.reference. Training and evaluation both call `Objective`: the loop
reads `objective(batch)` where SFT and pretraining read `engine(**batch).loss`.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import ds as dsc
from ..config import PreferenceConfig
from . import router
from .sequence_parallel import loss_of

IGNORE_INDEX = -100  # trainer.data.records.IGNORE_INDEX (not imported: the data package pulls in datasets)
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy")


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of log p(label) over each row's labelled tokens, their count); the model predicts token t + 1 at t."""
    labels = labels[:, 1:]
    learnt = labels != IGNORE_INDEX
    # at least fp32: bf16 log-probs summed over a response lose the few units of difference DPO learns from
    logps = torch.log_softmax(logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)
    token_logps = logps.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (token_logps * learnt).sum(-1), learnt.sum(-1)


def preference_losses(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
                      reference_rejected: torch.Tensor, settings: PreferenceConfig,
                      lengths: tuple[torch.Tensor, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Per-pair `losses` and rewards (`chosen`, `rejected`) from summed log-probs; `lengths`: the response tokens of
    the chosen and rejected sequences (IPO averages per token)."""
    chosen_ratio, rejected_ratio = policy_chosen - reference_chosen, policy_rejected - reference_rejected
    beta = settings.beta
    if settings.loss == "sigmoid":
        margin = chosen_ratio - rejected_ratio
        losses = (-F.logsigmoid(beta * margin) * (1 - settings.label_smoothing)
                  - F.logsigmoid(-beta * margin) * settings.label_smoothing)
    else:
        if lengths is None:
            raise ValueError("IPO needs the response lengths")
        margin = chosen_ratio / lengths[0].clamp(min=1) - rejected_ratio / lengths[1].clamp(min=1)
        losses = (margin - 1 / (2 * beta)) ** 2
    return {"losses": losses, "chosen": beta * chosen_ratio.detach(), "rejected": beta * rejected_ratio.detach()}


class RewardMeter:
    """The rewards of the pairs seen since the last `take`, averaged over every rank's pairs when taken."""

    def __init__(self):
        self.sums = torch.zeros(len(REWARDS) + 1, dtype=torch.float64)  # the four sums and the pair count

    def add(self, chosen: torch.Tensor, rejected: torch.Tensor) -> None:
        chosen, rejected = chosen.double().cpu(), rejected.double().cpu()
        self.sums += torch.stack([chosen.sum(), rejected.sum(), (chosen - rejected).sum(),
                                  (chosen > rejected).double().sum(), torch.tensor(float(len(chosen)))])

    def take(self, device, prefix: str = "") -> dict:
        """Every rank calls it at the same point (one all-reduce)."""
        sums = self.sums.to(device)
        if dist.is_initialized():
            dist.all_reduce(sums)
        self.sums = torch.zeros_like(self.sums)
        count = float(sums[-1])
        if count == 0:
            return {}
        return {prefix + name: float(value) / count for name, value in zip(REWARDS, sums[:-1].tolist())}


class Objective:
    """The training loss of a batch: the model's own (pretraining, SFT), with no metrics of its own."""

    def __init__(self, engine, logits_tiles: int = 0):
        self.engine, self.logits_tiles = engine, logits_tiles  # model.tiled_logits, resolved

    def __call__(self, batch: dict, record: bool = True) -> torch.Tensor:
        return loss_of(self.engine, batch, self.logits_tiles)  # the model's own; under SP, the group's

    def weight(self, batch: dict) -> torch.Tensor:
        """What the loss of a batch is a mean over, so eval batches of any size average exactly: predicted tokens."""
        return (batch["labels"][..., 1:] != -100).sum()  # the model shifts labels by one

    def metrics(self, device, prefix: str = "") -> dict:
        return {}

    @contextlib.contextmanager
    def apart(self) -> Iterator[None]:
        """Metrics recorded inside are kept apart from (and do not disturb) those recorded outside."""
        yield

    def state_dict(self) -> dict | None:
        """What this rank's objective needs in a checkpoint to continue exactly (GRPO: its sampler and rollout)."""
        return None

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`'s value on resume."""


class PreferenceObjective(Objective):
    """DPO / IPO over a batch of pairs, against `reference(input_ids, attention_mask) -> logits` (no gradients)."""

    def __init__(self, engine, reference: Callable, settings: PreferenceConfig):
        super().__init__(engine)
        self.reference, self.settings, self.meter = reference, settings, RewardMeter()

    def __call__(self, batch: dict, record: bool = True) -> torch.Tensor:
        ids, mask, labels = (batch[key].flatten(0, 1) for key in ("input_ids", "attention_mask", "labels"))
        policy, lengths = sequence_logps(self.engine(input_ids=ids, attention_mask=mask).logits, labels)
        if "reference_logps" in batch:  # precomputed before training (train/reference_logps.py)
            reference = batch["reference_logps"].to(policy.dtype).flatten()
        else:
            with torch.no_grad():
                reference, _ = sequence_logps(self.reference(ids, mask), labels)
        pairs = [logps.view(-1, 2) for logps in (policy, reference, lengths)]  # rows alternate chosen, rejected
        out = preference_losses(pairs[0][:, 0], pairs[0][:, 1], pairs[1][:, 0], pairs[1][:, 1], self.settings,
                                (pairs[2][:, 0], pairs[2][:, 1]))
        if record:
            self.meter.add(out["chosen"], out["rejected"])
        return out["losses"].mean()

    def weight(self, batch: dict) -> torch.Tensor:
        """The loss is a mean over pairs (batch rows are [pair, chosen/rejected, token])."""
        return torch.tensor(batch["input_ids"].shape[0])

    def metrics(self, device, prefix: str = "") -> dict:
        return self.meter.take(device, prefix)

    @contextlib.contextmanager
    def apart(self) -> Iterator[None]:
        kept, self.meter = self.meter, RewardMeter()
        try:
            yield
        finally:
            self.meter = kept


def make_objective(engine, cfg, reference_engine=None) -> Objective:
    """The run's objective: the model's loss, or the preference loss against the reference the config chose."""
    if cfg.data.task != "preference":
        return Objective(engine, cfg.model.tiled_logits or 0)
    if reference_kind(cfg) == "adapter":
        return PreferenceObjective(engine, adapter_disabled(engine), cfg.preference)
    if reference_kind(cfg) == "precomputed":  # the batches carry the reference log-probs
        return PreferenceObjective(engine, None, cfg.preference)
    return PreferenceObjective(engine, lambda ids, mask: reference_engine(input_ids=ids, attention_mask=mask).logits,
                               cfg.preference)


def reference_kind(cfg) -> str:
    """'adapter', 'engine' or 'precomputed' (preference.reference, with 'auto' decided; 'adapter' without LoRA, and
    the other settings' combinations, were refused when the config was resolved: rules.preference_settings)."""
    kind = cfg.preference.reference
    if kind == "auto":
        return "adapter" if cfg.model.lora.enabled else "engine"
    return kind


def reference_engine(cfg, rank: int):
    """The reference of a full fine-tune (preference.reference=engine): the model as training starts from it (the
    pretrained weights, or the same seeded init), without LoRA, frozen, in a DeepSpeed engine without optimizer
    (ZeRO-3 when training is ZeRO-3, optionally offloaded: trainer/ds frozen_reference_config). Not checkpointed:
    a resumed run builds it again from the same weights."""
    import deepspeed

    from ..model import build_model
    model_cfg = dataclasses.replace(cfg.model, gradient_checkpointing=False,
                                    lora=dataclasses.replace(cfg.model.lora, enabled=False))
    ds = dsc.frozen_reference_config(cfg.deepspeed, cfg.preference.reference_offload)
    model, hf_ds_config = build_model(dataclasses.replace(cfg, model=model_cfg, deepspeed=ds), rank)
    model.requires_grad_(False)
    engine, _, _, _ = deepspeed.initialize(model=model, config=ds)
    del hf_ds_config  # only needed while the model is built (as for the policy)
    engine.eval()
    return engine


def adapter_disabled(engine) -> Callable:
    """The reference of a LoRA run: the same engine with the adapter switched off (peft's disable_adapter)."""
    model = engine.module

    def reference(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        with model.disable_adapter(), router.uncounted():  # not training traffic for the router metrics
            return engine(input_ids=ids, attention_mask=mask).logits
    return reference
