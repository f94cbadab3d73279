""""auto" filled the way the HF Trainer fills it, from the trainer's `train` and `model` sections.

DeepSpeed itself would silently turn a leftover "auto" into a default; here every one is filled or named.
"""
from __future__ import annotations

import copy
from typing import Any

from ..config import AUTO, Config
from .batch import Batch


def fill_auto(cfg: Config, batch: Batch, problems: list[str]) -> dict:
    """A copy of cfg.deepspeed with every "auto" filled (HF Trainer semantics) and no "auto" left."""
    ds = copy.deepcopy(cfg.deepspeed)
    train, hidden = cfg.train, cfg.model.hidden_size
    ds["train_micro_batch_size_per_gpu"] = batch.micro_batch_size
    ds["gradient_accumulation_steps"] = batch.grad_accum
    ds["train_batch_size"] = batch.deepspeed_train_batch_size
    _fill(ds, "gradient_clipping", train.grad_clip, problems)
    for block, enabled in (("bf16", train.precision == "bf16"), ("fp16", train.precision == "fp16")):
        if block in ds:
            _fill(ds[block], "enabled", enabled, problems, f"{block}.")
    if train.precision != "fp32" and "enabled" not in (ds.get(train.precision) or {}):
        problems.append(f"train.precision={train.precision} but deepspeed has no '{train.precision}.enabled', so "
                        f"DeepSpeed would silently train in fp32: add deepspeed.{train.precision}: {{enabled: auto}}"
                        + (" with the loss-scaling keys (as in preset 7b_2xv100)" if train.precision == "fp16" else "")
                        + " or set train.precision=fp32")
    opt = (ds.get("optimizer") or {}).get("params")
    if isinstance(opt, dict):
        for key, value in (("lr", train.lr), ("betas", list(train.betas)), ("eps", train.eps),
                           ("weight_decay", train.weight_decay)):
            _fill(opt, key, value, problems, "optimizer.params.")
    sched = (ds.get("scheduler") or {}).get("params")
    if isinstance(sched, dict):
        _linear_warmup(sched, ds["scheduler"].get("type"))
        offset = warmup_offset(train.warmup_steps)
        for key, value in (("warmup_max_lr", train.lr), ("warmup_num_steps", train.warmup_steps + offset),
                           ("total_num_steps", train.max_steps + offset),
                           ("cos_min_ratio", train.min_lr / train.lr if train.lr else 0.0)):
            _fill(sched, key, value, problems, "scheduler.params.")
        for key in ("warmup_min_lr", "warmup_min_ratio"):  # no trainer counterpart: 'auto' means start at 0
            _fill(sched, key, 0.0, problems, "scheduler.params.", mirrors_trainer=False)
    z = ds.get("zero_optimization")
    if isinstance(z, dict):
        for key, value in (("reduce_bucket_size", hidden * hidden),
                           ("stage3_prefetch_bucket_size", int(0.9 * hidden * hidden)),
                           ("stage3_param_persistence_threshold", 10 * hidden)):
            _fill(z, key, value, problems, "zero_optimization.", mirrors_trainer=False)
    for path in find_auto(ds):
        problems.append(f"deepspeed.{path}: 'auto' has no rule to fill it; give a value "
                        f"(DeepSpeed would silently use its default)")
    return ds


# DeepSpeed 0.19.8's warmup schedulers (runtime/lr_schedules.py: WarmupLR, WarmupDecayLR, WarmupCosineLR) default to a
# log-shaped warmup, refuse warmup_num_steps 0 and warm up over at least 2 steps (max(2, warmup_num_steps)); the
# scheduler starts "not started" (iteration -1, lr = warmup_min_lr), so its first two steps apply the minimum lr.
# The trainer's warmup is the HF Trainer's linear one (transformers.get_linear_schedule_with_warmup): step k applies
# lr * (k - 1) / warmup_steps until warmup_steps, then the schedule's decay; warmup_steps=0 trains at full lr from
# step 1. So: warmup_type linear, and the scheduler starts at iteration `warmup_offset` (0, or 2 - warmup_steps
# below 2, its warmup_num_steps and total_num_steps moved by as much) before the first step (trainer/train/run.py).
WARMUP_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR")


def _linear_warmup(params: dict, scheduler: str) -> None:
    if scheduler in WARMUP_SCHEDULERS and params.get("warmup_type", AUTO) == AUTO:
        params["warmup_type"] = "linear"


def warmup_offset(warmup_steps: int) -> int:
    """How far DeepSpeed's warmup schedulers start into their schedule: their shortest warmup is 2 steps."""
    return max(0, 2 - warmup_steps)


def scheduler_start(ds: dict, warmup_steps: int) -> int | None:
    """The iteration a DeepSpeed warmup scheduler is set to before the first step (None: another scheduler, left as
    DeepSpeed starts it)."""
    return warmup_offset(warmup_steps) if (ds.get("scheduler") or {}).get("type") in WARMUP_SCHEDULERS else None


def _fill(block: dict, key: str, value, problems: list[str], prefix: str = "", mirrors_trainer: bool = True) -> None:
    """Fill block[key] when it is "auto". When the key mirrors a trainer setting (lr, clipping, ...) an
    explicit value that disagrees is an error, as in the HF Trainer: two sources of truth must agree."""
    if key not in block:
        return
    if block[key] == AUTO:
        block[key] = value
    elif mirrors_trainer and _differs(block[key], value):
        problems.append(f"deepspeed.{prefix}{key}={block[key]!r} disagrees with the trainer's value {value!r}; "
                        f"use 'auto' (filled from the train/model sections) or make them equal")


def _differs(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a != b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(a - b) > 1e-12 * max(abs(a), abs(b), 1)
    return a != b


def find_auto(node: Any, path: str = "") -> list[str]:
    """Dotted paths of every "auto" left in a nested config."""
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in find_auto(v, f"{path}.{k}" if path else str(k))]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in find_auto(v, f"{path}[{i}]")]
    return [path] if node == AUTO else []
