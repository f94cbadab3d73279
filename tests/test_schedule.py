"""train.warmup_steps as users read it (issue 37, item 5): the HF Trainer's linear warmup, applied by DeepSpeed's own
scheduler classes with the parameters `resolve` fills and the start the trainer sets (trainer/ds/auto.py). The lr
each step applies is read before the step, as the loop logs it. The trained check (warmup_steps=0 trains from step
1, the logged lr) is in tests/test_chat_models.py."""
from __future__ import annotations

import pytest
import torch

from trainer import ds as dsc
from trainer.presets import load_preset
from trainer.resolve import resolve


def applied_lrs(preset: str, overrides: list[str]) -> list[float]:
    """The lr of each of the run's steps, through the DeepSpeed scheduler class the resolved config names."""
    from deepspeed.runtime import lr_schedules
    cfg = resolve(load_preset(preset, overrides), None).config
    scheduler_cfg = cfg.deepspeed["scheduler"]
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.train.lr)
    scheduler = getattr(lr_schedules, scheduler_cfg["type"])(optimizer, **scheduler_cfg["params"])
    scheduler.step(dsc.scheduler_start(cfg.deepspeed, cfg.train.warmup_steps))
    lrs = []
    for _ in range(cfg.train.max_steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def hf_lrs(lr: float, warmup: int, steps: int, kind: str = "linear") -> list[float]:
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    make = get_linear_schedule_with_warmup if kind == "linear" else get_cosine_schedule_with_warmup
    scheduler = make(optimizer, warmup, steps)
    lrs = []
    for _ in range(steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


@pytest.mark.slow
@pytest.mark.parametrize("warmup", [0, 2, 3, 20])
def test_tiny_cpu_applies_the_hf_trainers_linear_warmup_and_decay(warmup):
    lrs = applied_lrs("tiny_cpu", [f"train.warmup_steps={warmup}", "train.max_steps=40"])
    assert lrs == pytest.approx(hf_lrs(3e-3, warmup, 40), abs=1e-12)


@pytest.mark.slow
def test_no_warmup_trains_at_full_lr_from_step_one_and_the_last_step_still_trains():
    lrs = applied_lrs("tiny_cpu", ["train.warmup_steps=0", "train.max_steps=3"])
    assert lrs[0] == pytest.approx(3e-3) and all(lr > 0 for lr in lrs)


@pytest.mark.slow
def test_one_warmup_step_is_half_the_lr_then_the_hf_decay():
    """DeepSpeed warms up over at least 2 steps (max(2, warmup_num_steps)): step 1 applies half the lr (HF: 0)."""
    lrs = applied_lrs("tiny_cpu", ["train.warmup_steps=1", "train.max_steps=10"])
    assert lrs[0] == pytest.approx(1.5e-3) and lrs[1:] == pytest.approx(hf_lrs(3e-3, 1, 10)[1:], abs=1e-12)


@pytest.mark.slow
def test_the_cosine_preset_warms_up_linearly_as_the_hf_trainer_does():
    """The warmup is the HF Trainer's; the cosine after it is DeepSpeed's own (down to train.min_lr)."""
    lrs = applied_lrs("1b_pretrain_8xh100", ["train.warmup_steps=10", "train.max_steps=50"])
    assert lrs[:10] == pytest.approx(hf_lrs(3e-4, 10, 50, "cosine")[:10], abs=1e-12)
    assert 3e-4 >= lrs[10] and lrs[10:] == sorted(lrs[10:], reverse=True) and lrs[-1] == pytest.approx(3e-5)


def test_the_resolved_scheduler_says_linear_and_never_gives_deepspeed_a_zero_warmup():
    for warmup in (0, 1, 5):
        params = resolve(load_preset("tiny_cpu", [f"train.warmup_steps={warmup}"]), None).config.deepspeed[
            "scheduler"]["params"]
        assert params["warmup_type"] == "linear" and params["warmup_num_steps"] >= 2
    explicit = ["deepspeed.scheduler.params.warmup_type=log"]  # a user's own choice is kept
    assert resolve(load_preset("tiny_cpu", explicit), None).config.deepspeed["scheduler"]["params"][
        "warmup_type"] == "log"
