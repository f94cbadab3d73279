"""An entry of the cache: a directory `<data.cache_dir>/<kind>/<key>` filled once, then only read.

Filling (`fill`): into a fresh sibling made by mkdtemp (a new random name, created exclusively: never a directory
or link someone planted under a predictable name), renamed to the key when whole, so two jobs filling one key never
see half an entry; files inside are created with O_EXCL | O_NOFOLLOW (`write_file`): a planted name is an error,
never followed. Only what the call created is ever removed.

Using: an entry is a directory of this user's (data.trust_shared_cache accepts other owners), not a link, not
writable by every user, in a directory nobody else can empty (world-writable only with the sticky bit); each file
the same, and a regular file (`entry_problems`, `file_problems`). Arrays are read with their dtype, shape and
finiteness checked, the file named (`read_array`). Every check returns problems (a collective caller gathers them
from every rank) or raises a CacheError that names the path and the fix.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..files import current_umask
from .errors import CacheError

INPUTS = "inputs.json"  # an entry's record of the key's inputs (keys.canonical): what it was filled for


# --- where entries may live ---------------------------------------------------------------------------------------

def check_parent(parent: Path) -> None:
    """A cache directory every user may write without the sticky bit lets any of them rename or replace this
    run's entries (and its temporary directory while it is filled): refused."""
    problem = parent_problem(parent)
    if problem:
        raise CacheError(f"data.cache_dir {problem}")


def parent_problem(parent: Path) -> Optional[str]:
    mode = os.stat(parent).st_mode
    if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
        return (f"{parent} can be written by every user and has no sticky bit, so anyone can replace the entries in "
                f"it: set the sticky bit (chmod +t {parent}, as /tmp has), or use a directory of your own "
                f"(data.cache_dir)")
    return None


def owner_problems(path: Path, info: os.stat_result, trust_others: bool) -> list[str]:
    problems = []
    if info.st_uid != os.getuid() and not trust_others:
        problems.append(f"{path} belongs to user id {info.st_uid}, not to you ({os.getuid()}): whoever can write it "
                        f"chooses what this run reads")
    if info.st_mode & stat.S_IWOTH and not stat.S_ISLNK(info.st_mode):
        problems.append(f"{path} can be written by every user (mode {stat.filemode(info.st_mode)})")
    return problems


def entry_problems(root: Path, trust_others: bool = False) -> list[str]:
    """The entry directory itself: a directory of this user's (the cache renames its own directories into place,
    never a link), in a cache directory nobody else can empty."""
    info, problems = _found_as(root, stat.S_ISDIR, "a directory (a cache entry is one)", "the cache holds "
                                                                                         "directories, never links")
    if info is None:
        return problems
    problem = parent_problem(root.parent)
    return owner_problems(root, info, trust_others) + ([problem] if problem else [])


def file_problems(path: Path, trust_others: bool = False) -> list[str]:
    """A file of an entry: there, a regular file (not a link: the cache writes none), owned and moded as above."""
    info, problems = _found_as(path, stat.S_ISREG, "a regular file", "the cache writes none")
    return problems if info is None else owner_problems(path, info, trust_others)


def _found_as(path: Path, is_kind, kind: str, no_links: str) -> tuple[Optional[os.stat_result], list[str]]:
    """(its lstat, []) when `path` is there as `kind`, else (None, [what it is instead])."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None, [f"{path} is missing"]
    if stat.S_ISLNK(info.st_mode):
        return None, [f"{path} is a symbolic link to {path.resolve()}: {no_links}"]
    if not is_kind(info.st_mode):
        return None, [f"{path} is not {kind}"]
    return info, []


# --- filling ------------------------------------------------------------------------------------------------------

def fill(path: Path, write: Callable[[Path], None]) -> None:
    """Fill the entry `path` by `write(directory)` into a fresh temporary sibling, then rename it into place. When
    another job renamed its copy first, that entry stays (the same inputs, so the same bytes): the caller checks
    whatever is at `path` next."""
    parent = path.parent
    parent.mkdir(parents=True, exist_ok=True)
    check_parent(parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent))
    try:
        os.chmod(tmp, 0o755 & ~current_umask())  # mkdtemp's 0700 would hide the entry from a shared cache's users
        write(tmp)
        try:
            os.rename(tmp, path)
        except OSError:
            if not os.path.lexists(path):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def create_new(path: Path, replace_leftover: bool = False) -> int:
    """A descriptor of the file `path` created now (O_EXCL: never one that was there; O_NOFOLLOW: never through a
    link). `replace_leftover`: a temporary name an interrupted run left is unlinked first (a link is removed, never
    followed); a name planted again in between is then an error, not a file written elsewhere."""
    if replace_leftover:
        try:
            os.unlink(path)
        except (FileNotFoundError, IsADirectoryError):
            pass  # nothing left, or a directory: then O_EXCL refuses the name below
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o666)


def write_file(path: Path, data: bytes) -> None:
    """Create `path` (`create_new`: a planted name is an error), write and fsync it."""
    fd = create_new(path)
    with open(fd, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def write_array(path: Path, values: np.ndarray) -> None:
    """`values` as a .npy file (no pickles), created as `write_file` creates files; NaN or infinity is refused
    here, where the computation that made it is known, not at the next run's read."""
    if values.dtype.kind == "f" and not np.isfinite(values).all():
        bad = int(np.argmax(~np.isfinite(values).reshape(-1)))
        raise CacheError(f"{path.name}: value {values.reshape(-1)[bad]} at flat index {bad} is not finite; nothing "
                         f"was cached (the model that computed it gives NaN or infinity on this data)")
    import io
    buffer = io.BytesIO()
    np.save(buffer, values, allow_pickle=False)
    write_file(path, buffer.getvalue())


def record_inputs(directory: Path, canonical_inputs: str) -> None:
    write_file(directory / INPUTS, canonical_inputs.encode())


# --- reading ------------------------------------------------------------------------------------------------------

def inputs_problems(root: Path, canonical_inputs: str, trust_others: bool = False) -> list[str]:
    """The entry's recorded inputs must be the ones its key stands for: another entry copied or renamed under this
    key holds values of other inputs."""
    path = root / INPUTS
    problems = file_problems(path, trust_others)
    if problems:
        return problems
    try:
        recorded = json.loads(read_small(path))
    except (OSError, ValueError):
        recorded = None
    if recorded != json.loads(canonical_inputs):
        expected = dict(json.loads(canonical_inputs))
        found = dict(recorded) if isinstance(recorded, list) and all(
            isinstance(p, list) and len(p) == 2 for p in recorded) else {}
        differs = sorted(k for k in set(expected) | set(found) if found.get(k) != expected.get(k))
        return [f"{path} records other inputs ({', '.join(differs) or 'unreadable'}) than the key {root.name} stands "
                f"for: another entry was filed under this key"]
    return []


def read_small(path: Path, limit: int = 16 << 20) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with open(fd, "rb") as handle:
        return handle.read(limit + 1)[:limit]


def read_array(path: Path, dtype: np.dtype, shape: tuple, trust_others: bool = False) -> np.ndarray:
    """The array of the .npy file `path`, refused (a CacheError naming the file and what differs) when the file is
    not the cache's (a link, another owner) or holds another dtype, shape, or a value that is not finite."""
    problems = file_problems(path, trust_others)
    if problems:
        raise CacheError("; ".join(problems))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with open(fd, "rb") as handle:
            values = np.load(handle, allow_pickle=False)
    except (OSError, ValueError, EOFError) as err:
        raise CacheError(f"{path}: not a readable array ({err})") from None
    wanted = np.dtype(dtype)
    if values.dtype != wanted or values.shape != tuple(shape):
        raise CacheError(f"{path} holds {values.dtype} values of shape {values.shape}, {wanted} of shape "
                         f"{tuple(shape)} are expected")
    if values.dtype.kind == "f" and not np.isfinite(values).all():
        bad = int(np.argmax(~np.isfinite(values).reshape(-1)))
        raise CacheError(f"{path}: value {values.reshape(-1)[bad]} at flat index {bad} is not finite")
    return values
