"""Evaluation: mean token-level loss and perplexity over a fixed set of eval sequences.

The eval set is the first `train.eval_sequences` samples of each eval stream (streams are unshuffled, so
that is a fixed list of sequences), split over the data-parallel ranks in rounds of micro x dp. The set,
and so the loss, does not depend on the world size or the micro-batch: runs on 1 and 8 ranks report
comparable eval losses, and `python -m trainer evaluate` reproduces a run's own. Every rank runs the same
number of forwards (a rank past the end of the set runs a zero-weight batch), because under ZeRO-3 every
forward is a collective.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from .. import waits
from ..data import Stream
from .preference import Objective


@dataclass
class EvalSet:
    streams: dict[str, Stream]   # name -> eval stream (one per data source)
    sequences: int               # train.eval_sequences: the first N samples of each stream
    micro: int                   # sequences per forward per rank
    dp_rank: int
    dp_size: int

    def size(self, stream: Stream) -> int:
        return min(self.sequences, len(stream))

    def forwards(self) -> int:
        """Forwards per rank over the whole set (every rank runs the same number)."""
        per_round = self.micro * self.dp_size
        return sum(math.ceil(self.size(stream) / per_round) for stream in self.streams.values())

    def batches(self, stream: Stream) -> Iterator[tuple[dict, bool]]:
        """(batch, counts) for this rank; `counts` is False for a filler batch past the end of the set."""
        n, per_round = self.size(stream), self.micro * self.dp_size
        for first in range(0, n, per_round):
            start = first + self.dp_rank * self.micro
            ids = np.arange(start, min(start + self.micro, n), dtype=np.int64)
            counts = len(ids) > 0
            rows = stream.rows(ids if counts else np.zeros(1, dtype=np.int64))
            yield {key: torch.from_numpy(value) for key, value in rows.items()}, counts


@torch.no_grad()
def evaluate(forward: Callable[[dict, bool], torch.Tensor], eval_set: EvalSet, device,
             weight: Callable[[dict], torch.Tensor] = None) -> dict:
    """`eval_loss` (and `eval_ppl`) over every source's eval sequences, `eval_loss/<name>` per source when there
    are several, and `eval_tokens` (the predicted tokens scored). `forward(batch)` returns the batch's mean loss
    per unit of `weight(batch)`: predicted tokens by default, pairs for preference data, so the mean does not
    depend on how the set is cut into micro-batches. It is called on every rank the same number of times, with
    `counts` False for a filler batch (whose loss, and metrics, must not count)."""
    weight = weight or predicted_tokens
    sums = []
    for stream in eval_set.streams.values():
        total, count, tokens = (torch.zeros((), dtype=torch.float64) for _ in range(3))
        for batch, counts in eval_set.batches(stream):
            loss = forward({k: v.to(device) for k, v in batch.items()}, counts).double().cpu()
            if counts:
                units = weight(batch)
                total += loss * units
                count += units
                tokens += predicted_tokens(batch)
        sums += [total, count, tokens]
    triples = torch.stack(sums).to(device)
    if dist.is_initialized():
        dist.all_reduce(triples)
    triples = triples.view(-1, 3).cpu()
    overall = float(triples[:, 0].sum() / triples[:, 1].sum().clamp(min=1))
    copies = dist.get_world_size() // eval_set.dp_size if dist.is_initialized() else 1  # tensor-parallel peers
    out = {"eval_loss": overall, "eval_ppl": math.exp(min(overall, 50)),
           "eval_tokens": int(triples[:, 2].sum()) // copies}
    if len(eval_set.streams) > 1:
        out.update({f"eval_loss/{name}": float(total / max(float(count), 1.0))
                    for name, (total, count, _) in zip(eval_set.streams, triples)})
    return out


def predicted_tokens(batch: dict) -> torch.Tensor:
    return (batch["labels"][..., 1:] != -100).sum()  # the model shifts labels by one


def evaluate_engine(engine, eval_set: EvalSet, objective=None) -> dict:
    """`evaluate` on a DeepSpeed training engine, back in train mode afterwards. `objective`: the training loss
    (train/preference.py; default the model's own), whose metrics of the eval batches are reported as `eval_*`."""
    objective = objective or Objective(engine)
    engine.eval()
    try:
        if hasattr(objective, "evaluate"):  # GRPO: rewards of completions of the eval prompts (train/rl/objective.py)
            return objective.evaluate(eval_set)
        with objective.apart():  # the eval batches' metrics are not the training window's
            out = evaluate(lambda batch, counts: objective(batch, record=counts), eval_set, engine.device,
                           objective.weight)
            return {**out, **objective.metrics(engine.device, prefix="eval_")}
    finally:
        engine.train()


def first_evaluation(engine, eval_set: EvalSet, step: int, seconds_per_micro: float, rank: int,
                     objective=None) -> dict:
    """`evaluate_engine`, said out loud: the first eval of a run names what it runs and how long it should take (a
    forward is about a third of a training micro-step), and rank 0 reports it every 30 s while it runs."""
    forwards = eval_set.forwards()
    expected = forwards * seconds_per_micro / 3
    still = contextlib.nullcontext()
    if rank == 0:
        sequences = sum(eval_set.size(stream) for stream in eval_set.streams.values())
        print(f"eval at step {step}: the run's first, {sequences} sequence(s) from {len(eval_set.streams)} "
              f"source(s), {forwards} forward(s) per rank, ~{waits.duration(expected)}", flush=True)
        still = waits.during(lambda seconds: f"eval at step {step}: still running - {waits.duration(seconds)} so far, "
                                             f"~{waits.duration(expected)} expected")
    with still:
        return evaluate_engine(engine, eval_set, objective)
