"""What training reads: the prepared data of every source (prepared on first use when small and local, by rank 0
first), verified against its manifest and the run's tokenizer and task (trainer/data/verify.py), as train and eval
streams of samples. `build_datasets` is collective under a process group: every rank calls it, and a problem on any
rank is the same error on every rank."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..config import DataConfig
from ..distributed import rank0_first
from . import RECORDS_PER_SHARD, shards
from .loader import Source, Stream
from .prepare import cache_dir, cache_key, identity, is_prepared, needs_explicit_preparation, prepare_into_cache
from .records import DataError
from .samples import PreferenceSamples, PretrainSamples, SftSamples
from .verify import Checked, Prepared, verify_all


@dataclass
class PreparedData:
    train: Stream
    eval: list[Stream]                       # one per source, each evaluated on its own held-out documents
    stats: dict = field(default_factory=dict)  # {"train", "eval", "proportions" (mixtures), "verified"}: {...}


def sources_of(cfg: DataConfig) -> list[tuple[str, str, float]]:
    """(name, source, weight) of data.sources, or of the single data.source."""
    if cfg.sources:
        return [(s.shown_name(), s.path, s.weight) for s in cfg.sources]
    return [(Path(cfg.source).stem or cfg.source, cfg.source, 1.0)]


def build_datasets(cfg: DataConfig, tokenizer, seed: int) -> PreparedData:
    prepared = rank0_first(lambda: [ensure_prepared(cfg, source, tokenizer) for _, source, _ in sources_of(cfg)])
    checked, verified = verify_all(prepared, cfg, tokenizer)
    train_sources, eval_streams, stats = [], [], {"train": {}, "eval": {}}
    for (name, source, weight), found in zip(sources_of(cfg), checked):
        manifest = found.manifest
        train, evaluation = (checked_samples(found, split, cfg, tokenizer, source) for split in shards.SPLITS)
        train_sources.append(Source(name, train, source, weight))
        eval_streams.append(Stream([Source(name, evaluation, cfg.eval_source or source)], seed, shuffle=False))
        for split, samples in (("train", train), ("eval", evaluation)):
            entries = manifest["splits"][split]["shards"]
            counted = {key: sum(e.get(key, 0) for e in entries) for key in ("truncated_records", "dropped_records")}
            stats[split][name] = {"records": manifest["splits"][split]["records"], **samples.stats(),
                                  **({} if cfg.task == "pretrain" else counted)}
    if len(train_sources) == 1:  # one source: the stats as before, without a level of names
        stats = {split: next(iter(by_name.values())) for split, by_name in stats.items()}
    stream = Stream(train_sources, seed)
    if stream.mixture is not None:
        stats["proportions"] = stream.mixture.proportions(10_000)
    stats["verified"] = verified
    return PreparedData(stream, eval_streams, stats)


def ensure_prepared(cfg: DataConfig, source: str, tokenizer) -> Prepared:
    """Where `source`'s prepared data is: the source itself when it is a prepared directory, else its cache entry
    (prepared now when it is missing and the source is small and local)."""
    if is_prepared(source):
        return Prepared(source, Path(source).expanduser())
    wanted = identity(cfg, source, tokenizer)
    path = cache_dir(cfg) / cache_key(wanted)
    found = Prepared(source, path, wanted, cfg.trust_shared_cache)
    if os.path.lexists(path):  # verify_all says what is wrong with an entry that is there
        return found
    why = needs_explicit_preparation(cfg, source)
    if why:
        raise DataError(f"{source} is not prepared yet, and {why}: prepare it once with `python -m trainer "
                        f"prepare-data --preset <this preset>` (it writes {path}, where training looks), or "
                        f"`python -m trainer prepare-data --source {source} --out DIR` and set data.source to DIR")
    prepare_into_cache(cfg, source, tokenizer, path, RECORDS_PER_SHARD, wanted)
    print(f"data: prepared {source} into {path} (data.cache_dir; reused while the source, the tokenizer and the data "
          f"settings are unchanged; `python -m trainer prepare-data --preset NAME` prepares ahead of a run)",
          file=sys.stderr, flush=True)
    return found


def checked_samples(found: Checked, split: str, cfg: DataConfig, tokenizer, source: str):
    manifest = found.manifest
    samples = samples_of(shards.open_split(found.prepared.path, split, manifest, found.seen), cfg, tokenizer)
    if len(samples) == 0:
        info = manifest["splits"][split]
        first = info["shards"][0].get("first", "") if info["shards"] else ""
        origin = cfg.eval_source if split == "eval" and cfg.eval_source else source
        raise DataError(f"{origin}: the {split} split ({info['records']} records from {first} on, {info['tokens']} "
                        f"tokens) yields no full {cfg.seq_len}-token sequence; add data, lower data.seq_len, raise "
                        f"data.eval_fraction or set data.eval_source")
    return samples


def samples_of(split: shards.Split, cfg: DataConfig, tokenizer):
    if cfg.task == "pretrain":
        return PretrainSamples(split, cfg.seq_len, isolate_documents=cfg.cross_document_attention is False)
    if cfg.task == "preference":
        return PreferenceSamples(split, cfg.seq_len, tokenizer.pad_token_id)
    return SftSamples(split, cfg.seq_len, cfg.packing, tokenizer.pad_token_id,
                      isolate_documents=not cfg.cross_document_attention)
