"""The autotuner's search space cut to what the planner says fits: the ZeRO stages that fit the GPUs at
micro-batch 1, and the micro-batches (divisors of the per-rank share of the global batch, so every experiment
keeps the preset's global batch) that fit at one of them. Offload candidates are left out, with the reason:
DeepSpeed 0.19.8's autotuner replaces each experiment's ZeRO block (`{"stage": N}`), so an offload block never
reaches an experiment and a model that needs offload would only be measured out of memory."""
from __future__ import annotations

from dataclasses import dataclass, field

from .. import ds as dsc
from ..plan.estimate import CANDIDATES, MAX_MICRO_BATCH, estimate, inputs_for_resolved


# What the autotuner's experiments run with: DeepSpeed's defaults under `{"stage": N}` (runtime/zero/config.py).
DEFAULT_REDUCE_BUCKET = int(5e8)


@dataclass
class SearchSpace:
    stages: list[int]
    micro_batches: list[int]
    per_rank_batch: int                                   # global batch / data-parallel size
    left_out: list[str] = field(default_factory=list)     # one line per candidate the planner excluded, and why
    fits: dict[int, list[int]] = field(default_factory=dict)  # stage -> micro-batches that fit at it


def search_space(resolved) -> SearchSpace:
    inputs = inputs_for_resolved(resolved)
    checkpointing = resolved.config.model.gradient_checkpointing
    precision = dsc.precision(resolved.ds)
    per_rank = resolved.batch.global_batch_size // resolved.batch.data_parallel_size
    options = [m for m in range(1, min(per_rank, MAX_MICRO_BATCH) + 1) if per_rank % m == 0]
    space = SearchSpace([], [], per_rank)
    for candidate in CANDIDATES:
        if (candidate.offload_optimizer, candidate.offload_param) != ("none", "none"):
            space.left_out.append(f"{candidate.label}: not tunable (DeepSpeed's autotuner drops offload blocks from "
                                  f"its experiments)")
            continue
        shots = [estimate(inputs, candidate, m, checkpointing, reduce_bucket_size=DEFAULT_REDUCE_BUCKET,
                          precision=precision, overlap_comm=candidate.stage == 3) for m in options]
        fitting = [s.micro_batch for s in shots if s.fits]
        if not fitting:
            space.left_out.append(f"{candidate.label}: does not fit at micro-batch 1 ({shots[0].why_not()})")
            continue
        space.stages.append(candidate.stage)
        space.fits[candidate.stage] = fitting
    space.micro_batches = sorted({m for fitting in space.fits.values() for m in fitting})
    return space


def describe(space: SearchSpace) -> list[str]:
    lines = [f"ZeRO-{stage}: micro-batches {', '.join(map(str, space.fits[stage]))} fit (planner)"
             for stage in space.stages]
    return lines + [f"left out: {line}" for line in space.left_out]

