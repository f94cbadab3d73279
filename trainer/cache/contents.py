"""What a local file tree is, by content: the SHA-256 of each of its files, remembered by stat so that a source
or a model's weights are read once, not at every start (nor by every rank).

The cache keys (trainer/cache: prepared data, reference log-probs) are derived from these hashes. Names, sizes and mtimes
(the key before) keep a key through an edit whose mtime was put back (`touch -r`), so a run trained on the stale
cache. Reading a source at every start would cost about 1 s per GB (1.1-1.3 GB/s of SHA-256 on one core of
the development machine, scripts/bench_verify.py), so each file's hash is remembered with the stat fields that
change whenever its bytes can have changed: inode, size, mtime and ctime. The kernel sets ctime on every write, truncate, chmod and rename,
and no user can set it back (utime sets mtime and atime only), so a file that still has the remembered four has
the remembered bytes. A hash is remembered only when the file did not change while it was read and its ctime is
a second old: timestamps are coarser than writes, and a write just after the read could leave all four as they
were (git's "racy" case).

The memo is one JSON file per source in `<cache dir>/.sources-<uid>/` (mode 0700), read only when this user owns
the directory and the file. It is only a shortcut: losing it costs a read of the source, never a wrong key.
"""
from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
import time
from pathlib import Path

from .errors import CacheError

CHUNK = 8 << 20
SETTLED_NS = 1_000_000_000  # a ctime this old cannot be shared with a write still to come


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def stat_key(st: os.stat_result) -> list[int]:
    """What must be unchanged for a remembered hash to hold. Not st_dev: a network file system can give each
    node its own device number for the same file."""
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def content_hashes(root: Path, files: dict[str, Path], cache_dir: Path) -> dict[str, str]:
    """{name: SHA-256} of a source's files (`root`: the source as given, a file or a directory), read only where
    the memo in `cache_dir` does not vouch for them."""
    memo_path = cache_dir / f".sources-{os.getuid()}" / f"{hashlib.sha256(str(root).encode()).hexdigest()[:32]}.json"
    remembered = read_memo(memo_path, str(root))
    kept, hashes = {}, {}
    for name, file in files.items():
        st = file.stat()
        if not stat.S_ISREG(st.st_mode):  # reading a FIFO would wait for a writer forever
            raise CacheError(f"{file}: not a regular file (a FIFO, a device or a socket); give a data file")
        before = stat_key(st)
        entry = remembered.get(name)
        if entry is not None and entry[:4] == before:
            hashes[name], kept[name] = entry[4], entry
            continue
        hashes[name] = sha256_file(file)
        after = file.stat()
        if stat_key(after) == before and time.time_ns() - after.st_ctime_ns >= SETTLED_NS:
            kept[name] = before + [hashes[name]]
    if kept != remembered:
        write_memo(memo_path, {"source": str(root), "files": kept})
    return hashes


def _owned_by_me(st: os.stat_result, kind) -> bool:
    return kind(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def read_memo(path: Path, source: str) -> dict[str, list]:
    """The remembered {name: [inode, size, mtime_ns, ctime_ns, sha256]} of `source`; {} when there is none, or
    when the memo or its directory is not this user's alone (anyone else could have written it)."""
    try:
        if not (_owned_by_me(os.lstat(path.parent), stat.S_ISDIR) and _owned_by_me(os.lstat(path), stat.S_ISREG)):
            return {}
        memo = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(memo, dict) or memo.get("source") != source or not isinstance(memo.get("files"), dict):
        return {}
    return {name: entry for name, entry in memo["files"].items()
            if isinstance(entry, list) and len(entry) == 5 and all(type(v) is int for v in entry[:4])
            and isinstance(entry[4], str)}


def write_memo(path: Path, memo: dict) -> None:
    """Write the memo atomically into this user's own directory. A cache directory that cannot be written is not
    an error here: it only costs a read of the source next time (and fails the preparation, if one is needed)."""
    tmp = None
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _owned_by_me(os.lstat(path.parent), stat.S_ISDIR):
            return
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".memo.", suffix=".tmp")
        with os.fdopen(fd, "w") as handle:
            json.dump(memo, handle)
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
