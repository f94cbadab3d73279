"""The data pipeline: load records, carve the eval split, tokenize, pack into seq_len blocks, batch.

    tokenizer = apply_chat_template(load_tokenizer(cfg.model), cfg.data)  # data.chat_template, if set
    data = build_datasets(cfg.data, tokenizer, seed=cfg.train.seed)     # PreparedData(train, eval, stats)
    loader = MicroBatchLoader(data.train, micro_batch_size, dp_rank, dp_size, seed)

One module per stage: `records` (files and hub datasets, the eval split) -> `tokenize` (formats, labels)
-> `blocks` (seq_len rows) -> `loader` (sharded, resumable micro-batches); `prepare` runs the first three
for both splits. Every problem with the data is a `DataError` naming the file and line (or row) and a fix.
"""
from .blocks import blocks_dataset, group_samples, pack_pretrain, pack_sft
from .loader import MicroBatchLoader
from .prepare import PreparedData, build_datasets
from .records import IGNORE_INDEX, DataError, load_records, split_records
from .tokenize import apply_chat_template, chat_sample, load_tokenizer, record_format, tokenize_records

__all__ = ["IGNORE_INDEX", "DataError", "MicroBatchLoader", "PreparedData", "apply_chat_template", "blocks_dataset",
           "build_datasets", "chat_sample", "group_samples", "load_records", "load_tokenizer", "pack_pretrain",
           "pack_sft", "record_format", "split_records", "tokenize_records"]
