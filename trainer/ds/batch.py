"""The batch triad: micro-batch x accumulation x data-parallel size = global batch, solved in one place.

`solve_batch` reads the trainer's `train` section and DeepSpeed's three batch keys; `accumulation` is the
arithmetic the planner and the doctor use for a proposal.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .. import numbers
from ..config import AUTO, Config
from .keys import autotp_size, sequence_parallel_size


@dataclass(frozen=True)
class Batch:
    micro_batch_size: int
    grad_accum: int
    global_batch_size: int   # sequences per optimizer step = micro x accum x data-parallel size
    world_size: int
    data_parallel_size: int  # world / autotp_size / sequence_parallel_size
    sequence_parallel_size: int = 1  # ranks sharing one sequence (Ulysses): they consume one sample together

    @property
    def deepspeed_train_batch_size(self) -> int:
        """DeepSpeed 0.19.8 checks its triad against the *global* world size under AutoTP, and against world /
        sequence_parallel_size under Ulysses (the mpu's data-parallel size)."""
        return self.micro_batch_size * self.grad_accum * self.world_size // self.sequence_parallel_size


def solve_batch(cfg: Config, world_size: int, problems: list[str]) -> Optional[Batch]:
    """Solve micro x accum x dp = global from any two of them (train section or DeepSpeed keys)."""
    ds, train = cfg.deepspeed, cfg.train
    tp_value = (ds.get("tensor_parallel") or {}).get("autotp_size", 0)
    if isinstance(tp_value, bool) or not isinstance(tp_value, int) or tp_value < 0:
        problems.append(f"deepspeed.tensor_parallel.autotp_size: {tp_value!r} must be a whole number of ranks "
                        f"(0 or 1 = no tensor parallelism; 'auto' has no rule to fill it)")
        return None
    tp = autotp_size(ds)
    if world_size % tp:
        problems.append(f"deepspeed.tensor_parallel.autotp_size={tp} must divide the world size {world_size}: "
                        f"choose a divisor of {world_size} (normally the GPUs per node)")
        return None
    sp = _sequence_parallel_size(ds, world_size, tp, problems)
    if sp is None:
        return None
    dp = world_size // tp // sp
    micro = _merge_batch_value(train.micro_batch_size, ds.get("train_micro_batch_size_per_gpu"),
                               "train.micro_batch_size", "train_micro_batch_size_per_gpu", problems)
    accum = _merge_batch_value(train.grad_accum, ds.get("gradient_accumulation_steps"),
                               "train.grad_accum", "gradient_accumulation_steps", problems)
    ds_global = ds.get("train_batch_size")
    ds_global_key = "train_batch_size"
    if isinstance(ds_global, (int, float)) and not isinstance(ds_global, bool) and tp > 1:
        if ds_global % tp:
            problems.append(f"deepspeed.train_batch_size={ds_global} must be a multiple of autotp_size {tp}: under "
                            f"AutoTP DeepSpeed counts every rank, train_batch_size = micro x accum x world size "
                            f"{world_size}")
            return None
        ds_global = ds_global // tp  # DeepSpeed's number counts TP replicas; ours counts distinct samples
        ds_global_key = "train_batch_size/autotp_size"
    total = _merge_batch_value(train.global_batch_size, ds_global,
                               "train.global_batch_size", ds_global_key, problems)
    if None in (micro, accum, total) and [micro, accum, total].count(None) >= 2:
        accum = accum or 1  # DeepSpeed's own rule when fewer than two are given
    if micro is None and total is None:
        micro = 1
    if total is None:
        total = micro * accum * dp
    elif micro is None or accum is None:
        given, given_key = (accum, "grad_accum") if micro is None else (micro, "micro_batch_size")
        per_step = given * dp
        if total % per_step:  # the solved value would be a fraction (or 0): say so rather than show it
            problems.append(
                f"batch triad: global_batch_size {total} is not a multiple of {given_key} {given} x data-parallel "
                f"size {dp} = {per_step} ({_layout(world_size, tp, sp)}), so "
                f"{'micro_batch_size' if micro is None else 'grad_accum'} cannot be solved: use a global_batch_size "
                f"of {max(per_step, total // per_step * per_step)}, or another {given_key}")
            return None
        micro, accum = (total // per_step, accum) if micro is None else (micro, total // per_step)
    if min(micro, accum, total) < 1 or micro * accum * dp != total:
        problems.append(
            f"batch triad inconsistent: global_batch_size {total} != micro_batch_size {micro} x grad_accum {accum} "
            f"x data-parallel size {dp} ({_layout(world_size, tp, sp)}); "
            f"give two of the three and the third is solved, or make them agree")
        return None
    return Batch(micro, accum, total, world_size, dp, sp)


def _sequence_parallel_size(ds: dict, world_size: int, tp: int, problems: list[str]) -> Optional[int]:
    """deepspeed.sequence_parallel_size checked for the layout: a whole number dividing the world, not with AutoTP
    (None, with the problem said, when it does not fit)."""
    value = ds.get("sequence_parallel_size", 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        problems.append(f"deepspeed.sequence_parallel_size: {value!r} must be a whole number of ranks >= 1 "
                        f"(1 = no sequence parallelism; 'auto' has no rule to fill it)")
        return None
    sp = sequence_parallel_size(ds)
    if sp > 1 and tp > 1:
        problems.append(f"deepspeed.sequence_parallel_size={sp} with deepspeed.tensor_parallel.autotp_size={tp}: "
                        f"DeepSpeed 0.19.8 builds either the Ulysses groups or the AutoTP mesh, not both; drop one "
                        f"(--set deepspeed.tensor_parallel=null, or deepspeed.sequence_parallel_size=1)")
        return None
    if world_size % sp:
        fits = [d for d in range(1, world_size + 1) if world_size % d == 0]
        problems.append(f"deepspeed.sequence_parallel_size={sp} must divide the world size {world_size} (each "
                        f"group of {sp} ranks shares one sequence): use one of {fits}")
        return None
    return sp


def _layout(world_size: int, tp: int, sp: int) -> str:
    return f"world size {world_size}, autotp_size {tp}" + (f", sequence_parallel_size {sp}" if sp > 1 else "")


def _merge_batch_value(train_value, ds_value, train_key: str, ds_key: str, problems: list[str]) -> Optional[int]:
    values = {}
    for key, value in ((train_key, train_value), (f"deepspeed.{ds_key}", ds_value)):
        if value is None or value == AUTO:
            continue
        if numbers.COUNT.problem(value):  # inf and nan too, not an OverflowError from int()
            problems.append(f"{key}: {value!r} must be a positive integer or 'auto'")
            continue
        values[key] = int(value)
    if len(set(values.values())) > 1:
        problems.append(f"{' and '.join(f'{k}={v}' for k, v in values.items())} disagree: set one, or make them equal")
    return next(iter(values.values()), None)


def accumulation(global_batch: int, micro_batch: int, data_parallel_size: int) -> Optional[int]:
    """The accumulation steps that make micro x accum x dp = global, or None when none does."""
    per_step = micro_batch * data_parallel_size
    if global_batch < per_step or global_batch % per_step:
        return None
    return global_batch // per_step
