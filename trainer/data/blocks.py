"""Blocks: samples cut or packed into seq_len rows (input_ids, labels, attention_mask).

Pretraining concatenates and cuts into full blocks; SFT pads each sample to seq_len, or with `packing`
whole samples share blocks (never split).
"""
from __future__ import annotations

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .records import IGNORE_INDEX
from .tokenize import column_values


def pack_pretrain(samples: datasets.Dataset, seq_len: int) -> tuple[datasets.Dataset, dict]:
    """Concatenate every sample and cut full seq_len blocks; the short remainder is dropped."""
    flat = pc.list_flatten(samples.with_format("arrow")[:]["input_ids"]).to_numpy().astype(np.int64)
    n_blocks = len(flat) // seq_len
    blocks = flat[:n_blocks * seq_len].reshape(n_blocks, seq_len)
    stats = _block_stats(n_blocks * seq_len, n_blocks, seq_len, label_tokens=n_blocks * seq_len,
                         dropped_tokens=len(flat) - n_blocks * seq_len)
    return blocks_dataset(blocks, blocks, np.ones_like(blocks)), stats


def pack_sft(samples: datasets.Dataset, seq_len: int, packing: bool, pad_id: int) -> tuple[datasets.Dataset, dict]:
    """Pad each sample to seq_len, or with packing place whole samples greedily into shared blocks."""
    ids, labels, cut = column_values(samples, "input_ids"), column_values(samples, "labels"), column_values(samples, "_cut")
    total_tokens = sum(len(x) for x in ids)
    # Truncation can cut away a whole response; such a sample would only add padding-like noise.
    keep = [i for i, lab in enumerate(labels) if any(x != IGNORE_INDEX for x in lab)]
    ids, labels = [ids[i] for i in keep], [labels[i] for i in keep]
    groups = group_samples([len(x) for x in ids], seq_len, packing)
    input_ids, block_labels, mask = _fill_blocks(ids, labels, groups, seq_len, pad_id)
    stats = _block_stats(int(mask.sum()), len(groups), seq_len,
                         label_tokens=int((block_labels != IGNORE_INDEX).sum()),
                         dropped_tokens=total_tokens - int(mask.sum()),
                         truncated_records=sum(1 for c in cut if c), dropped_records=len(cut) - len(keep))
    return blocks_dataset(input_ids, block_labels, mask), stats


def group_samples(lengths: list[int], seq_len: int, packing: bool) -> list[list[int]]:
    """Indices of the samples in each block: one per block, or greedy in order (next fit) with packing."""
    if not packing:
        return [[i] for i in range(len(lengths))]
    groups, current, used = [], [], 0
    for i, length in enumerate(lengths):
        if current and used + length > seq_len:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += length
    return groups + [current] if current else groups


def _fill_blocks(ids: list[list[int]], labels: list[list[int]], groups: list[list[int]], seq_len: int,
                 pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    input_ids = np.full((len(groups), seq_len), pad_id, dtype=np.int64)
    block_labels = np.full((len(groups), seq_len), IGNORE_INDEX, dtype=np.int64)
    mask = np.zeros((len(groups), seq_len), dtype=np.int64)
    for row, group in enumerate(groups):
        position = 0
        for i in group:
            end = position + len(ids[i])
            input_ids[row, position:end] = ids[i]
            block_labels[row, position:end] = labels[i]
            mask[row, position:end] = 1
            position = end
    return input_ids, block_labels, mask


def blocks_dataset(input_ids: np.ndarray, labels: np.ndarray, attention_mask: np.ndarray) -> datasets.Dataset:
    """A Dataset of [n, seq_len] int arrays, built through Arrow (no Python lists per token)."""
    n, seq_len = input_ids.shape
    offsets = pa.array(np.arange(0, (n + 1) * seq_len, seq_len, dtype=np.int32), pa.int32())

    def as_lists(array: np.ndarray) -> pa.Array:
        return pa.ListArray.from_arrays(offsets, pa.array(array.reshape(-1).astype(np.int64)))

    table = pa.table({"input_ids": as_lists(input_ids), "labels": as_lists(labels),
                      "attention_mask": as_lists(attention_mask)})
    return datasets.Dataset(datasets.table.InMemoryTable(table))


def _block_stats(tokens: int, sequences: int, seq_len: int, **extra: int) -> dict:
    capacity = sequences * seq_len
    return {"tokens": tokens, "sequences": sequences, "padded_tokens": capacity - tokens,
            "packing_efficiency": tokens / capacity if capacity else 0.0, **extra}
