"""Samples of a prepared split, read on demand from the shards on disk.

  pretrain  sample i is tokens [i * seq_len, (i + 1) * seq_len) of the split's stream (every document + EOS,
            back to back); the model shifts labels itself, so labels are the same tensor as input_ids and
            no attention mask is needed (nothing is padded). The tail shorter than seq_len is not used.
            With data.cross_document_attention off, the documents of a window are isolated as packed SFT's are.
  sft       a sample is one document padded to seq_len, or with `packing` whole documents placed greedily in
            order into shared blocks (never split); labels are -100 where the loss mask is 0 and on padding.

Isolated documents (packed SFT; pretraining with data.cross_document_attention=false): position ids restart at each
document (and at the padding after the last one), no attention mask is passed, and each document's first label is
-100. transformers 5.24 then makes attention block-diagonal from the restarts alone: sdpa, eager and flex through the
4-D mask create_causal_mask builds from them (masking_utils.find_packed_sequence_indices, used only when the mask is
None), flash-attn through its varlen kernel (modeling_flash_attention_utils._is_packed_sequence, for one row: the
loss flattens a micro-batch into one row for it, train.sequence_parallel.one_row_for_flash). The -100 is the
prediction of a document's first token from the previous document's last one, which no document run alone makes: so
a packed micro-batch's loss is the token-weighted mean of its documents' own losses.

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
    def __init__(self, split: Split, seq_len: int, isolate_documents: bool = False):
        self.split, self.seq_len, self.isolate_documents = split, seq_len, isolate_documents

    def __len__(self) -> int:
        return self.split.total_tokens // self.seq_len

    def rows(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        tokens = np.stack([self.split.read(int(i) * self.seq_len, self.seq_len) for i in ids]).astype(np.int64)
        if not self.isolate_documents:
            return {"input_ids": tokens, "labels": tokens}
        starts = [self.window_document_starts(int(i)) for i in ids]
        return {"input_ids": tokens, "labels": first_labels_ignored(tokens, starts),
                "position_ids": restarting_positions(starts, self.seq_len)}

    def window_document_starts(self, index: int) -> np.ndarray:
        """Offsets in window `index` where a document begins (0 always: a window may open mid-document)."""
        begin = index * self.seq_len
        ends = self.split.doc_ends
        inside = ends[(ends > begin) & (ends < begin + self.seq_len)] - begin
        return np.concatenate([[0], inside]).astype(np.int64)

    def stats(self) -> dict:
        used = len(self) * self.seq_len
        return {"tokens": used, "sequences": len(self), "documents": self.split.documents,
                "dropped_tokens": self.split.total_tokens - used}


class SftSamples:
    def __init__(self, split: Split, seq_len: int, packing: bool, pad_id: int, isolate_documents: bool = True):
        self.split, self.seq_len, self.pad_id = split, seq_len, pad_id
        self.isolate_documents = packing and isolate_documents  # one document per block is isolated already
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
        if not self.isolate_documents:
            return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}
        starts = [self.block_document_starts(int(block)) for block in ids]
        return {"input_ids": input_ids, "labels": first_labels_ignored(labels, starts),
                "position_ids": restarting_positions(starts, self.seq_len)}

    def block_document_starts(self, block: int) -> np.ndarray:
        """Offsets in `block` where a document begins, and where its padding begins (its own segment)."""
        first, last = int(self.starts[block]), int(self.starts[block + 1])
        ends = self.split.doc_ends
        start = int(ends[first - 1]) if first else 0
        offsets = np.concatenate([[start], ends[first:last]]) - start
        return offsets[offsets < self.seq_len]  # a full block has no padding segment

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


def restarting_positions(starts: list[np.ndarray], seq_len: int) -> np.ndarray:
    """Position ids (rows, seq_len) that count from 0 again at each offset of a row's `starts` (which begin at 0)."""
    positions = np.tile(np.arange(seq_len, dtype=np.int64), (len(starts), 1))
    for row, offsets in enumerate(starts):
        lengths = np.diff(np.append(offsets, seq_len))
        positions[row] -= np.repeat(offsets, lengths)
    return positions


def first_labels_ignored(labels: np.ndarray, starts: list[np.ndarray]) -> np.ndarray:
    """`labels` with IGNORE_INDEX at each document's first token: nothing in its own document precedes it."""
    labels = labels.copy()
    for row, offsets in enumerate(starts):
        labels[row, offsets] = IGNORE_INDEX
    return labels


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
