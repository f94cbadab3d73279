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
from .build import PreparedData, build_datasets
from .loader import MicroBatchLoader, Source, Stream
from .records import IGNORE_INDEX, DataError, load_records, split_records
from .samples import PretrainSamples, SftSamples, block_starts
from .tokenize import apply_chat_template, chat_sample, load_tokenizer, record_format

__all__ = ["IGNORE_INDEX", "DataError", "MicroBatchLoader", "PreparedData", "PretrainSamples", "SftSamples",
           "Source", "Stream", "apply_chat_template", "block_starts", "build_datasets", "chat_sample",
           "load_records", "load_tokenizer", "record_format", "split_records"]
