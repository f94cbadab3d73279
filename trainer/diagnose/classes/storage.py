"""A write the file system refused for want of room (ENOSPC "No space left on device", EDQUOT "Disk quota
exceeded"): the remedy is a larger disk for *that* writer, so the class finds which writer it was before it says
anything - the path the message names, else the code that was writing (the frames nearest the error, innermost
first). A DataLoader's semaphore and a torch tensor shared between processes live in /dev/shm (a container's 64 MB);
the datasets library's Arrow files in its cache (~/.cache/huggingface/datasets, on a system disk of 10 GB in
many cloud images); checkpoints in the run directory; JIT builds in the extensions cache; temporary files in /tmp.
Each writer is moved by its own setting, which the proposal names; a writer the log does not show gets the check
that finds it (`df -h` on each place the run writes).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from .. import oserror
from ..findings import Diagnosis, Found, Proposal
from ..logtext import Log
from ..raised import FRAME_LINE

NO_ROOM_KINDS = {"no_space"}
# EIO on a write: the device failed it - on network and overlay file systems most often because it is full, else a
# failing disk; read as a write only when the line says so (a read's EIO is another story)
WRITE = re.compile(r"\bwrite\b|\bwriting\b|\bsave|\bflush", re.IGNORECASE)
PATH = re.compile(r"""['"](/[^'"\s]+)['"]|(?:\bto|\bin|\bat|\bfile|\bpath|:)\s+(/[\w./~+-]+)""")
NEAR = 40  # lines around the error searched for the writer's frames


@dataclass(frozen=True)
class Writer:
    name: str
    paths: re.Pattern    # a path the message names that belongs to this writer
    frames: re.Pattern   # a frame's file (or function) that is this writer writing
    step: str
    reason: str
    env: tuple[tuple[str, str], ...] = ()


WRITERS = (
    Writer("shared memory (/dev/shm)",
           re.compile(r"^/dev/shm\b|/torch_\d+_|/psm_"),
           re.compile(r"multiprocessing[\\/](?:synchronize|shared_memory|heap|queues|reduction)\.py|"
                      r"torch[\\/]multiprocessing[\\/]|SemLock|_share_filename|share_memory_|"
                      r"torch[\\/]utils[\\/]data[\\/]_utils[\\/](?:worker|signal_handling)\.py"),
           "give the processes a larger /dev/shm: docker run --shm-size=16g (or --ipc=host)",
           "the failing call creates a shared-memory object (a DataLoader worker's queue or semaphore, a tensor "
           "shared between processes), which lives in /dev/shm, not on the disk: a container's default /dev/shm is "
           "64 MB. Check with `df -h /dev/shm`; on Kubernetes mount an emptyDir with medium: Memory at /dev/shm. "
           "Fewer DataLoader workers (num_workers) need less of it"),
    Writer("the datasets cache",
           re.compile(r"huggingface[\\/]datasets|\.arrow\b|[\\/]datasets[\\/]downloads"),
           re.compile(r"site-packages[\\/]datasets[\\/]|pyarrow[\\/]|pyarrow\.lib|arrow_writer"),
           "put the datasets cache on a larger disk: export HF_DATASETS_CACHE=/path/on/a/larger/disk (and this "
           "trainer's prepared data with --set data.cache_dir=/path/on/a/larger/disk)",
           "the datasets library writes each processed split as Arrow files to its cache, ~/.cache/huggingface/"
           "datasets by default - often a small system disk (`df -h ~/.cache`): HF_DATASETS_CACHE moves it; "
           "`datasets-cli delete-cache` or removing old entries frees what earlier runs left"),
    Writer("the Hugging Face hub cache",
           re.compile(r"huggingface[\\/]hub\b|[\\/]models--"),
           re.compile(r"huggingface_hub[\\/](?:file_download|_snapshot_download)\.py"),
           "put the model downloads on a larger disk: export HF_HOME=/path/on/a/larger/disk",
           "the hub cache holds every downloaded model under ~/.cache/huggingface/hub by default; HF_HOME (or "
           "HF_HUB_CACHE) moves it, `huggingface-cli delete-cache` frees old revisions"),
    Writer("the extensions build cache",
           re.compile(r"torch_extensions|[\\/]\.triton[\\/]"),
           re.compile(r"torch[\\/]utils[\\/]cpp_extension\.py|triton[\\/]"),
           "build the kernels on a larger disk: export TORCH_EXTENSIONS_DIR=/path/on/a/larger/disk "
           "(TRITON_CACHE_DIR for triton's)",
           "JIT-built ops (DeepSpeed's cpu_adam, async_io, ...) and triton kernels are compiled into a cache under "
           "the home directory by default"),
    Writer("the run's checkpoints",
           re.compile(r"checkpoint|global_step\d+|[\\/]runs[\\/]|\.safetensors\b|mp_rank_\d+|optim_states"),
           re.compile(r"torch[\\/]serialization\.py|safetensors[\\/]|deepspeed[\\/]runtime[\\/](?:engine|"
                      r"checkpoint_engine)|save_pretrained|save_checkpoint|save_model|trainer[\\/]train[\\/]"
                      r"checkpoint"),
           "keep fewer checkpoints, on a larger disk: --set train.keep_last=1 and point train.output_dir at a disk "
           "with room for one checkpoint more than you keep",
           "a checkpoint of a ZeRO run holds the optimizer states (about 12 bytes per parameter across the ranks, "
           "plus the weights), written beside the ones kept; `du -sh` the run directory and `df -h` its disk"),
    Writer("temporary files",
           re.compile(r"^/tmp\b|^/var/tmp\b"),
           re.compile(r"tempfile\.py"),
           "put temporary files on a larger disk: export TMPDIR=/path/on/a/larger/disk",
           "Python's tempfile and the libraries on it write to TMPDIR, /tmp when unset - a small or RAM-backed "
           "file system on many nodes"),
)


def find(log: Log) -> Optional[int]:
    """The first line stating that a write found no room."""
    for index in range(len(log.lines)):
        line = log.lines[index]
        if oserror.WORDS.search(line) or oserror.NUMBER.search(line):
            refused = oserror.stated(log, index, before=0, after=0)
            if refused is not None and (refused.kind in NO_ROOM_KINDS or refused.kind == "io_error" and
                                        WRITE.search(line)):
                return index
    return None


def writer_of(log: Log, index: int) -> tuple[Optional[Writer], str]:
    """(the writer, how it was told) from the path the error names, else the nearest frames: those before the
    error first (a traceback prints the innermost frame last, right above the error), then those after it (a
    second rank's traceback interleaved below)."""
    for at in (index, index + 1, index - 1):
        if 0 <= at < len(log.lines):
            for m in PATH.finditer(log.lines[at]):
                path = m.group(1) or m.group(2)
                writer = next((w for w in WRITERS if w.paths.search(path)), None)
                if writer is not None:
                    return writer, f"the path it names, {path}"
    order = [*range(index - 1, max(-1, index - NEAR - 1), -1), *range(index + 1, min(len(log.lines), index + NEAR))]
    for at in order:
        frame = FRAME_LINE.search(log.lines[at])
        where = f"{frame.group('file')} ({frame.group('func')})" if frame else None
        if frame is None and not re.search(r"SemLock|share_memory_", log.lines[at]):
            continue
        writer = next((w for w in WRITERS if w.frames.search(log.lines[at])), None)
        if writer is not None:
            return writer, f"the code that was writing, {where or log.lines[at].strip()[:120]}"
    return None, ""


def diagnose(f: Found) -> Diagnosis:
    refused = oserror.stated(f.log, f.index, before=0, after=0)
    quota = refused is not None and "quota" in refused.words.lower()
    room = "the user's disk quota" if quota else "room on the file system"
    writer, told = writer_of(f.log, f.index)
    if refused is not None and refused.kind == "io_error":
        return _failed_write(f, writer, told)
    if writer is None:
        d = Diagnosis("no_room", f"a write found no {room} (the log does not show which writer)", f.line)
        d.proposal = Proposal("find the full file system and give that writer a larger disk: `df -h` on the run "
                              "directory, ~/.cache, /tmp and /dev/shm", [],
                              f"the system answered '{refused.words if refused else 'No space left on device'}'; "
                              "the run writes checkpoints to train.output_dir, prepared data to data.cache_dir, "
                              "datasets and hub files to ~/.cache/huggingface (HF_DATASETS_CACHE, HF_HOME), JIT "
                              "builds to TORCH_EXTENSIONS_DIR, temporary files to TMPDIR and shared memory to "
                              "/dev/shm: the full one needs a larger disk or its old files removed")
        return d
    d = Diagnosis("no_room", f"{writer.name} found no {room}: told by {told}", f.line)
    d.proposal = Proposal(writer.step, [], writer.reason, env=writer.env)
    if quota:
        d.advice.append("a quota is per user: `quota -s` (or the cluster's own command) shows it; a shared "
                        "scratch file system usually has a larger one")
    return d


def _failed_write(f: Found, writer: Optional[Writer], told: str) -> Diagnosis:
    """EIO on a write: the check that tells a full disk from a failing one first, then the writer's own remedy."""
    what = writer.name if writer else "a write"
    d = Diagnosis("no_room", f"{what} failed at the device (Input/output error)" + (f": told by {told}" if told else ""),
                  f.line)
    then = f"; if it is full: {writer.step}" if writer else ("; if it is full, free space or move the writer to a "
                                                             "larger disk (train.output_dir, data.cache_dir, HF_HOME, "
                                                             "TMPDIR)")
    d.proposal = Proposal(f"check the disk it writes to: `df -h` (full?) and `dmesg | tail` (a failing or network "
                          f"disk){then}", [],
                          "the kernel answered the write with EIO: on network (NFS, Lustre) and overlay file systems "
                          "a full disk is reported this way, otherwise the device or the mount failed; `df -h` on "
                          "the directory tells the two apart")
    return d
