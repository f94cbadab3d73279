"""An op built before is reused when what it was built from is unchanged, even if its files are new.

ninja decides by modification times. A virtualenv made again at the same path (`rm -rf .venv && scripts/setup.sh`,
or a CI machine that keeps its home but installs afresh) gives every DeepSpeed source a new mtime with the same
bytes, and ninja rebuilds every op (~8 min on 2 cores, async_io alone ~5). So after each build the content of what
ninja tracks - the op's build.ninja (compiler, flags, include paths) and every input its depfiles name - is recorded
beside the op (`MANIFEST`), with their times. Before the next load, if every recorded input still has its recorded
content but a newer time, those inputs get back the times they had at the build: ninja then loads the op as built.
(Stamping the outputs instead would not do: ninja's depfile records hold the outputs' times and call newer outputs
stale.) Anything else - a changed byte, a missing input, a build.ninja that torch rewrites because a flag or path
changed - leaves ninja to rebuild as before. This trusts exactly what ninja trusts: it tracks no more (`-isystem`
headers such as torch's are not in its depfiles either).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import subprocess
from pathlib import Path
from typing import Optional

MANIFEST = "inputs.sha256.json"  # {"build.ninja": sha256, "inputs": {path: [sha256, mtime_ns at the build]}}
LOCK = "reuse.lock"  # an flock: released by the kernel when its holder dies, so it can never be left stale


def digest(path: Path) -> Optional[str]:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def tracked_inputs(directory: Path, ninja: str) -> Optional[list[Path]]:
    """Every input ninja's depfiles recorded for the op's objects (its sources and their headers)."""
    try:
        listing = subprocess.run([ninja, "-C", str(directory), "-t", "deps"], capture_output=True, text=True,
                                 timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    inputs = sorted({line.strip() for line in listing.splitlines() if line.startswith("    ")})
    return [Path(p) if os.path.isabs(p) else directory / p for p in inputs] or None


def record(directory: Path, name: str, ninja: str) -> None:
    """After a load that found the op built (or built it): the content and time of what it was built from."""
    inputs = tracked_inputs(directory, ninja)
    build_file = digest(directory / "build.ninja")
    if inputs is None or build_file is None or not (directory / f"{name}.so").is_file():
        return
    try:
        seen = {str(p): [digest(p), p.stat().st_mtime_ns] for p in inputs}
    except OSError:
        return
    if any(sha is None for sha, _ in seen.values()):
        return
    manifest = json.dumps({"build.ninja": build_file, "inputs": seen}, indent=1, sort_keys=True) + "\n"
    target = directory / MANIFEST
    with contextlib.suppress(OSError):
        if target.read_text() == manifest:
            return
    with contextlib.suppress(OSError):
        temporary = target.with_name(f".{MANIFEST}.{os.getpid()}")
        temporary.write_text(manifest)
        os.replace(temporary, target)


def reinstalled_unchanged(directory: Path, name: str) -> Optional[dict]:
    """{input: the mtime it had at the build} when every recorded input has its recorded content and some has a
    newer time than then; None otherwise (nothing recorded, anything changed, or nothing to do)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        recorded = {Path(p): (str(sha), int(mtime)) for p, (sha, mtime) in manifest["inputs"].items()}
        build_file = manifest["build.ninja"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not recorded or not (directory / f"{name}.so").is_file() or digest(directory / "build.ninja") != build_file:
        return None
    if any(digest(path) != sha for path, (sha, _) in recorded.items()):
        return None
    moved = {path: mtime for path, (_, mtime) in recorded.items() if path.stat().st_mtime_ns != mtime}
    return moved or None


def reuse_if_unchanged(directory: Path, name: str, ninja: str) -> bool:
    """True when the op's inputs had only new times: they get back the times they had at the build, which is what
    ninja compares (its log and its depfile records hold the outputs' times, so the outputs are left alone). Every
    rank of a node calls this before its load, one at a time, so no rank reaches ninja before the times are back."""
    if not (directory / MANIFEST).is_file():
        return False
    with open(directory / LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            moved = reinstalled_unchanged(directory, name)
            if moved is None:
                return False
            for path, mtime in moved.items():
                os.utime(path, ns=(path.stat().st_atime_ns, mtime))
            return True
        except OSError:  # an input this user may not stamp: ninja decides, as without the record
            return False
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
