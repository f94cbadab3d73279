"""train.epochs -> train.max_steps, from the prepared data's size: the one place every command that resolves a run
(`show`, `export`, `lint`, `launch`, the ranks' own start and an elastic resume's re-resolution) gets its length.

One epoch is one pass over the training stream: every source's train samples once (`Stream.__len__`: what the
loader counts, after packing into data.seq_len blocks). The steps are ceil(epochs x sequences / global batch), so
they follow the data and the global batch, not the world size: a resume on another topology keeps the checkpoint's
global batch (train/elastic.py) and so the same max_steps.
"""
from __future__ import annotations

import dataclasses
import json
import math

from ..config import Config
from ..resolve import Resolved, resolve

_SEQUENCES: dict[str, int] = {}  # a command resolves several times (blame, lint's, the doctor's): prepared once


def resolve_run(config: Config, world_size: int | None = None, source: str = "") -> Resolved:
    """`resolve`, with train.epochs turned into train.max_steps (and said in a notice)."""
    resolved = resolve(config, world_size, source)
    epochs = config.train.epochs
    if epochs is None:
        return resolved
    sequences = epoch_sequences(resolved.config)
    global_batch = resolved.batch.global_batch_size
    steps = max(1, math.ceil(epochs * sequences / global_batch))
    lengthened = dataclasses.replace(config, train=dataclasses.replace(config.train, max_steps=steps))
    resolved = resolve(lengthened, world_size, source)
    notice = (f"train.epochs={epochs:g}: {sequences:,} training sequences of {config.data.seq_len} tokens per epoch "
              f"/ global batch {global_batch} -> train.max_steps={steps}")
    return dataclasses.replace(resolved, notices=[notice, *resolved.notices])


def epoch_sequences(cfg: Config) -> int:
    """Training sequences in one epoch of the prepared data (prepared now when it is small and local, as the run
    would; otherwise the run's own error says to run prepare-data first)."""
    key = json.dumps([dataclasses.asdict(cfg.data), cfg.model.tokenizer, cfg.model.name_or_path,
                      cfg.model.trust_remote_code], sort_keys=True, default=str)
    if key not in _SEQUENCES:
        from .build import build_datasets
        from .tokenize import apply_chat_template, load_tokenizer
        tokenizer = apply_chat_template(load_tokenizer(cfg.model), cfg.data)
        _SEQUENCES[key] = len(build_datasets(cfg.data, tokenizer, cfg.train.seed).train)
    return _SEQUENCES[key]
