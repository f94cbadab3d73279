"""What training reads: the prepared data of every source (prepared on first use when small and local),
checked against the run's tokenizer and task, as train and eval streams of samples."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..config import DataConfig
from . import shards
from .loader import Source, Stream
from .prepare import needs_explicit_preparation, prepare_into_cache, prepared_path
from .records import DataError
from .samples import PretrainSamples, SftSamples


RECORDS_PER_SHARD = 100_000  # about 100 M tokens of web text per shard


@dataclass
class PreparedData:
    train: Stream
    eval: list[Stream]                       # one per source, each evaluated on its own held-out documents
    stats: dict = field(default_factory=dict)  # {"train": {...}, "eval": {...}, "proportions": {...}}


def sources_of(cfg: DataConfig) -> list[tuple[str, str, float]]:
    """(name, source, weight) of data.sources, or of the single data.source."""
    if cfg.sources:
        return [(s.name or Path(s.path).stem or s.path, s.path, s.weight) for s in cfg.sources]
    return [(Path(cfg.source).stem or cfg.source, cfg.source, 1.0)]


def build_datasets(cfg: DataConfig, tokenizer, seed: int) -> PreparedData:
    train_sources, eval_streams, stats = [], [], {"train": {}, "eval": {}}
    for name, source, weight in sources_of(cfg):
        path = ensure_prepared(cfg, source, tokenizer)
        manifest = shards.read_manifest(path)
        check_manifest(manifest, path, cfg, tokenizer)
        train, evaluation = (checked_samples(path, split, manifest, cfg, tokenizer, source)
                             for split in shards.SPLITS)
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
    return PreparedData(stream, eval_streams, stats)


def ensure_prepared(cfg: DataConfig, source: str, tokenizer) -> Path:
    path = prepared_path(cfg, source, tokenizer)
    if (path / shards.MANIFEST).is_file():
        return path
    why = needs_explicit_preparation(cfg, source)
    if why:
        raise DataError(f"{source} is not prepared yet, and {why}: prepare it once with `python -m trainer "
                        f"prepare-data --preset <this preset>` (it writes {path}, where training looks), or "
                        f"`python -m trainer prepare-data --source {source} --out DIR` and set data.source to DIR")
    prepare_into_cache(cfg, source, tokenizer, path, RECORDS_PER_SHARD)
    return path


def check_manifest(manifest: dict, path: Path, cfg: DataConfig, tokenizer) -> None:
    """Prepared data that does not match this run is a named error, before any step."""
    problems = []
    if manifest["task"] != cfg.task:
        problems.append(f"it was prepared for task {manifest['task']!r}, this run's data.task is {cfg.task!r}")
    if manifest["vocab_size"] != len(tokenizer):
        problems.append(f"its tokenizer has {manifest['vocab_size']} tokens, this run's has {len(tokenizer)}")
    elif manifest["tokenizer"]["fingerprint"] != shards.tokenizer_fingerprint(tokenizer):
        problems.append(f"it was tokenized with another tokenizer ({manifest['tokenizer']['name']}, fingerprint "
                        f"{manifest['tokenizer']['fingerprint']}) than this run's ({tokenizer.name_or_path})")
    if manifest.get("format_of_records") == "chat" and manifest.get("chat_template") != tokenizer.chat_template:
        problems.append("its chat samples were rendered with another chat template than this run's tokenizer has")
    if cfg.task == "sft" and manifest.get("seq_len") not in (None, cfg.seq_len):
        problems.append(f"its SFT samples were fitted to seq_len {manifest['seq_len']}, this run's data.seq_len is "
                        f"{cfg.seq_len}")
    if problems:
        raise DataError(f"{path}: " + "; ".join(problems) + ": prepare the data again for this run "
                        "(`python -m trainer prepare-data`) or point data.source at data prepared for it")


def checked_samples(path: Path, split: str, manifest: dict, cfg: DataConfig, tokenizer, source: str):
    samples = samples_of(shards.open_split(path, split, manifest), cfg, tokenizer)
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
        return PretrainSamples(split, cfg.seq_len)
    return SftSamples(split, cfg.seq_len, cfg.packing, tokenizer.pad_token_id)
