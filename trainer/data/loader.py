"""Micro-batches: endless, deterministic, sharded by data-parallel rank, with a resumable position."""
from __future__ import annotations

import datasets
import numpy as np
import torch

from .records import COLUMNS, DataError


class MicroBatchLoader:
    """Endless, deterministic, sharded micro-batches with a resumable position.

    Epoch e visits the sequences in the permutation drawn from (seed, e) (identity without shuffle),
    cut into micro-batches; data-parallel rank r takes micro-batches r, r + dp_size, ... . The tail
    that cannot give every rank a full micro-batch is dropped, so all ranks take the same number of
    steps. Under tensor parallelism pass the data-parallel rank: a TP group then sees the same batch.
    One iterator at a time: iterating advances this loader's own position.
    """

    def __init__(self, dataset: datasets.Dataset, micro_batch_size: int, dp_rank: int, dp_size: int,
                 seed: int, shuffle: bool = True):
        if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"need micro_batch_size >= 1 and 0 <= dp_rank < dp_size; got "
                             f"{micro_batch_size}, {dp_rank}, {dp_size}")
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.seed, self.shuffle = seed, shuffle
        self._rows = dataset.with_format("numpy", columns=list(COLUMNS))
        self.epoch, self.batches_in_epoch = 0, 0
        if self.batches_per_epoch() == 0:
            raise DataError(f"{len(dataset)} sequences cannot give each of {dp_size} data-parallel ranks one "
                            f"micro-batch of {micro_batch_size}; add data or lower micro_batch_size/seq_len")

    def batches_per_epoch(self) -> int:
        return len(self._rows) // self.micro_batch_size // self.dp_size

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batches_in_epoch": self.batches_in_epoch}

    def load_state_dict(self, state: dict) -> None:
        epoch, batch = int(state["epoch"]), int(state["batches_in_epoch"])
        if epoch < 0 or not 0 <= batch <= self.batches_per_epoch():
            raise DataError(f"saved data position {state} does not fit this loader ({self.batches_per_epoch()} "
                            f"batches per epoch); the data, micro_batch_size or data-parallel size changed")
        self._set_position(epoch, batch)

    def __iter__(self):
        while True:
            epoch, start = self.epoch, self.batches_in_epoch
            order = self._epoch_order(epoch)
            for batch in range(start, self.batches_per_epoch()):
                rows = self._rows[self._batch_indices(order, batch).tolist()]
                self._set_position(epoch, batch + 1)  # before yielding: state_dict names the *next* batch
                yield {name: torch.from_numpy(np.asarray(rows[name], dtype=np.int64)) for name in COLUMNS}

    def _set_position(self, epoch: int, batch: int) -> None:
        self.epoch, self.batches_in_epoch = (epoch + 1, 0) if batch == self.batches_per_epoch() else (epoch, batch)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self._rows))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self._rows))

    def _batch_indices(self, order: np.ndarray, batch: int) -> np.ndarray:
        first = (batch * self.dp_size + self.dp_rank) * self.micro_batch_size
        return order[first:first + self.micro_batch_size]
