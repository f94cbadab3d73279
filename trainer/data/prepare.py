"""Records -> eval split -> tokenized samples -> seq_len blocks, for both splits, with their stats."""
from __future__ import annotations

from dataclasses import dataclass, field

import datasets

from ..config import DataConfig
from .blocks import pack_pretrain, pack_sft
from .records import ORIGIN, DataError, load_records, split_records, visible_columns
from .tokenize import record_format, tokenize_records


@dataclass
class PreparedData:
    train: datasets.Dataset          # columns input_ids, labels, attention_mask: lists of seq_len ints
    eval: datasets.Dataset
    stats: dict = field(default_factory=dict)   # {"train": {...}, "eval": {...}}


def build_datasets(data_cfg: DataConfig, tokenizer, seed: int) -> PreparedData:
    """Tokenized, packed train and eval datasets plus their stats."""
    records = load_records(data_cfg.source, data_cfg.split)
    fmt = record_format(records, data_cfg, tokenizer, data_cfg.source)
    if data_cfg.eval_source:
        eval_records = load_records(data_cfg.eval_source, data_cfg.eval_split or data_cfg.split)
        if record_format(eval_records, data_cfg, tokenizer, data_cfg.eval_source) != fmt:
            raise DataError(f"{data_cfg.eval_source}: eval records have columns {visible_columns(eval_records)}, "
                            f"a different format from {data_cfg.source}'s {visible_columns(records)}; use one format")
        train_records = records
    else:
        train_records, eval_records = split_records(records, data_cfg.eval_fraction, seed, data_cfg.source)
    train, train_stats = _prepare_split(train_records, fmt, data_cfg, tokenizer, "train", data_cfg.source)
    eval_source = data_cfg.eval_source or data_cfg.source
    evaluation, eval_stats = _prepare_split(eval_records, fmt, data_cfg, tokenizer, "eval", eval_source)
    return PreparedData(train, evaluation, {"train": train_stats, "eval": eval_stats})


def _prepare_split(records: datasets.Dataset, fmt: str, data_cfg: DataConfig, tokenizer, name: str,
                   source: str) -> tuple[datasets.Dataset, dict]:
    samples = tokenize_records(records, fmt, data_cfg, tokenizer)
    if data_cfg.task == "pretrain":
        blocks, stats = pack_pretrain(samples, data_cfg.seq_len)
    else:
        blocks, stats = pack_sft(samples, data_cfg.seq_len, data_cfg.packing, tokenizer.pad_token_id)
    if len(blocks) == 0:
        raise DataError(f"{source}: the {name} split ({len(records)} records from {records[0][ORIGIN]} on) "
                        f"yields no full {data_cfg.seq_len}-token sequence; add data, lower data.seq_len, "
                        f"raise data.eval_fraction or set data.eval_source")
    return blocks, {"records": len(records), **stats}
