"""The interface for an external rollout engine (vLLM, SGLang, TensorRT-LLM on GPUs): not wired into the loop.

The trainer's own rollouts (rollout.py) generate with the model being trained, which is exact and needs nothing
else, but is slower than a serving engine on GPUs. An external engine replaces only the sampling: the loop still
scores the completions, computes advantages and the loss with the policy's own log-probs (train/rl/objective.py),
so TRL's equality and the resume guarantees are unchanged where the engine's sampling is reproducible.

    class RolloutEngine(Protocol):
        def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...
        def generate(self, prompt_ids: list[list[int]], n: int, params: SamplingSettings) -> list[list[int]]: ...

`push_weights(engine, rollout_engine)` hands the policy's full weights to the engine after each optimizer step
(under ZeRO-3 one parameter at a time through deepspeed.zero.GatheredParameters, so no rank holds the whole model
twice); `ExternalRollouts.complete` asks it for n completions per prompt and returns them in the trainer's
(completion ids, completion mask) form. Only rank 0 talks to the engine; the completions are broadcast.

Wiring (not done here): GrpoObjective.generate would call `ExternalRollouts.complete` instead of `rollout.sample`,
and the loop's `hooks.after_step` would call `push_weights`. tests/test_grpo_engine.py has a `gpu`-marked test of
this interface against vLLM when it is installed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Protocol

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class SamplingSettings:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    @classmethod
    def of(cls, grpo, seed: int = 0) -> "SamplingSettings":
        return cls(grpo.max_new_tokens, grpo.temperature, grpo.top_p, grpo.top_k, seed)


class RolloutEngine(Protocol):
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights (names as the HF model's state dict has them)."""

    def generate(self, prompt_ids: list[list[int]], n: int, params: SamplingSettings) -> list[list[int]]:
        """n completions per prompt, grouped by prompt (prompt 0's n first), each up to and including its stop
        token."""


def named_weights(engine) -> Iterator[tuple[str, torch.Tensor]]:
    """The policy's parameters by name, whole (ZeRO-3: gathered one at a time), on every rank."""
    module = engine.module
    for name, param in module.named_parameters():
        if hasattr(param, "ds_id"):
            import deepspeed
            with deepspeed.zero.GatheredParameters([param]):
                yield name, param.detach().clone()
        else:
            yield name, param.detach()


def push_weights(engine, rollout_engine: RolloutEngine | None) -> int:
    """Hand the policy's current weights to the rollout engine (rank 0 holds it; every rank takes part in the
    gathers). Returns the number of tensors pushed."""
    count = 0
    tensors = named_weights(engine)
    if rollout_engine is None:  # another rank's engine: take part in the gathers only
        for _ in tensors:
            count += 1
        return count

    def counted():
        nonlocal count
        for item in tensors:
            count += 1
            yield item
    rollout_engine.load_weights(counted())
    return count


class ExternalRollouts:
    """n completions per prompt from `rollout_engine` (on rank 0), in the trainer's padded form on every rank."""

    def __init__(self, rollout_engine: RolloutEngine | None, pad_id: int, device):
        self.engine, self.pad, self.device = rollout_engine, pad_id, device

    def complete(self, prompt_ids: list[list[int]], n: int, params: SamplingSettings
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.engine.generate(prompt_ids, n, params) if self.engine is not None else None
        if dist.is_initialized():
            box = [rows]
            dist.broadcast_object_list(box, src=0)
            rows = box[0]
        width = max(1, max(len(r) for r in rows))
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, :len(row)] = 1
        return ids.to(self.device), mask.to(self.device)
