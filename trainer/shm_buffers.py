"""DeepSpeed's CPU shared-memory all-reduce buffers (69 MB per rank in /dev/shm, i.e. RAM), which DeepSpeed 0.19.8
creates for every multi-rank CPU job and never unlinks. Their names (its shm.cpp: uid_addr_port_rank) are written
in one place here, for the three that remove them: a rank at a clean exit (trainer.distributed), a launcher whose
ranks crashed (trainer.launch.supervisor: a killed rank runs no clean-up), and the test harness after the jobs it
stopped. Imports nothing heavy: the launcher is a light command."""
from __future__ import annotations

import os
from pathlib import Path

SHM = Path("/dev/shm")
PREFIX = "deepspeed_allreduce_buffer"


def buffer_path(master_addr: str, master_port, rank) -> Path:
    """The buffer that rank `rank` of the job rendezvousing at master_addr:master_port leaves behind."""
    return SHM / f"{PREFIX}_{os.getuid()}_{master_addr}_{master_port}_{rank}"


def remove(paths) -> int:
    """Unlink `paths`, ignoring those already gone (or not ours); returns how many were removed."""
    removed = 0
    for path in paths:
        try:
            Path(path).unlink()
            removed += 1
        except (FileNotFoundError, PermissionError, IsADirectoryError):
            pass
    return removed


def job_buffers(master_port, master_addr: str = "*") -> list[Path]:
    """Every rank's buffer of the job(s) on `master_port` (any address unless one is given)."""
    return sorted(SHM.glob(f"{PREFIX}_{os.getuid()}_{master_addr}_{master_port}_*"))
