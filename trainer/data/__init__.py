"""The data pipeline: tokenize once into token shards on disk, read them on demand, batch by global sample index.

    python -m trainer prepare-data --preset NAME                           # once (automatic for small local data)
    tokenizer = apply_chat_template(load_tokenizer(cfg.model), cfg.data)  # data.chat_template, if set
    data = build_datasets(cfg.data, tokenizer, seed)         # PreparedData(train stream, eval streams, stats)
    loader = MicroBatchLoader(data.train, micro, dp_rank, dp_size, grad_accum)

One module per stage: `records` (files and hub datasets, the eval split by document) -> `reading` (the same
records streamed in bounded chunks) -> `tokenize` (formats, labels, chat templates; `encode` runs it in the tokenizer
processes) -> `prepare` (token shards on disk, written as the chunks come; `shards` is their format; the cache is
keyed by the source's content, `fingerprint`) -> `verify` (the shards against their manifest, once per run) -> `samples` (seq_len
samples read from the shards with positional reads) -> `order` (which sample comes next: a pure function of seed,
epoch and the global sample index; mixtures) -> `loader` (this rank's micro-batches); `build` is what
training calls. Every problem with the data is a `DataError` naming the file and line (or row) and a fix.
"""
import importlib

RECORDS_PER_SHARD = 100_000  # about 100 M tokens of web text per shard; the unit a prepare-data rerun keeps

# Loaded on first use (PEP 562), so `prepare-data --help` and the light commands do not import datasets or torch.
_EXPORTS = {
    "PreparedData": "build", "build_datasets": "build",
    "MicroBatchLoader": "loader", "Source": "loader", "Stream": "loader",
    "IGNORE_INDEX": "records", "DataError": "records", "load_records": "records", "split_records": "records",
    "PreferenceSamples": "samples", "PretrainSamples": "samples", "SftSamples": "samples", "block_starts": "samples",
    "apply_chat_template": "tokenize", "chat_sample": "tokenize", "load_tokenizer": "tokenize",
    "record_format": "tokenize",
}

__all__ = sorted(_EXPORTS) + ["RECORDS_PER_SHARD"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
