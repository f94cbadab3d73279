"""Prepared data is what its manifest says: checked once per run, before the first step (and once per evaluate).

The manifest, and each shard's .json marker (which must equal the manifest's entry), is the record; everything on
disk is checked against it:

- entries: no link that leads out of the prepared directory. In the automatic cache (data.cache_dir) also: no link
  at all (the cache writes none), every entry this user's (data.trust_shared_cache accepts other owners), none
  writable by every user, a cache directory that is not world-writable without the sticky bit, and the manifest's
  identity the one this run's key stands for (another corpus, tokenizer or setting filed under the key);
- counts: tokens = bytes / dtype size, 8 bytes per document end, one loss-mask byte per token (SFT), each split's
  totals the sum of its shards, a dtype that holds the vocabulary;
- bytes: every file's size and SHA-256, in one read that also checks the token ids against the vocabulary (the first
  bad one named by shard and offset), the document ends (never decreasing, the last one the shard's token count) and
  the loss mask (0 or 1).

The read is shared: ranks that see the same files (same inode, size, mtime and ctime: one shared file system) split
them, so a corpus is read once per copy, not once per rank; ranks that see another copy (a node-local cache) read
theirs. Every rank then raises the same DataError, naming each file, what differs, and the fix. The files are opened
for training only while they are still the files that were checked (shards.Split).
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from .. import ranks
from ..cache import entries
from ..config import DataConfig
from ..distributed import gather_text
from . import shards
from .records import DataError

CHUNK = 8 << 20  # bytes per read: a multiple of every item size
SHOWN = 8        # problems listed in one message
FOREIGN = "not to you"                                                           # in the problems that
UNSAFE = ("is a symbolic link", FOREIGN, "can be written by every user", "sticky")  # say who could write
ITEM = {"tokens": None, "docs": np.dtype(np.int64), "labels": np.dtype(np.uint8)}  # None: the manifest's dtype


@dataclass
class Prepared:
    """A source's prepared directory as training found it."""
    source: str
    path: Path
    expected: Optional[dict] = None  # the identity its cache key stands for; None: a directory the user named
    trust_others: bool = False       # data.trust_shared_cache

    @property
    def cached(self) -> bool:
        return self.expected is not None


@dataclass
class Listed:
    """One shard file as the manifest records it."""
    path: Path
    kind: str            # tokens, docs or labels
    dtype: np.dtype
    size: int
    sha256: str
    tokens: int          # the shard's token count


@dataclass
class Checked:
    prepared: Prepared
    manifest: Optional[dict] = None
    refusal: Optional[str] = None                               # a whole message: the data does not fit this run
    problems: list[str] = field(default_factory=list)           # what differs from the record
    files: list[Listed] = field(default_factory=list)
    seen: dict[str, tuple] = field(default_factory=dict)        # path -> (dev, inode, size, mtime, ctime) checked


# --- the collective ------------------------------------------------------------------------------------------------

def verify_all(prepared: list[Prepared], cfg: DataConfig, tokenizer) -> tuple[list[Checked], dict]:
    """Check every source's prepared data (collective when a process group is up: every rank calls it); returns the
    checked sources and what was read, or raises the same DataError on every rank."""
    started = time.perf_counter()
    checked = [inspect_safely(p, cfg, tokenizer) for p in prepared]
    mine = [(manifest_digest(c), copy_digest(c)) for c in checked]
    views = [json.loads(text) for text in gather_text(json.dumps(mine))]
    rank, read_here = ranks.rank(), 0
    for index, c in enumerate(checked):
        if c.refusal or c.problems:
            continue
        if views[0][index][0] not in ("", mine[index][0]):
            c.problems.append(f"{c.prepared.path}/{shards.MANIFEST} on rank {rank} differs from the one rank 0 "
                              f"reads: every rank must train on the same prepared data (a directory every node sees, "
                              f"or the same copy on each)")
            continue
        group = [r for r, view in enumerate(views) if view[index][1] == mine[index][1]]
        share = c.files[group.index(rank)::len(group)]
        c.problems += read_files(share, c.seen, len(tokenizer))
        read_here += sum(f.size for f in share)
    found = [json.loads(text) for text in gather_text(json.dumps([[c.refusal, c.problems] for c in checked]))]
    for index, c in enumerate(checked):
        refusals = [view[index][0] for view in found if view[index][0]]
        if refusals:
            raise DataError(refusals[0])
        problems = list(dict.fromkeys(p for view in found for p in view[index][1]))
        if problems:
            raise DataError(refusal(c.prepared, problems))
    every = [f for c in checked for f in c.files]
    return checked, {"files": len(every), "bytes": sum(f.size for f in every), "read_here": read_here,
                     "seconds": round(time.perf_counter() - started, 3)}


def inspect_safely(prepared: Prepared, cfg: DataConfig, tokenizer) -> Checked:
    """`inspect`, with an unexpected failure (an unreadable entry) reported as a problem of this source: a rank that
    raised here would leave the others waiting in the collective."""
    try:
        return inspect(prepared, cfg, tokenizer)
    except Exception as err:  # reported on every rank by verify_all
        return Checked(prepared, problems=[f"checking {prepared.path} failed: {type(err).__name__}: {err}"])


def manifest_digest(c: Checked) -> str:
    return "" if c.manifest is None else hashlib.sha256(json.dumps(c.manifest, sort_keys=True).encode()).hexdigest()


def copy_digest(c: Checked) -> str:
    """Which copy of the data this rank sees: ranks with the same digest see the same files and share the read."""
    if c.refusal or c.problems:
        return ""
    seen = [c.seen[str(f.path)][1:] for f in c.files]  # not st_dev: a network file system varies it per node
    return hashlib.sha256(json.dumps([manifest_digest(c), seen]).encode()).hexdigest()


def refusal(prepared: Prepared, problems: list[str]) -> str:
    shown = problems[:SHOWN] + ([f"... and {len(problems) - SHOWN} more"] if len(problems) > SHOWN else [])
    if any(FOREIGN in p for p in problems):
        fix = (f"use a data.cache_dir of your own (the run prepares {prepared.source} there), or, for a cache shared "
               f"with people you trust, set data.trust_shared_cache=true")
    elif prepared.cached:
        fix = (f"prepare it again: delete {prepared.path} (the automatic cache of {prepared.source}; the next run "
               f"prepares it again)")
    else:
        fix = (f"prepare it again (`python -m trainer prepare-data --source SOURCE --out NEW_DIR`) and point "
               f"data.source at the new directory")
    lines = "\n".join(f"  - {p}" for p in shown)
    unsafe_only = all(any(mark in p for mark in UNSAFE) for p in problems)
    what = "is not safe to read" if unsafe_only else "is not what its manifest says"
    return f"prepared data {prepared.path} {what}:\n{lines}\n{fix}"


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
    chat = str(manifest.get("format_of_records")).endswith("chat")
    if chat and manifest.get("chat_template") != tokenizer.chat_template:
        problems.append("its chat samples were rendered with another chat template than this run's tokenizer has")
    if cfg.task != "pretrain" and manifest.get("seq_len") not in (None, cfg.seq_len):
        problems.append(f"its {cfg.task} samples were fitted to seq_len {manifest['seq_len']}, this run's data.seq_len "
                        f"is {cfg.seq_len}")
    if problems:
        raise DataError(f"{path}: " + "; ".join(problems) + ": prepare the data again for this run "
                        "(`python -m trainer prepare-data`) or point data.source at data prepared for it")


# --- what one rank checks without reading the shards ----------------------------------------------------------------

def inspect(prepared: Prepared, cfg: DataConfig, tokenizer) -> Checked:
    """The manifest against this run, the directory entries and the counts (a few stat calls per shard)."""
    checked = Checked(prepared)
    root = prepared.path
    if prepared.cached:
        checked.problems += cache_root_problems(prepared)
        if checked.problems:
            return checked
    try:
        checked.manifest = shards.read_manifest(root)
        check_manifest(checked.manifest, root, cfg, tokenizer)
    except DataError as err:
        checked.refusal = str(err)
        return checked
    except (KeyError, TypeError, AttributeError) as err:
        checked.refusal = (f"{root / shards.MANIFEST} is not a prepared-data manifest of format {shards.FORMAT} "
                           f"(at {err!r}): prepare the data again (`python -m trainer prepare-data`)")
        return checked
    if prepared.cached:
        checked.problems += identity_problems(prepared, checked.manifest)
    try:
        checked.files = listed_files(root, checked.manifest, checked.problems)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        checked.problems.append(f"{root / shards.MANIFEST} is not a prepared-data manifest of format {shards.FORMAT} "
                                f"(at {err!r})")
        return checked
    base = root.resolve()
    entries = [root / shards.MANIFEST] + [root / split for split in shards.SPLITS]
    entries += [f.path.with_suffix(".json") for f in checked.files if f.kind == "tokens"]
    for path in entries:
        checked.problems += entry_problems(path, base, prepared, None)
    for listed in checked.files:
        found = entry_problems(listed.path, base, prepared, listed.size)
        checked.problems += found
        if not found:
            checked.seen[str(listed.path)] = shards.file_identity(os.stat(listed.path))
    return checked


def cache_root_problems(prepared: Prepared) -> list[str]:
    """The cache entry itself, by the rules every cache entry follows (trainer/cache/entries.py)."""
    return entries.entry_problems(prepared.path, prepared.trust_others)


def identity_problems(prepared: Prepared, manifest: dict) -> list[str]:
    """A cache entry's manifest records the identity (source content, tokenizer, settings) its key was derived
    from: an entry whose record differs holds something else than what this run asked for."""
    expected = json.loads(json.dumps(prepared.expected, sort_keys=True))
    recorded = manifest.get("identity")
    if recorded == expected:
        return []
    recorded = recorded if isinstance(recorded, dict) else {}
    differs = sorted(k for k in set(expected) | set(recorded) if recorded.get(k) != expected.get(k))
    return [f"{prepared.path / shards.MANIFEST} records another {', '.join(differs) or 'identity'} than this run's "
            f"key {prepared.path.name} stands for ({prepared.source} as it is now, this tokenizer and these data "
            f"settings): another corpus or setting was filed under this run's key"]


def listed_files(root: Path, manifest: dict, problems: list[str]) -> list[Listed]:
    """Every shard file the manifest lists, with the counts checked against each other and the shard markers."""
    dtype = np.dtype(manifest["dtype"])
    if dtype.name not in ("uint16", "uint32") or dtype.name != shards.token_dtype(int(manifest["vocab_size"])).name:
        problems.append(f"{root / shards.MANIFEST}: dtype {dtype.name} is not the one prepare writes for a vocabulary "
                        f"of {manifest['vocab_size']:,} tokens")
        return []
    wanted = {"tokens", "docs"} | ({"labels"} if manifest["task"] != "pretrain" else set())
    listed = []
    for split in shards.SPLITS:
        info = manifest["splits"][split]
        entries = info["shards"]
        where = f"{root / shards.MANIFEST} ({split}"
        for index, entry in enumerate(entries):
            stem = root / split / f"{index:05d}"
            tokens, documents = int(entry["tokens"]), int(entry["documents"])
            sizes = {"tokens": tokens * dtype.itemsize, "docs": documents * 8, "labels": tokens}
            if manifest["task"] == "preference" and documents != 2 * int(entry.get("records", -1)):
                problems.append(f"{where} shard {index}) holds {documents:,} documents for {entry.get('records')} "
                                f"preference records; each record is two (chosen, rejected)")
            if set(entry["files"]) != wanted:
                problems.append(f"{where} shard {index}) lists {sorted(entry['files'])}, a {manifest['task']} shard "
                                f"has {sorted(wanted)}")
            for kind in sorted(wanted & set(entry["files"])):
                record = entry["files"][kind]
                if int(record["bytes"]) != sizes[kind]:
                    problems.append(f"{where} shard {index}) records {int(record['bytes']):,} bytes of {kind} for "
                                    f"{tokens:,} tokens in {documents:,} documents; those counts take {sizes[kind]:,}")
                    continue
                listed.append(Listed(stem.with_suffix(f".{kind}"), kind, ITEM[kind] or dtype, sizes[kind],
                                     str(record["sha256"]), tokens))
            problems += marker_problems(stem.with_suffix(".json"), entry)
        for total in ("tokens", "documents"):
            counted = sum(int(e[total]) for e in entries)
            if int(info[total]) != counted:
                problems.append(f"{where}) records {int(info[total]):,} {total} in all, its shards {counted:,}")
    return listed


def marker_problems(marker: Path, entry: dict) -> list[str]:
    """A shard's .json marker is the record written with it; the manifest's entry must say the same."""
    if not marker.is_file() or marker.stat().st_size > 1 << 20:
        return [] if not marker.is_file() else [f"{marker} is {marker.stat().st_size:,} bytes, not a shard marker"]
    try:
        written = json.loads(marker.read_text())
    except (OSError, ValueError):
        written = None
    if written != entry:
        return [f"{marker} does not say what the manifest says of this shard (one of them was edited)"]
    return []


def entry_problems(path: Path, base: Path, prepared: Prepared, size: Optional[int]) -> list[str]:
    """A directory entry of the prepared data: where a link leads, its owner and mode (cache), its size (shards)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return [f"{path} is missing"]
    if stat.S_ISLNK(info.st_mode):
        target = path.resolve()
        if prepared.cached:
            return [f"{path} is a symbolic link to {target}: the cache writes none"]
        if not target.is_relative_to(base):
            return [f"{path} is a symbolic link to {target}, outside {base}: copy the file in, or prepare again"]
        if not target.exists():
            return [f"{path} is a link to {target}, which is missing"]
        info = os.stat(path)
    problems = entries.owner_problems(path, info, prepared.trust_others) if prepared.cached else []
    if size is not None:
        if not stat.S_ISREG(info.st_mode):
            return problems + [f"{path} is not a regular file"]
        if info.st_size != size:
            problems.append(f"{path} has {info.st_size:,} bytes, the manifest says {size:,}")
    return problems


# --- reading the bytes ----------------------------------------------------------------------------------------------

def read_files(files: list[Listed], seen: dict[str, tuple], vocab: int) -> list[str]:
    """Hash and scan this rank's share of the files, a few at a time (hashlib and numpy release the GIL)."""
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
    workers = max(1, min(4, (os.cpu_count() or 1) // max(local_ranks, 1)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        found = pool.map(lambda f: read_file_safely(f, seen[str(f.path)], vocab), files)
        return [problem for problems in found for problem in problems]


def read_file_safely(listed: Listed, identity: tuple, vocab: int) -> list[str]:
    try:
        return read_file(listed, identity, vocab)
    except OSError as err:  # reported on every rank by verify_all, like any other problem of the file
        return [f"{listed.path} cannot be read ({err.strerror or err})"]


def read_file(listed: Listed, identity: tuple, vocab: int) -> list[str]:
    """One file's SHA-256 and, in the same read, its values: token ids < vocab, document ends never decreasing
    and ending at the token count, a loss mask of 0 and 1."""
    digest, position, last_end, bad = hashlib.sha256(), 0, 0, None
    limit = {"tokens": vocab, "labels": 2}.get(listed.kind)
    with open(listed.path, "rb") as handle:
        if shards.file_identity(os.fstat(handle.fileno())) != identity:
            return [f"{listed.path} changed while it was being checked"]
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
            values = np.frombuffer(chunk, dtype=listed.dtype)
            if bad is None and limit is not None and int(values.max()) >= limit:
                at = int(np.argmax(values >= limit))
                bad = (position + at, int(values[at]))
            elif bad is None and listed.kind == "docs":
                steps = np.diff(values, prepend=np.int64(last_end))
                if (steps < 0).any():
                    at = int(np.argmax(steps < 0))
                    bad = (position + at, int(values[at]))
                last_end = int(values[-1])
            position += len(values)
    problems = []
    if digest.hexdigest() != listed.sha256:
        problems.append(f"{listed.path} has SHA-256 {digest.hexdigest()[:16]}..., the manifest records "
                        f"{listed.sha256[:16]}... (the size matches: its bytes were changed after preparation)")
    if bad is not None:
        offset, value = bad
        problems.append({
            "tokens": f"{listed.path}: token id {value:,} at offset {offset:,} (byte "
                      f"{offset * listed.dtype.itemsize:,}) is outside the vocabulary of {vocab:,} tokens",
            "docs": f"{listed.path}: document end {value:,} at entry {offset:,} is before the end of the document "
                    f"before it (or below 0)",
            "labels": f"{listed.path}: loss-mask value {value} at offset {offset:,} (0 or 1 expected)"}[listed.kind])
    elif listed.kind == "docs" and last_end != listed.tokens:
        problems.append(f"{listed.path}: the last document ends at token {last_end:,}, the shard has "
                        f"{listed.tokens:,} tokens")
    return problems
