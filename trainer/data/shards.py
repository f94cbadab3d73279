"""Prepared data on disk: token shards written once, read on demand by every rank.

    <prepared>/manifest.json             format, task, tokenizer (name + fingerprint), vocab, dtype, source
    <prepared>/train/00000.tokens        the ids of every document of the shard, back to back (uint16/uint32)
    <prepared>/train/00000.docs          int64 end offset of each document in .tokens
    <prepared>/train/00000.labels        sft only: uint8, 1 where the token is learnt (the loss mask)
    <prepared>/train/00000.json          the shard's counts, sizes and SHA-256s: written last, so it marks a
                                         finished shard (a rerun of an interrupted preparation keeps it)
    <prepared>/eval/...                  the same for the eval split

Every file is written to a temporary name, fsynced and renamed, so a shard or manifest either exists whole
or not at all. Ranks read windows with positional reads: the page cache is shared by the ranks of a node and
a rank's memory does not grow with the corpus. Before a run reads a prepared directory, trainer/data/verify.py
checks it against the manifest (sizes, SHA-256s, counts, token ids); a Split then opens a file only while it is
still the file that was checked.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Optional

import numpy as np

from ..cache import contents, entries
from .records import DataError

FORMAT = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "eval")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocabularies up to 65,536), else uint32: 2 or 4 bytes per token on disk."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what decides the ids: the tokenizer model and vocabulary and its special tokens (the chat
    template, which decides chat samples too, is recorded and checked on its own)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = json.dumps({"special": tokenizer.special_tokens_map, "eos": tokenizer.eos_token_id}, sort_keys=True,
                       default=str)
    return hashlib.sha256((body + extra).encode()).hexdigest()[:16]


# --- writing ---------------------------------------------------------------------------------------

def write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = entries.create_new(tmp, replace_leftover=True)  # created exclusively, never through a planted link
    with open(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_shard(split_dir: Path, index: int, ids: np.ndarray, doc_ends: np.ndarray,
                label_mask: Optional[np.ndarray], stats: dict) -> dict:
    """Write one shard (tokens, document ends, optional loss mask), then its .json marker; returns the marker."""
    shard = ShardWriter(split_dir, index, label_mask is not None)
    shard.add(ids, np.diff(np.asarray(doc_ends, dtype=np.int64), prepend=0), label_mask)
    return shard.finish(stats)


class ShardWriter:
    """One shard written in pieces, as the records come: each file goes to a temporary name and is hashed as it is
    written (one pass over the bytes); `finish` fsyncs and renames them, then writes the .json marker, so a shard
    exists whole or not at all (an interrupted one leaves only temporary names, which a rerun writes again)."""

    def __init__(self, split_dir: Path, index: int, labels: bool):
        split_dir.mkdir(parents=True, exist_ok=True)
        self.marker = split_dir / f"{index:05d}.json"
        suffixes = ("tokens", "docs", "labels") if labels else ("tokens", "docs")
        self.files = {suffix: HashedFile(split_dir / f"{index:05d}.{suffix}") for suffix in suffixes}
        self.tokens = self.documents = 0

    def add(self, ids: np.ndarray, lengths: np.ndarray, label_mask: Optional[np.ndarray] = None) -> None:
        """Documents of `lengths` tokens each, whose ids (and loss mask) are `ids` back to back."""
        self.files["tokens"].write(ids)
        self.files["docs"].write(self.tokens + np.cumsum(lengths, dtype=np.int64))
        if label_mask is not None:
            self.files["labels"].write(label_mask.astype(np.uint8, copy=False))
        self.tokens += len(ids)
        self.documents += len(lengths)

    def finish(self, stats: dict) -> dict:
        entry = {"tokens": int(self.tokens), "documents": int(self.documents), **stats, "files": {}}
        for suffix, file in self.files.items():
            entry["files"][suffix] = file.close()
        write_atomic(self.marker, json.dumps(entry, indent=1).encode())
        return entry


class HashedFile:
    """A file written to `.<name>.tmp` and hashed as it is written; `close` fsyncs it and renames it to its name."""

    def __init__(self, path: Path):
        self.path, self.tmp = path, path.with_name(f".{path.name}.tmp")
        self.handle = open(entries.create_new(self.tmp, replace_leftover=True), "wb")  # the cache layer's rule
        self.digest, self.bytes = hashlib.sha256(), 0

    def write(self, array: np.ndarray) -> None:
        data = memoryview(np.ascontiguousarray(array)).cast("B")
        self.handle.write(data)
        self.digest.update(data)
        self.bytes += len(data)

    def close(self) -> dict:
        self.handle.flush()
        os.fsync(self.handle.fileno())
        self.handle.close()
        os.replace(self.tmp, self.path)
        return {"bytes": self.bytes, "sha256": self.digest.hexdigest()}


def finished_shard(split_dir: Path, index: int) -> Optional[dict]:
    """The marker of a shard written completely before (its files have the recorded sizes and SHA-256s), else
    None: a rerun writes that shard again."""
    marker = split_dir / f"{index:05d}.json"
    if not marker.is_file():
        return None
    entry = json.loads(marker.read_text())
    for suffix, info in entry["files"].items():
        path = split_dir / f"{index:05d}.{suffix}"
        if not path.is_file() or path.stat().st_size != info["bytes"]:
            return None
        if contents.sha256_file(path) != info["sha256"]:
            return None
    return entry


def write_manifest(root: Path, manifest: dict) -> None:
    write_atomic(root / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())


def read_manifest(root: Path) -> dict:
    path = root / MANIFEST
    if not path.is_file():  # a FIFO would block the read
        raise DataError(f"{path} is missing or not a regular file: prepare the data again with `python -m trainer "
                        f"prepare-data`")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise DataError(f"{path}: not a readable prepared-data manifest ({err}); prepare the data again with "
                        f"`python -m trainer prepare-data`") from None
    if manifest.get("format") != FORMAT:
        raise DataError(f"{path}: prepared-data format {manifest.get('format')!r}, this trainer reads format "
                        f"{FORMAT}; prepare the data again with `python -m trainer prepare-data`")
    return manifest


# --- reading ---------------------------------------------------------------------------------------

class Split:
    """One split of prepared data as a single virtual token stream over its shards.

    Windows are read with positional reads (os.pread), not a memory map: the bytes come through the page cache,
    which the ranks of a node share, but nothing of the corpus is mapped into a rank, so its resident memory
    does not grow with the corpus or with how much of it has been read. The document index (8 bytes a
    document) is loaded only when asked for (SFT blocks need it; pretraining windows do not)."""

    def __init__(self, shard_stems: list[Path], token_counts: list[int], dtype: np.dtype, has_labels: bool,
                 documents: int, checked: Optional[dict[str, tuple]] = None):
        self.stems, self.dtype, self.has_labels, self.documents = shard_stems, dtype, has_labels, documents
        self.checked = checked  # path -> (dev, inode, size, mtime, ctime) of the file verify.py read
        self.shard_starts = np.concatenate([[0], np.cumsum(token_counts)]).astype(np.int64)
        self._files: dict[tuple[int, str], int] = {}
        self._doc_ends: Optional[np.ndarray] = None

    @property
    def total_tokens(self) -> int:
        return int(self.shard_starts[-1])

    @property
    def doc_ends(self) -> np.ndarray:
        """Global end offset of every document (int64), read on first use."""
        if self._doc_ends is None:
            ends = [self._whole(shard, ".docs", np.dtype(np.int64)) + start
                    for shard, start in enumerate(self.shard_starts[:-1])]
            self._doc_ends = np.concatenate(ends) if ends else np.zeros(0, dtype=np.int64)
        return self._doc_ends

    def doc_lengths(self) -> np.ndarray:
        return np.diff(self.doc_ends, prepend=0)

    def read(self, start: int, length: int, labels: bool = False) -> np.ndarray:
        """Tokens (or the loss mask) [start, start + length) of the stream, across shard boundaries."""
        suffix, dtype = (".labels", np.dtype(np.uint8)) if labels else (".tokens", self.dtype)
        out, position = [], start
        shard = int(np.searchsorted(self.shard_starts, start, side="right")) - 1
        while position < start + length:
            local = position - int(self.shard_starts[shard])
            take = min(start + length - position, int(self.shard_starts[shard + 1]) - position)
            data = os.pread(self._fd(shard, suffix), take * dtype.itemsize, local * dtype.itemsize)
            out.append(np.frombuffer(data, dtype=dtype))
            position += take
            shard += 1
        return out[0] if len(out) == 1 else np.concatenate(out)

    def _whole(self, shard: int, suffix: str, dtype: np.dtype) -> np.ndarray:
        """A whole file of a shard, read once (its descriptor is not kept)."""
        fd = self._open(self.stems[shard].with_suffix(suffix))
        try:
            return np.frombuffer(os.pread(fd, os.fstat(fd).st_size, 0), dtype=dtype)
        finally:
            os.close(fd)

    def _fd(self, shard: int, suffix: str) -> int:
        key = (shard, suffix)
        if key not in self._files:
            self._files[key] = self._open(self.stems[shard].with_suffix(suffix))
        return self._files[key]

    def _open(self, path: Path) -> int:
        fd = os.open(path, os.O_RDONLY)
        if self.checked is not None and file_identity(os.fstat(fd)) != self.checked.get(str(path)):
            os.close(fd)
            raise DataError(f"{path} is no longer the file that was verified when this run started (it was replaced "
                            f"or written since): nothing of it was read; restart the run, which verifies the prepared "
                            f"data again")
        return fd

    def __del__(self, close=os.close):  # os.close bound now: at interpreter exit the module may be gone
        for fd in getattr(self, "_files", {}).values():
            close(fd)


def file_identity(info: os.stat_result) -> tuple:
    """What a checked file must still have when it is opened (a rewrite changes ctime, a replacement the inode)."""
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns


def open_split(root: Path, split: str, manifest: dict, checked: Optional[dict[str, tuple]] = None) -> Split:
    """A split's shards as the manifest lists them; `checked`: the files verify.py read (verify_all), which are
    the only ones the Split will open."""
    entries = manifest["splits"][split]["shards"]
    return Split([root / split / f"{index:05d}" for index in range(len(entries))], [e["tokens"] for e in entries],
                 np.dtype(manifest["dtype"]), any("labels" in e["files"] for e in entries),
                 sum(e["documents"] for e in entries), checked)
