"""Tokenize once: records -> eval split (by document) -> token shards on disk (trainer/data/shards.py).

`prepare(cfg, tokenizer, out)` writes a prepared directory; it can be stopped and rerun (finished shards are
kept, and the result is byte-identical to an uninterrupted run). `prepared_path(cfg, tokenizer)` is where
training finds a source's prepared data: the source itself when it is a prepared directory, else a cache
directory keyed by everything that decides the bytes (the source's content hash, tokenizer, task, fields, split).
`prepare_into_cache` fills a cache entry through a fresh temporary directory (trainer/data/verify.py checks an
entry against the identity its key stands for, every time it is used).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import stat
import sys
import time
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from ..config import DataConfig
from ..lazy import lazy_module
from ..cache import contents, entries, keys
from ..errors import UserError
from . import shards
from .encode import EVAL, SKIPPED, TRAIN, Part, Settings, Workers, encode_chunk
from .reading import Chunk, SourceReader, count_lines
from .records import DataError, eval_indices, looks_like_path
from .tokenize import format_of

datasets = lazy_module("datasets")  # reading raw records only: a training from prepared shards never imports it


# --- where prepared data lives ---------------------------------------------------------------------

def default_cache_dir() -> Path:
    """~/.cache/deepspeed-preset-trainer/prepared (XDG_CACHE_HOME as it is when asked, not at import)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "deepspeed-preset-trainer" / "prepared"


def cache_dir(cfg: DataConfig) -> Path:
    return Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()


def is_prepared(path: str) -> bool:
    return (Path(path).expanduser() / shards.MANIFEST).is_file()


def source_fingerprint(source: str, split: str, subset: str | None = None, cache: Path | None = None) -> dict:
    """What identifies a source's content: every file's name, size and SHA-256 for a local source (the hashes
    remembered by stat in `cache`, trainer/cache/contents.py), the name, split and subset of a hub dataset."""
    path = Path(source).expanduser()
    if not path.exists():
        return {"hub": source, "split": split, "subset": subset}
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    named = {str(p.relative_to(path)) if path.is_dir() else p.name: p for p in files}
    hashes = contents.content_hashes(path.resolve(), named, cache or default_cache_dir())
    return {"path": str(path.resolve()), "files": [[name, file.stat().st_size, hashes[name]]
                                                   for name, file in named.items()]}


def identity(cfg: DataConfig, source: str, tokenizer) -> dict:
    """Everything that decides the prepared bytes; its hash names the cache directory."""
    eval_source = cfg.eval_source if source == cfg.source else None
    fields = {"pretrain": [cfg.text_field],
              "preference": [cfg.prompt_field, cfg.messages_field, cfg.chosen_field, cfg.rejected_field, cfg.seq_len,
                             cfg.truncate]}.get(cfg.task, [cfg.prompt_field, cfg.response_field, cfg.messages_field,
                                                          cfg.seq_len, cfg.truncate])
    subset = cfg.subset if source == cfg.source else None
    cache = cache_dir(cfg)
    return {"format": shards.FORMAT, "task": cfg.task, "source": source_fingerprint(source, cfg.split, subset, cache),
            "eval_source": (source_fingerprint(eval_source, cfg.eval_split or cfg.split, cache=cache)
                            if eval_source else None),
            "eval_fraction": None if eval_source else cfg.eval_fraction, "split_seed": cfg.split_seed,
            "fields": fields, "tokenizer": shards.tokenizer_fingerprint(tokenizer),
            "chat_template": getattr(tokenizer, "chat_template", None) if cfg.task != "pretrain" else None}


KIND = "prepared"  # the cache layer's name for this kind of entry (a key input: no other kind shares a key)


def cache_key(wanted: dict) -> str:
    return keys.digest([("kind", KIND), ("identity", wanted)])


def prepared_path(cfg: DataConfig, source: str, tokenizer) -> Path:
    if is_prepared(source):
        return Path(source).expanduser()
    return cache_dir(cfg) / cache_key(identity(cfg, source, tokenizer))


def needs_explicit_preparation(cfg: DataConfig, source: str) -> Optional[str]:
    """Why `source` is not prepared automatically on first use (a hub dataset, or a local one over
    data.auto_prepare_max_gb), or None."""
    path = Path(source).expanduser()
    if not path.exists():  # a mistyped local path is named by load_records
        return None if looks_like_path(source) else "it is a hub dataset (downloaded and tokenized once, not " \
                                                    "inside a training job)"
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
    if size > cfg.auto_prepare_max_gb * 1e9:
        return f"it is {size / 1e9:.1f} GB, over data.auto_prepare_max_gb={cfg.auto_prepare_max_gb}"
    return None


# --- preparing ---------------------------------------------------------------------------------------

def prepare(cfg: DataConfig, source: str, tokenizer, out: Path, records_per_shard: int, num_proc: int = 1,
            progress: bool = False, wanted: Optional[dict] = None) -> dict:
    """Prepare `source` into `out` (created; a rerun continues an interrupted one); returns the manifest.
    `wanted`: the source's identity when the caller has it already. One preparation at a time writes `out`
    (`writing_alone`): two at once would rename each other's temporary files away."""
    with writing_alone(out):
        return _prepare(cfg, source, tokenizer, out, records_per_shard, num_proc, progress, wanted)


@contextlib.contextmanager
def writing_alone(out: Path) -> Iterator[None]:
    """An exclusive lock on the output directory itself (flock on its descriptor: no lock file, so the directory
    stays what a preparation writes, and the lock goes with the process however it ends). The directory is made
    to be locked; a run refused before it wrote anything leaves no empty directory behind."""
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DataError(f"{out}: another preparation is writing it now; wait for it to finish (then this one "
                            f"finds it prepared), or choose another output directory") from None
        yield
    except BaseException:
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise
    finally:
        os.close(fd)


def _prepare(cfg: DataConfig, source: str, tokenizer, out: Path, records_per_shard: int, num_proc: int,
             progress: bool, wanted: Optional[dict]) -> dict:
    """`prepare`, with `out` held.

    The records are streamed (trainer/data/reading.py): one pass counts them (the eval split is drawn from the
    count alone), a second hands them in chunks to `num_proc` tokenizer processes (trainer/data/encode.py) and
    writes what comes back, in order, into shards written in pieces. Memory does not grow with the corpus or the
    shard size; the bytes are those of tokenizing the whole split at once."""
    wanted = wanted or identity(cfg, source, tokenizer)
    check_output_dir(out, wanted)
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no eos_token; samples need one to end on")
    train = SourceReader(source, cfg.split, cfg.subset if source == cfg.source else None)
    fmt = format_of(*train.head(), cfg, tokenizer, source)
    held_out = SourceReader(cfg.eval_source, cfg.eval_split or cfg.split) if cfg.eval_source and source == cfg.source \
        else None
    if held_out is not None and format_of(*held_out.head(), cfg, tokenizer, cfg.eval_source) != fmt:
        raise DataError(f"{cfg.eval_source}: eval records are in another format than {source}'s; use one")
    settings = Settings(tokenizer, cfg, fmt, shards.token_dtype(len(tokenizer)))
    with Workers(num_proc, settings) as workers:
        count = train.count(list(workers.ordered(count_lines, train.count_tasks())))
        if held_out is not None:  # every record of the source trains, every one of eval_source evaluates
            totals = {TRAIN: count, EVAL: held_out.count(list(workers.ordered(count_lines, held_out.count_tasks())))}
            passes = [(train, None, TRAIN), (held_out, None, EVAL)]
        else:
            eval_ids = eval_indices(count, cfg.eval_fraction, cfg.split_seed, source)
            totals = {TRAIN: count - len(eval_ids), EVAL: len(eval_ids)}
            passes = [(train, eval_ids, None)]
        shards.write_atomic(out / ".identity.json", json.dumps(wanted, sort_keys=True).encode())
        labelled = cfg.task != "pretrain"  # SFT and preference samples carry a loss mask
        writers = {split: SplitWriter(out / shards.SPLITS[split], totals[split], records_per_shard, labelled)
                   for split in (TRAIN, EVAL)}
        try:
            _write_splits(workers, passes, writers, settings, Progress(progress, sum(totals.values())))
            splits = {shards.SPLITS[split]: writer.summary(source) for split, writer in writers.items()}
            if identity(cfg, source, tokenizer) != wanted:  # by stat when unchanged; read again when touched
                raise DataError(f"{source} changed while it was being prepared (its content no longer has the hash "
                                f"the preparation started from): prepare it again once it is no longer being written")
        except UserError:
            # what was written holds records the user must change (or settings that change the key): a rerun could
            # never continue it, and would find the directory taken by "another source"
            _remove_unfinished(out, finished_too=True)  # an emptied directory is removed by writing_alone
            raise
        except Exception:
            if not _finished_shards(out):  # nothing a rerun could continue: leave no identity mark behind
                _remove_unfinished(out)
            raise
    manifest = {"format": shards.FORMAT, "task": cfg.task, "format_of_records": fmt, "dtype": settings.dtype.name,
                "vocab_size": len(tokenizer), "eos_id": tokenizer.eos_token_id, "eos_appended": True,
                "tokenizer": {"name": str(tokenizer.name_or_path),
                              "fingerprint": shards.tokenizer_fingerprint(tokenizer)},
                "chat_template": getattr(tokenizer, "chat_template", None) if fmt.endswith("chat") else None,
                "seq_len": cfg.seq_len if cfg.task != "pretrain" else None, "truncate": cfg.truncate,
                "identity": wanted, "splits": splits}
    shards.write_manifest(out, manifest)
    return manifest


def _write_splits(workers: Workers, passes: list, writers: dict, settings: Settings, meter: "Progress") -> None:
    """Stream each source of `passes` through the tokenizer processes into the split writers."""
    for source, eval_ids, only in passes:
        tasks = ((chunk, routes(chunk, eval_ids, only, writers)) for chunk in source.chunks(settings.fields))
        for parts in workers.ordered(encode_chunk, tasks):
            for split, part in parts.items():
                writers[split].feed(part)
            meter.update(sum(len(part.ids) for part in parts.values()), sum(part.count for part in parts.values()),
                         writers[TRAIN].shard_name())
    meter.done()


def routes(chunk: Chunk, eval_ids: Optional[np.ndarray], only: Optional[int], writers: dict) -> np.ndarray:
    """Each record's split (EVAL when its index is among the sorted `eval_ids`, else TRAIN; or `only`), plus SKIPPED
    when its shard was finished by an earlier run."""
    if only is not None:
        split = np.full(chunk.records, only, dtype=np.uint8)
    else:
        split = np.zeros(chunk.records, dtype=np.uint8)
        lo, hi = np.searchsorted(eval_ids, [chunk.first_record, chunk.first_record + chunk.records])
        split[eval_ids[lo:hi] - chunk.first_record] = EVAL
    for which, writer in writers.items():
        chosen = np.flatnonzero(split == which)
        split[chosen[writer.dispatch(len(chosen))]] |= SKIPPED
    return split


class SplitWriter:
    """A split's shards written as its records come, `per_shard` records each; shards an earlier run finished are
    kept (their records are skipped: `dispatch`). `sft`: the records are samples with a loss mask (SFT, preference)."""

    def __init__(self, split_dir: Path, total: int, per_shard: int, sft: bool):
        self.split_dir, self.total, self.per_shard, self.sft = split_dir, total, per_shard, sft
        self.entries = {index: entry for index in range(-(-total // per_shard))
                        if (entry := shards.finished_shard(split_dir, index)) is not None}
        self.finished = np.array(sorted(self.entries), dtype=np.int64)
        self.position = self.dispatched = 0
        self.shard: Optional[shards.ShardWriter] = None

    def dispatch(self, count: int) -> np.ndarray:
        """The next `count` records are handed out: which of them belong to finished shards."""
        positions = self.dispatched + np.arange(count)
        self.dispatched += count
        return np.isin(positions // self.per_shard, self.finished)

    def feed(self, part: Part) -> None:
        """The part's records, next in the split's order (those of finished shards were left out)."""
        offsets = np.concatenate(([0], np.cumsum(part.lengths)))
        end, taken = self.position + part.count, 0
        while self.position < end:
            index = self.position // self.per_shard
            stop = min(end, (index + 1) * self.per_shard)
            if index not in self.entries:
                taken = self._write(index, part, offsets, taken, stop - self.position)
            self.position = stop

    def _write(self, index: int, part: Part, offsets: np.ndarray, taken: int, count: int) -> int:
        if self.shard is None:
            self.shard = shards.ShardWriter(self.split_dir, index, self.sft)
            self.stats = {"records": 0, "first": f"{part.origin} {part.numbers[taken]}"}
            self.truncated = self.dropped = 0
        records, tokens = slice(taken, taken + count), slice(offsets[taken], offsets[taken + count])
        lengths = part.lengths[records]
        documents = lengths[lengths > 0] if part.firsts is None else \
            np.stack([part.firsts[records], lengths - part.firsts[records]], axis=1).ravel()  # preference: 2 a record
        self.shard.add(part.ids[tokens], documents, None if part.mask is None else part.mask[tokens])
        self.stats["records"] += count
        if self.sft:
            self.truncated += int((part.cut[records] > 0).sum())
            self.dropped += int((lengths == 0).sum())
        if self.position + count == min((index + 1) * self.per_shard, self.total):
            if self.sft:
                self.stats.update(truncated_records=self.truncated, dropped_records=self.dropped)
            self.entries[index] = self.shard.finish(self.stats)
            self.shard = None
        return taken + count

    def shard_name(self) -> str:
        return f"shard {min(self.position, max(self.total - 1, 0)) // self.per_shard}"

    def summary(self, source: str) -> dict:
        entries = [self.entries[index] for index in range(-(-self.total // self.per_shard))]
        split = {"shards": entries, "records": self.total, "tokens": sum(e["tokens"] for e in entries),
                 "documents": sum(e["documents"] for e in entries)}
        if split["documents"] == 0:
            raise DataError(f"{source}: the {self.split_dir.name} split has no usable record (every one was dropped: "
                            f"no label left after truncation); add data or raise data.seq_len")
        return split


def check_output_dir(out: Path, wanted: dict) -> None:
    """`out` may be new, empty, or an earlier (possibly interrupted) preparation of the same thing, this user's
    and without links (a rerun writes into it, and would follow a planted link out of it)."""
    if not out.exists() or not any(out.iterdir()):
        return
    for entry in [out, *out.rglob("*")]:
        info = os.lstat(entry)
        if stat.S_ISLNK(info.st_mode) and entry != out:
            raise DataError(f"{entry} is a symbolic link: a preparation writes none; choose a new output directory "
                            f"(or delete {out})")
        if info.st_uid != os.getuid():
            raise DataError(f"{entry} belongs to user id {info.st_uid}, not to you ({os.getuid()}): continue only "
                            f"your own preparation; choose a new output directory")
    mark = out / ".identity.json"
    if not mark.is_file():
        raise DataError(f"{out} holds other files, not prepared data: choose an empty or new output directory")
    try:
        recorded = json.loads(mark.read_text())
    except (OSError, ValueError):
        recorded = None  # a torn mark: nothing can be continued from it
    if recorded == wanted:
        return
    if not _finished_shards(out):  # a preparation that stopped before its first shard: nothing to keep
        _remove_unfinished(out)
        return
    raise DataError(f"{out} holds prepared data of another source, tokenizer or setting; choose another "
                    f"output directory or delete it")


def _finished_shards(out: Path) -> list[Path]:
    return [marker for split in shards.SPLITS for marker in (out / split).glob("[0-9]*.json")] + \
        ([out / shards.MANIFEST] if (out / shards.MANIFEST).exists() else [])


def _remove_unfinished(out: Path, finished_too: bool = False) -> None:
    """What an earlier preparation left before it finished a shard (its identity mark, empty split directories,
    temporary files), and with `finished_too` its finished shards as well: only names a preparation writes, so
    nothing else in `out` is touched."""
    (out / ".identity.json").unlink(missing_ok=True)
    for split in shards.SPLITS:
        directory = out / split
        if directory.is_dir():
            for leftover in directory.iterdir():
                if leftover.name.startswith(".") and leftover.name.endswith(".tmp") or \
                        leftover.suffix in (".tokens", ".docs", ".labels") or \
                        finished_too and leftover.suffix == ".json" and leftover.stem.isdigit():
                    leftover.unlink()
            if not any(directory.iterdir()):
                directory.rmdir()


class Progress:
    """Tokens/s on stderr while a preparation runs (rank 0 / the prepare-data command only), twice a second."""

    def __init__(self, enabled: bool, records: int):
        self.enabled, self.records, self.tokens, self.done_records = enabled, records, 0, 0
        self.started = self.shown = time.perf_counter()

    def update(self, tokens: int, records: int, what: str) -> None:
        self.tokens, self.done_records = self.tokens + tokens, self.done_records + records
        now = time.perf_counter()
        if self.enabled and (now - self.shown >= 0.5 or self.done_records == self.records):
            self.shown = now
            rate = self.tokens / max(now - self.started, 1e-9)
            print(f"\rprepare: train {what}: {self.done_records:,}/{self.records:,} records, {self.tokens:,} tokens, "
                  f"{rate:,.0f} tokens/s", end="", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.enabled:
            print(file=sys.stderr, flush=True)


def prepare_into_cache(cfg: DataConfig, source: str, tokenizer, path: Path, records_per_shard: int,
                       wanted: Optional[dict] = None) -> None:
    """Prepare into a cache entry the way every entry is filled (trainer/cache/entries.py `fill`: a fresh exclusive
    temporary sibling renamed into place, so two jobs preparing the same key never see half a cache)."""
    entries.fill(path, lambda tmp: prepare(cfg, source, tokenizer, tmp, records_per_shard, max(1, cfg.num_workers),
                                           wanted=wanted))


check_cache_parent = entries.check_parent
