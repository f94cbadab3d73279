"""Tokenize once: records -> eval split (by document) -> token shards on disk (trainer/data/shards.py).

`prepare(cfg, tokenizer, out)` writes a prepared directory; it can be stopped and rerun (finished shards are
kept, and the result is byte-identical to an uninterrupted run). `prepared_path(cfg, tokenizer)` is where
training finds a source's prepared data: the source itself when it is a prepared directory, else a cache
directory keyed by everything that decides the bytes (the source's content hash, tokenizer, task, fields, split).
`prepare_into_cache` fills a cache entry through a fresh temporary directory (trainer/data/verify.py checks an
entry against the identity its key stands for, every time it is used).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np

from ..config import DataConfig
from ..lazy import lazy_module
from . import fingerprint, shards
from .records import ORIGIN, DataError, load_records, looks_like_path, split_records
from .tokenize import record_format, tokenize_records, with_eos

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
    remembered by stat in `cache`, trainer/data/fingerprint.py), the name, split and subset of a hub dataset."""
    path = Path(source).expanduser()
    if not path.exists():
        return {"hub": source, "split": split, "subset": subset}
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    named = {str(p.relative_to(path)) if path.is_dir() else p.name: p for p in files}
    hashes = fingerprint.content_hashes(path.resolve(), named, cache or default_cache_dir())
    return {"path": str(path.resolve()), "files": [[name, file.stat().st_size, hashes[name]]
                                                   for name, file in named.items()]}


def identity(cfg: DataConfig, source: str, tokenizer) -> dict:
    """Everything that decides the prepared bytes; its hash names the cache directory."""
    eval_source = cfg.eval_source if source == cfg.source else None
    fields = {"pretrain": [cfg.text_field]}.get(cfg.task, [cfg.prompt_field, cfg.response_field,
                                                          cfg.messages_field, cfg.seq_len, cfg.truncate])
    subset = cfg.subset if source == cfg.source else None
    cache = cache_dir(cfg)
    return {"format": shards.FORMAT, "task": cfg.task, "source": source_fingerprint(source, cfg.split, subset, cache),
            "eval_source": (source_fingerprint(eval_source, cfg.eval_split or cfg.split, cache=cache)
                            if eval_source else None),
            "eval_fraction": None if eval_source else cfg.eval_fraction, "split_seed": cfg.split_seed,
            "fields": fields, "tokenizer": shards.tokenizer_fingerprint(tokenizer),
            "chat_template": getattr(tokenizer, "chat_template", None) if cfg.task == "sft" else None}


def cache_key(wanted: dict) -> str:
    return hashlib.sha256(json.dumps(wanted, sort_keys=True).encode()).hexdigest()[:20]


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


# --- preparing -------------------------------------------------------------------------------------

def prepare(cfg: DataConfig, source: str, tokenizer, out: Path, records_per_shard: int, num_proc: int = 1,
            progress: bool = False, wanted: Optional[dict] = None) -> dict:
    """Prepare `source` into `out` (created; a rerun continues an interrupted one); returns the manifest.
    `wanted`: the source's identity when the caller has it already."""
    wanted = wanted or identity(cfg, source, tokenizer)
    check_output_dir(out, wanted)
    records = load_records(source, cfg.split, cfg.subset if source == cfg.source else None)
    fmt = record_format(records, cfg, tokenizer, source)
    if cfg.eval_source and source == cfg.source:
        eval_records = load_records(cfg.eval_source, cfg.eval_split or cfg.split)
        if record_format(eval_records, cfg, tokenizer, cfg.eval_source) != fmt:
            raise DataError(f"{cfg.eval_source}: eval records are in another format than {source}'s; use one")
        train_records = records
    else:
        train_records, eval_records = split_records(records, cfg.eval_fraction, cfg.split_seed, source)
    out.mkdir(parents=True, exist_ok=True)
    shards.write_atomic(out / ".identity.json", json.dumps(wanted, sort_keys=True).encode())
    dtype = shards.token_dtype(len(tokenizer))
    splits, meter = {}, Progress(progress)
    for name, split_records_ in (("train", train_records), ("eval", eval_records)):
        entries = []
        for index, start in enumerate(range(0, len(split_records_), records_per_shard)):
            entry = shards.finished_shard(out / name, index)
            if entry is None:
                # flatten: a selection of a selection still references the whole table, which every
                # tokenizer process would otherwise receive (pickled) for every shard
                chunk = split_records_.select(range(start, min(start + records_per_shard, len(split_records_))))
                chunk = chunk.flatten_indices()
                entry = _tokenize_shard(chunk, fmt, cfg, tokenizer, dtype, out / name, index, num_proc)
            entries.append(entry)
            meter.update(entry["tokens"], f"{name} shard {index}")
        splits[name] = {"shards": entries, "records": len(split_records_),
                        "tokens": sum(e["tokens"] for e in entries),
                        "documents": sum(e["documents"] for e in entries)}
        if splits[name]["documents"] == 0:
            raise DataError(f"{source}: the {name} split has no usable record (every one was dropped: no label "
                            f"left after truncation); add data or raise data.seq_len")
    if identity(cfg, source, tokenizer) != wanted:  # by stat when unchanged; read again when touched
        raise DataError(f"{source} changed while it was being prepared (its content no longer has the hash the "
                        f"preparation started from): prepare it again once it is no longer being written")
    manifest = {"format": shards.FORMAT, "task": cfg.task, "format_of_records": fmt, "dtype": dtype.name,
                "vocab_size": len(tokenizer), "eos_id": tokenizer.eos_token_id, "eos_appended": True,
                "tokenizer": {"name": str(tokenizer.name_or_path),
                              "fingerprint": shards.tokenizer_fingerprint(tokenizer)},
                "chat_template": getattr(tokenizer, "chat_template", None) if fmt == "chat" else None,
                "seq_len": cfg.seq_len if cfg.task == "sft" else None, "truncate": cfg.truncate,
                "identity": wanted, "splits": splits}
    shards.write_manifest(out, manifest)
    meter.done()
    return manifest


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


def _remove_unfinished(out: Path) -> None:
    """What an earlier preparation left before it finished a shard (its identity mark, empty split directories,
    temporary files): only names a preparation writes, so nothing else in `out` is touched."""
    (out / ".identity.json").unlink(missing_ok=True)
    for split in shards.SPLITS:
        directory = out / split
        if directory.is_dir():
            for leftover in directory.iterdir():
                if leftover.name.startswith(".") and leftover.name.endswith(".tmp") or \
                        leftover.suffix in (".tokens", ".docs", ".labels"):
                    leftover.unlink()
            if not any(directory.iterdir()):
                directory.rmdir()


def _tokenize_shard(records: datasets.Dataset, fmt: str, cfg: DataConfig, tokenizer, dtype: np.dtype,
                    split_dir: Path, index: int, num_proc: int) -> dict:
    stats = {"records": len(records), "first": records[0][ORIGIN] if len(records) else ""}
    if fmt == "text":  # pretraining: the bulk of any corpus, tokenized without a round trip through Arrow
        ids, lengths = encode_texts(text_column(records, cfg.text_field), tokenizer, num_proc)
        return shards.write_shard(split_dir, index, ids.astype(dtype), np.cumsum(lengths), None, stats)
    worker_cfg = cfg if num_proc == cfg.num_workers else _with_workers(cfg, num_proc)
    samples = tokenize_records(records, fmt, worker_cfg, tokenizer)
    ids_column = samples.data.column("input_ids").combine_chunks()
    lengths = np.diff(ids_column.offsets.to_numpy())
    ids = ids_column.values.to_numpy(zero_copy_only=False)
    mask = None
    if cfg.task == "sft":
        labels = samples.data.column("labels").combine_chunks().values.to_numpy(zero_copy_only=False)
        learnt = labels != -100
        keep = np.add.reduceat(learnt, np.r_[0, np.cumsum(lengths)[:-1]]) > 0 if len(lengths) else lengths > 0
        # Truncation can cut away a whole response; such a sample would only add padding-like noise.
        token_keep = np.repeat(keep, lengths)
        ids, learnt, lengths = ids[token_keep], learnt[token_keep], lengths[keep]
        mask = learnt
        cut = np.asarray(samples.data.column("_cut").to_pylist())
        stats.update(truncated_records=int((cut > 0).sum()), dropped_records=int((~keep).sum()))
    return shards.write_shard(split_dir, index, ids.astype(dtype), np.cumsum(lengths), mask, stats)


def text_column(records: datasets.Dataset, field: str) -> list[str]:
    """The texts of a shard; a record whose field is not a string is named by its line."""
    texts = records.with_format("arrow")[:][field].to_pylist()
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise DataError(f"{records[i][ORIGIN]}: field '{field}' is {'missing' if text is None else type(text).__name__}"
                            f", expected a string")
    return texts


_ENCODER, _TEXTS = None, []  # what the forked workers inherit (set just before the pool starts): no pickling


def encode_texts(texts: list[str], tokenizer, num_proc: int) -> tuple[np.ndarray, np.ndarray]:
    """(every text's ids + EOS back to back, the length of each), as `tokenizer(texts)` gives them, in
    `num_proc` forked processes over contiguous parts (so the order, and the bytes, never depend on it)."""
    global _ENCODER, _TEXTS
    _ENCODER, _TEXTS = tokenizer, texts
    size = -(-len(texts) // max(num_proc, 1))
    parts = [(start, min(start + size, len(texts))) for start in range(0, len(texts), size)] or [(0, 0)]
    try:
        if num_proc == 1 or len(parts) == 1:
            results = [_encode_part(part) for part in parts]
        else:
            import multiprocessing
            with multiprocessing.get_context("fork").Pool(len(parts), initializer=_ignore_interrupts) as pool:
                results = pool.map(_encode_part, parts)
    finally:
        _ENCODER, _TEXTS = None, []
    return np.concatenate([r[0] for r in results]), np.concatenate([r[1] for r in results])


def _ignore_interrupts() -> None:
    """Ctrl-C reaches every process of the terminal's group: the workers leave it to the parent, which stops them
    and reports it once (instead of one KeyboardInterrupt traceback per worker)."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _encode_part(part: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    texts, tokenizer = _TEXTS[part[0]:part[1]], _ENCODER
    eos = tokenizer.eos_token_id
    backend = getattr(tokenizer, "backend_tokenizer", None)  # what a fast tokenizer's __call__ runs, minus
    if backend is not None:                                   # building a BatchEncoding of Python lists
        encoded = [e.ids for e in backend.encode_batch(texts, add_special_tokens=True)] if texts else []
    else:
        encoded = tokenizer(texts, verbose=False)["input_ids"] if texts else []
    documents = [with_eos(x, eos) for x in encoded]
    lengths = np.fromiter(map(len, documents), dtype=np.int64, count=len(documents))
    ids = np.fromiter(itertools.chain.from_iterable(documents), dtype=np.int64, count=int(lengths.sum()))
    return ids, lengths


def _with_workers(cfg: DataConfig, num_proc: int) -> DataConfig:
    import dataclasses
    return dataclasses.replace(cfg, num_workers=num_proc)


class Progress:
    """Tokens/s on stderr while a preparation runs (rank 0 / the prepare-data command only)."""

    def __init__(self, enabled: bool):
        self.enabled, self.tokens, self.started = enabled, 0, time.perf_counter()

    def update(self, tokens: int, what: str) -> None:
        self.tokens += tokens
        if self.enabled:
            rate = self.tokens / max(time.perf_counter() - self.started, 1e-9)
            print(f"\rprepare: {what}: {self.tokens:,} tokens, {rate:,.0f} tokens/s", end="", file=sys.stderr,
                  flush=True)

    def done(self) -> None:
        if self.enabled:
            print(file=sys.stderr, flush=True)


def prepare_into_cache(cfg: DataConfig, source: str, tokenizer, path: Path, records_per_shard: int,
                       wanted: Optional[dict] = None) -> None:
    """Prepare into a fresh temporary sibling, then rename it to `path`: two jobs preparing the same key never see
    half a cache. The sibling is made by mkdtemp (a new random name, created exclusively: never a directory or link
    someone planted under a predictable name), and only what this call created is ever removed."""
    parent = path.parent
    parent.mkdir(parents=True, exist_ok=True)
    check_cache_parent(parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent))
    try:
        os.chmod(tmp, 0o755 & ~current_umask())  # mkdtemp's 0700 would hide the entry from a shared cache's users
        prepare(cfg, source, tokenizer, tmp, records_per_shard, max(1, cfg.num_workers), wanted=wanted)
        try:
            os.rename(tmp, path)
        except OSError:
            if not os.path.lexists(path):
                raise
            # another job renamed its copy first (the same bytes), or something else holds the name: either
            # way the entry at `path` is what verification checks next
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def check_cache_parent(parent: Path) -> None:
    """A cache directory every user may write without the sticky bit lets any of them rename or replace this
    run's entries (and its temporary directory while it is filled): refused."""
    mode = os.stat(parent).st_mode
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        raise DataError(f"data.cache_dir {parent} can be written by every user and has no sticky bit, so anyone can "
                        f"replace the prepared data in it: set the sticky bit (chmod +t {parent}, as /tmp has), "
                        f"or use a directory of your own (data.cache_dir)")


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
