"""Micro-batches by global sample index: the position is a number of samples, not a rank layout.

Optimizer step s consumes the global samples [S0 + s*G, S0 + (s+1)*G) of the stream, G = the global batch
(micro x accumulation x data-parallel size). Within a step, accumulation micro-step k of data-parallel rank r
takes the `micro` samples starting at S0 + s*G + (k*dp + r)*micro. The sample behind global index g is a pure
function of (seed, epoch, g) (`order.locate`, and `order.Mixture` for several sources), so a run saved after
S samples resumes at sample S on any number of ranks and any micro x accumulation split: O(1), no replay.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import order
from .records import DataError


@dataclass
class Source:
    """One dataset of a stream: its samples (PretrainSamples / SftSamples), its name for metrics, the source
    it was prepared from (for messages) and its weight in a mixture."""
    name: str
    samples: object
    origin: str = ""
    weight: float = 1.0


class Stream:
    """Global sample index -> rows: each epoch of a source visits its samples in the order drawn from
    (seed, source, epoch); several sources are interleaved by weight (`order.Mixture`)."""

    def __init__(self, sources: list[Source], seed: int, shuffle: bool = True):
        self.sources, self.seed, self.shuffle = sources, seed, shuffle
        self.mixture = (order.Mixture([s.weight for s in sources], [s.name for s in sources], seed)
                        if len(sources) > 1 else None)

    def __len__(self) -> int:
        """Samples in one pass over every source (the epoch length of a single source)."""
        return sum(len(s.samples) for s in self.sources)

    def sample_ids(self, global_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source index, sample index in that source) of each global index."""
        if self.mixture is None:
            which, within = np.zeros(len(global_ids), dtype=np.int64), global_ids
        else:
            which, within = self.mixture.locate(global_ids)
        samples = np.empty(len(global_ids), dtype=np.int64)
        for d, source in enumerate(self.sources):
            chosen = which == d
            if chosen.any():
                samples[chosen] = order.locate(within[chosen], len(source.samples), self.seed * 1000003 + d,
                                               self.shuffle)
        return which, samples

    def rows(self, global_ids: np.ndarray) -> dict[str, np.ndarray]:
        which, samples = self.sample_ids(global_ids)
        if len(self.sources) == 1:
            return self.sources[0].samples.rows(samples)
        parts = {d: self.sources[d].samples.rows(samples[which == d]) for d in np.unique(which).tolist()}
        out, taken = {}, {d: 0 for d in parts}
        for key in next(iter(parts.values())):
            first = parts[next(iter(parts))][key]
            out[key] = np.empty((len(global_ids),) + first.shape[1:], dtype=first.dtype)
        for row, d in enumerate(which.tolist()):
            for key in out:
                out[key][row] = parts[d][key][taken[d]]
            taken[d] += 1
        return out


class MicroBatchLoader:
    """This rank's micro-batches of a Stream, endless, from a resumable global sample position.

    One iterator at a time: iterating advances the loader's own position. Under tensor parallelism pass the
    data-parallel rank: a TP group then sees the same batch, as DeepSpeed requires."""

    def __init__(self, stream: Stream, micro_batch_size: int, dp_rank: int, dp_size: int, grad_accum: int = 1):
        if micro_batch_size < 1 or dp_size < 1 or grad_accum < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need micro_batch_size, dp_size, grad_accum >= 1 and 0 <= dp_rank < dp_size; got "
                             f"{micro_batch_size}, {dp_size}, {grad_accum}, {dp_rank}")
        self.stream, self.micro, self.dp_rank, self.dp_size, self.accum = (
            stream, micro_batch_size, dp_rank, dp_size, grad_accum)
        self.start, self.taken = 0, 0  # global sample position of the first step; micro-batches taken since
        if len(stream) == 0:
            raise DataError("the data has no sample of data.seq_len tokens; add data or lower data.seq_len")

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.dp_size

    @property
    def samples(self) -> int:
        """Global samples consumed by the optimizer steps completed so far."""
        return self.start + (self.taken // self.accum) * self.global_batch

    def batches_per_epoch(self) -> int:
        """This rank's micro-batches in one pass over the stream (what one evaluation can read)."""
        return len(self.stream) // (self.micro * self.dp_size)

    def state_dict(self) -> dict:
        return {"samples": self.samples}

    def load_state_dict(self, state: dict) -> None:
        if "samples" not in state:
            raise DataError(f"saved data position {state} is from the pre-shard loader (epoch/batch, tied to the "
                            f"old in-memory data): it cannot be placed in the prepared data; start this run "
                            f"fresh (--resume off) or resume it with the trainer version that saved it")
        samples = int(state["samples"])
        if samples < 0:
            raise DataError(f"saved data position {state} is negative")
        self.start, self.taken = samples, 0

    def global_ids(self, taken: int) -> np.ndarray:
        step, k = divmod(taken, self.accum)
        first = self.start + step * self.global_batch + (k * self.dp_size + self.dp_rank) * self.micro
        return np.arange(first, first + self.micro, dtype=np.int64)

    def __iter__(self):
        while True:
            rows = self.stream.rows(self.global_ids(self.taken))
            self.taken += 1
            yield {key: torch.from_numpy(value) for key, value in rows.items()}
