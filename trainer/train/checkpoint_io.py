"""How a checkpoint's bytes reach the disk and come back, at the disk's speed.

DeepSpeed writes and reads every file of a checkpoint through its checkpoint engine (`engine.checkpoint_engine`:
torch.save/torch.load for train.checkpoint_writer=torch). `install` puts `StreamingCheckpointEngine` in its place:

- **Hashed while written (one pass).** torch.save streams into `HashingFile`, which hashes each slice (SHA-256) right
  before writing it, while the slice is still in the CPU's cache; the manifest takes the digest from the writer and
  never reads the file again. (Hashing from the page cache after the file is closed reads every byte a second time.)
- **Written back while serialized.** Every `WRITEBACK_BYTES` the file's new pages are handed to the disk
  (sync_file_range, Linux) while torch.save goes on producing the next ones, so the fsync at the end waits only for
  the tail instead of the whole file.
- **Loaded from the mapping.** A load maps the file (torch.load mmap=True) instead of copying every tensor into
  freshly allocated memory, which is most of the cost of a load from the page cache, and unpickles it with
  weights_only=True and only DeepSpeed's own state classes -- the rule the vetting (integrity.py) applies, so a file
  replaced after it was vetted still cannot run code. Tensors DeepSpeed keeps as loaded instead of copying them into
  its own buffers (a torch optimizer's `load_state_dict` keeps them) are then copied off the mapping, into the state
  tensors the optimizer had (`loading`): no tensor of the run keeps a checkpoint file open after retention deletes it.

Other writers (DeepSpeed's FAST and decoupled engines) are left as they are; their files are hashed after they are
written (integrity.build_manifest).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

from . import integrity

SLICE_BYTES = 4 << 20        # hashed then written while still in the CPU's cache
WRITEBACK_BYTES = 64 << 20   # how much a file may grow before its new pages are handed to the disk


def install(engine, checksums: bool = True) -> Optional["StreamingCheckpointEngine"]:
    """The engine's streaming checkpoint engine, put in place of DeepSpeed's torch.save engine on first use;
    None when the run chose another writer (train.checkpoint_writer=fast/decoupled)."""
    current = engine.checkpoint_engine
    if type(current) is TorchCheckpointEngine:  # exactly DeepSpeed's: a subclass of ours or anyone's is kept
        current = StreamingCheckpointEngine(current.zipfile_serialization)
        engine.checkpoint_engine = current
    if not isinstance(current, StreamingCheckpointEngine):
        return None
    current.checksums = checksums
    return current


class StreamingCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's torch.save engine, writing through `HashingFile` and loading through a weights-only mapping."""

    def __init__(self, zipfile_serialization: bool = True):
        super().__init__(None)
        self.name = "StreamingCheckpointEngine"
        self.zipfile_serialization = zipfile_serialization
        self.checksums = True
        self.written: dict[str, dict] = {}      # absolute path -> {"bytes": n, "sha256": hex} of this rank's saves
        self._mapped: list[tuple[int, int]] = []  # address ranges of the files `load` mapped

    def save(self, state_dict, path: str) -> None:
        with open(path, "wb") as handle:
            stream = HashingFile(handle, self.checksums)
            torch.save(state_dict, stream, _use_new_zipfile_serialization=self.zipfile_serialization)
            self.written[os.path.abspath(path)] = stream.close()

    def take_written(self) -> dict[str, dict]:
        """What this rank wrote since the last call: {absolute path: manifest entry}."""
        written, self.written = self.written, {}
        return written

    def load(self, path: str, map_location=None):
        with torch.serialization.safe_globals(integrity.deepspeed_state_classes()):
            try:
                loaded = torch.load(path, map_location=map_location, weights_only=True, mmap=True)
            except RuntimeError as err:
                if "mmap" not in str(err):
                    raise
                return torch.load(path, map_location=map_location, weights_only=True)  # legacy (non-zip) format
        self._mapped += _address_ranges(loaded)
        return loaded

    @contextmanager
    def loading(self, engine):
        """Around `engine.load_checkpoint`: afterwards no tensor of the engine's optimizers lies in a file `load`
        mapped. DeepSpeed copies weights and ZeRO partitions into its own buffers, but a torch optimizer's
        `load_state_dict` keeps the loaded state tensors: those are copied into the state tensors the optimizer had
        before (ZeRO creates them at initialize: memory already in use, nothing new to allocate), or into new ones."""
        before = _state_tensors(engine)
        self._mapped = []
        try:
            yield
        finally:
            ranges, self._mapped = _merged(self._mapped), []
            if ranges:
                _copy_off(engine, ranges, before)


class HashingFile:
    """A write-only stream over an open binary file: hashes each slice before writing it, hands the pages written so
    far to the disk every WRITEBACK_BYTES, and on `close` flushes and fsyncs. torch.save writes to it sequentially
    (the zip writer refuses to seek), so the digest is the file's."""

    def __init__(self, handle, checksums: bool = True):
        self.handle = handle
        self.digest = hashlib.sha256() if checksums else None
        self.size = 0
        self._handed_to_disk = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), SLICE_BYTES):
            piece = view[start:start + SLICE_BYTES]
            if self.digest is not None:
                self.digest.update(piece)  # releases the GIL: other ranks' threads and the disk keep going
            self.handle.write(piece)
        self.size += len(view)
        if self.size - self._handed_to_disk >= WRITEBACK_BYTES:
            self.handle.flush()
            start_writeback(self.handle.fileno(), self._handed_to_disk, self.size - self._handed_to_disk)
            self._handed_to_disk = self.size
        return len(view)

    def flush(self) -> None:
        pass  # torch.save flushes at the end; `close` makes it durable

    def close(self) -> dict:
        """Flush and fsync; the file's manifest entry."""
        self.handle.flush()
        os.fsync(self.handle.fileno())
        return {"bytes": self.size, **({"sha256": self.digest.hexdigest()} if self.digest is not None else {})}


# --- write-back ------------------------------------------------------------------------------------

_SYNC_FILE_RANGE_WRITE = 2  # start write-back of the range's dirty pages, do not wait (linux/fs.h)


def _libc_sync_file_range():
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None  # not Linux: the fsync at the end does all the writing
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return function


_sync_file_range = _libc_sync_file_range()


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing [offset, offset+length) of `fd` now (a hint: the fsync at the end is what
    makes the file durable)."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


# --- which tensors still lie in a mapped file ------------------------------------------------------------

def _address_ranges(loaded) -> list[tuple[int, int]]:
    """[start, end) of the storages of every tensor in a loaded checkpoint (nested dicts, lists, tuples)."""
    ranges, stack = [], [loaded]
    while stack:
        item = stack.pop()
        if torch.is_tensor(item):
            storage = item.untyped_storage()
            if storage.device.type == "cpu" and storage.nbytes():
                ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return ranges


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _inside(tensor, ranges: list[tuple[int, int]]) -> bool:
    storage = tensor.untyped_storage()
    if storage.device.type != "cpu" or not storage.nbytes():
        return False
    address = storage.data_ptr()
    return any(start <= address < end for start, end in ranges)


def _state_tensors(engine) -> dict:
    """{(optimizer, parameter, key) ids: tensor} of the state the engine's torch optimizers hold now."""
    return {(id(optimizer), id(param), key): value for optimizer in _torch_optimizers(engine.optimizer)
            for param, state in optimizer.state.items() for key, value in state.items() if torch.is_tensor(value)}


def _copy_off(engine, ranges: list[tuple[int, int]], before: dict) -> None:
    for optimizer in _torch_optimizers(engine.optimizer):
        for param, state in optimizer.state.items():
            for key, value in list(state.items()):
                if torch.is_tensor(value) and _inside(value, ranges):
                    old = before.get((id(optimizer), id(param), key))
                    reusable = (old is not None and old.shape == value.shape and old.dtype == value.dtype
                                and old.device == value.device and not _inside(old, ranges))
                    state[key] = old.copy_(value) if reusable else value.clone()
        for group in optimizer.param_groups:
            for key, value in list(group.items()):
                if torch.is_tensor(value) and _inside(value, ranges):
                    group[key] = value.clone()


def _torch_optimizers(optimizer) -> list:
    """The torch optimizers inside DeepSpeed's wrappers (ZeRO, BF16/FP16 optimizers keep theirs in `.optimizer`)."""
    found, seen = [], set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        if isinstance(optimizer, torch.optim.Optimizer):
            found.append(optimizer)
        optimizer = getattr(optimizer, "optimizer", None)
    return found


def relative_entries(written: dict[str, dict], root: Path) -> dict[str, dict]:
    """`written` keyed by path relative to `root` (the files under it only)."""
    base = os.path.abspath(root)
    return {os.path.relpath(path, base): entry for path, entry in written.items()
            if path.startswith(base + os.sep)}
