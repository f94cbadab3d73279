"""Samples of a prepared split, read on demand from the shards on disk.

  pretrain  sample i is tokens [i * seq_len, (i + 1) * seq_len) of the split's stream (every document + EOS,
            back to back); the model shifts labels itself, so labels are the same tensor as input_ids and
            no attention mask is needed (nothing is padded). The tail shorter than seq_len is not used.
  sft       a sample is one document padded to seq_len, or with `packing` whole documents placed greedily in
            order into shared blocks (never split); labels are -100 where the loss mask is 0 and on padding.

  preference  a sample is one pair: its chosen and rejected documents (stored one after the other), each padded
            to seq_len, as rows of shape (2, seq_len) (the loss, trainer/train/preference.py, runs them as one batch).

Only small per-document arrays (lengths, block starts) live in memory; tokens stay on disk until a batch
reads them.
"""
from __future__ import annotations

import numpy as np

from .records import IGNORE_INDEX
from .shards import Split


class PretrainSamples:
    def __init__(self, split: Split, seq_len: int):
        self.split, self.seq_len = split, seq_len

    def __len__(self) -> int:
        return self.split.total_tokens // self.seq_len

    def rows(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        tokens = np.stack([self.split.read(int(i) * self.seq_len, self.seq_len) for i in ids]).astype(np.int64)
        return {"input_ids": tokens, "labels": tokens}

    def stats(self) -> dict:
        used = len(self) * self.seq_len
        return {"tokens": used, "sequences": len(self), "documents": self.split.documents,
                "dropped_tokens": self.split.total_tokens - used}


class SftSamples:
    def __init__(self, split: Split, seq_len: int, packing: bool, pad_id: int):
        self.split, self.seq_len, self.pad_id = split, seq_len, pad_id
        self.starts = block_starts(split.doc_lengths(), seq_len, packing)  # first document of each block

    def __len__(self) -> int:
        return len(self.starts) - 1

    def rows(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        n = len(ids)
        input_ids = np.full((n, self.seq_len), self.pad_id, dtype=np.int64)
        labels = np.full((n, self.seq_len), IGNORE_INDEX, dtype=np.int64)
        mask = np.zeros((n, self.seq_len), dtype=np.int64)
        ends = self.split.doc_ends
        for row, block in enumerate(ids):
            first, last = int(self.starts[block]), int(self.starts[block + 1])  # documents [first, last)
            start = int(ends[first - 1]) if first else 0
            length = int(ends[last - 1]) - start
            tokens = self.split.read(start, length).astype(np.int64)
            learnt = self.split.read(start, length, labels=True).astype(bool)
            input_ids[row, :length] = tokens
            labels[row, :length] = np.where(learnt, tokens, IGNORE_INDEX)
            mask[row, :length] = 1
        return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}

    def stats(self) -> dict:
        tokens, capacity = self.split.total_tokens, len(self) * self.seq_len
        return {"tokens": tokens, "sequences": len(self), "documents": self.split.documents,
                "padded_tokens": capacity - tokens, "packing_efficiency": tokens / capacity if capacity else 0.0}


class PreferenceSamples:
    """Pair i is documents 2i (chosen) and 2i + 1 (rejected); never packed: the loss sums each sequence."""

    def __init__(self, split: Split, seq_len: int, pad_id: int):
        self.split, self.seq_len, self.pad_id = split, seq_len, pad_id
        self.reference = None  # (pairs, 2) precomputed reference log-probs (train/reference_logps.py), if any

    def __len__(self) -> int:
        return self.split.documents // 2

    def rows(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        shape = (len(ids), 2, self.seq_len)
        input_ids = np.full(shape, self.pad_id, dtype=np.int64)
        labels = np.full(shape, IGNORE_INDEX, dtype=np.int64)
        mask = np.zeros(shape, dtype=np.int64)
        ends = self.split.doc_ends
        for row, pair in enumerate(ids):
            for side, document in enumerate((2 * int(pair), 2 * int(pair) + 1)):
                start = int(ends[document - 1]) if document else 0
                length = int(ends[document]) - start
                tokens = self.split.read(start, length).astype(np.int64)
                learnt = self.split.read(start, length, labels=True).astype(bool)
                input_ids[row, side, :length] = tokens
                labels[row, side, :length] = np.where(learnt, tokens, IGNORE_INDEX)
                mask[row, side, :length] = 1
        rows = {"input_ids": input_ids, "labels": labels, "attention_mask": mask}
        if self.reference is not None:
            rows["reference_logps"] = self.reference[np.asarray(ids, dtype=np.int64)]
        return rows

    def stats(self) -> dict:
        tokens, capacity = self.split.total_tokens, 2 * len(self) * self.seq_len
        return {"tokens": tokens, "pairs": len(self), "documents": self.split.documents,
                "padded_tokens": capacity - tokens}


def block_starts(lengths: np.ndarray, seq_len: int, packing: bool) -> np.ndarray:
    """Index of the first document of each block, plus the document count at the end (so block b holds
    documents [starts[b], starts[b + 1])): one document per block, or greedy in order (next fit) with packing."""
    if not packing:
        return np.arange(len(lengths) + 1, dtype=np.int64)
    starts, used = [0], 0
    for i, length in enumerate(lengths.tolist()):
        if used and used + length > seq_len:
            starts.append(i)
            used = 0
        used += length
    starts.append(len(lengths))
    return np.asarray(starts if len(lengths) else [0], dtype=np.int64)
