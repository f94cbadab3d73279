"""What a run directory (train.output_dir) holds, and the one rule for starting a run in one that is not empty:
nothing a user already has is overwritten.

A fresh start (nothing resumed) in a directory that holds a previous run moves that whole run -- checkpoints,
`hf/`, configs, metrics, trackers' files, whatever else lies there -- to `previous/<UTC time>/` inside the same
directory (a rename: instant, no copy, never deleted), and says so with its size. A directory that holds files but
no run (a home directory, a model directory typed by mistake) is refused: moving someone else's files is not ours to
do. Every command that writes a run directory applies it before its first write: `launch` (a fresh launch, before
launch.json) and the training itself (after every check that can refuse the run, before config.resolved.yaml).
"""
from __future__ import annotations

import fnmatch
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError

PREVIOUS = "previous"  # <run>/previous/<time>/: earlier runs of this directory, set aside whole
# What exists only in a run directory a training has written (the first is written at every start)
RUN_MARKERS = ("config.resolved.yaml", "configs", "metrics.jsonl", "checkpoints", "hf")
# Written for this start before the training begins, by whoever starts it: the launch (trainer/launch: its record,
# the sbatch script, the DeepSpeed env file, each Slurm job's log and hostfile) and the rehearsal (train/rehearse.py:
# its shrunk model, tokenizer and NVMe folder). The training keeps them where they are; a fresh `launch` moves the
# previous launch's with the rest of the run.
STARTUP_FILES = ("launch.json", "job.sbatch", "deepspeed_env", "slurm-*.out", "hostfile.*",
                 "base_model", "tokenizer_without_chat_template", "nvme")
# The startup files only this trainer's launch writes: a launch that failed before its training wrote anything left
# a run directory all the same (launching again sets it aside), not somebody else's files
LAUNCH_RECORDS = ("launch.json", "job.sbatch")
PROBE = ".write_test"  # the training's writability probe (train/run.py), never a run's


@dataclass(frozen=True)
class SetAside:
    """A previous run moved out of the way: where it went, what it was and how much disk it keeps."""
    run_dir: Path
    destination: Path
    names: tuple[str, ...]
    size_bytes: int

    def message(self, who: str) -> str:
        shown = ", ".join(self.names[:8]) + (", ..." if len(self.names) > 8 else "")
        return (f"{who}: starting fresh in {self.run_dir}, which held a previous run ({shown}): moved whole to "
                f"{self.destination}/ ({self.size_bytes / 2**20:.0f} MB, not deleted). --resume auto would have "
                f"continued it; delete {self.run_dir / PREVIOUS} to free the disk")


def is_startup_file(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in STARTUP_FILES)


def previous_run(run_dir: Path, keep_startup_files: bool) -> list[Path]:
    """The entries of `run_dir` that a fresh start would set aside (empty: nothing to move)."""
    if not run_dir.is_dir():
        return []
    return sorted(p for p in run_dir.iterdir() if p.name not in (PREVIOUS, PROBE)
                  and not (keep_startup_files and is_startup_file(p.name)))


def check_not_foreign(run_dir: Path, entries: list[Path]) -> None:
    """A directory with files but none of a run's is somebody else's: refused, with the way out."""
    if entries and not any(p.name in RUN_MARKERS + LAUNCH_RECORDS for p in entries):
        names = ", ".join(p.name for p in entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise UserError(f"train.output_dir {str(run_dir)!r} holds files that no run of this trainer wrote ({names}); "
                        f"a run would write among them: give the run its own directory (--set train.output_dir="
                        f"runs/NAME, new or empty)")


def set_aside_previous_run(run_dir: Path, keep_startup_files: bool = True) -> SetAside | None:
    """Move a previous run in `run_dir` to `previous/<time>/` (None: there was none). Refuses a directory that holds
    files but no run. `keep_startup_files`: the training keeps what its launch or rehearsal wrote for this start."""
    entries = previous_run(run_dir, keep_startup_files)
    if not entries:
        return None
    check_not_foreign(run_dir, entries)
    destination = free_name(run_dir / PREVIOUS / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()))
    destination.mkdir(parents=True)
    size = sum(bytes_under(p) for p in entries)
    for entry in entries:
        try:
            os.rename(entry, destination / entry.name)  # same directory tree: a rename, never a copy
        except OSError as err:
            raise UserError(f"train.output_dir {str(run_dir)!r}: cannot move {entry.name} of the previous run to "
                            f"{destination} ({err.strerror}); move it yourself or choose another train.output_dir"
                            ) from None
    return SetAside(run_dir, destination, tuple(p.name for p in entries), size)


def free_name(path: Path) -> Path:
    """`path`, or `path-2`, `path-3`, ... when two fresh starts fall in one second."""
    candidate, number = path, 1
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.name}-{number}")
    return candidate


def bytes_under(path: Path) -> int:
    """The bytes a file or directory holds on disk (links not followed)."""
    if path.is_symlink() or not path.is_dir():
        return path.lstat().st_size if path.is_file() and not path.is_symlink() else 0
    return sum(f.lstat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
