"""What a checkpoint must prove before any rank loads it, and what a save must prove before it is COMPLETE.

- **Manifest.** A save records every file's size and SHA-256 in `COMPLETE`; a resume checks them, so a
  truncated, missing or bit-flipped file is a named error, not a resume with other weights.
- **No pickled code.** DeepSpeed 0.19.8 loads its files with `torch.load(weights_only=False)`, so a crafted
  file would run code. Which files a rank loads depends on the layout (ZeRO-3 reads its own partition,
  `elastic_checkpoint` makes every rank read every rank's optimizer file, AutoTP names files by
  data/model-parallel rank, universal checkpoints keep one folder per parameter). So *every* file any rank
  could load is opened with `weights_only=True` first, only DeepSpeed's own state classes allowed.
- **All before any.** The ranks split the files between them and exchange their findings in a collective
  (`all_gather_text`), which no rank leaves before every file was checked: nobody loads while another rank
  is still refusing.
- **Finite weights.** A save whose weights hold inf/NaN is refused, so `COMPLETE` means "good to resume".
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

from .. import ranks
from ..distributed import all_gather_text  # noqa: F401 (also used by infer/generate.py)
from ..errors import UserError


MANIFEST_VERSION = 1
PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle", ".ckpt")
NOT_IN_MANIFEST = ("COMPLETE",)  # the manifest itself
_HASH_CHUNK = 8 << 20


class CheckpointError(UserError):
    """A checkpoint that must not be resumed (damaged, incomplete, or holding foreign objects)."""


# --- each rank's share of the files (the ranks agree through trainer.distributed.all_gather_text) ----

def _my_share(items: list, rank: int, world: int) -> list:
    return items[rank::world]


def _my_share_of_bytes(sizes: dict[str, int], rank: int, world: int) -> list[str]:
    """This rank's files when the ranks split `sizes` ({name: bytes}, the same on every rank) into shares of about
    equal bytes: largest first, each to the rank with the fewest bytes so far (a ZeRO-1/2 checkpoint's module file
    is as large as an optimizer partition; a round-robin split by name gives one rank both)."""
    load, mine = [0] * world, []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        target = min(range(world), key=lambda r: (load[r], r))
        load[target] += sizes[name] + 1
        if target == rank:
            mine.append(name)
    return mine


# --- manifest ---------------------------------------------------------------------------------------

def all_files(path: Path) -> list[str]:
    """Every regular file under a checkpoint directory (relative, sorted)."""
    return sorted(str(f.relative_to(path)) for f in path.rglob("*") if f.is_file())


def checkpoint_files(path: Path) -> list[str]:
    """The files a manifest lists: all of them but the manifest itself and temporary files."""
    return [name for name in all_files(path)
            if Path(name).name not in NOT_IN_MANIFEST and not name.endswith(".tmp")]


def symbolic_links(path: Path) -> list[str]:
    """Links inside a checkpoint (relative, sorted). DeepSpeed writes none, and a link can lead a load
    to a file outside the checkpoint, past the vetting of its files."""
    found = []
    for root, dirs, files in os.walk(path):  # does not follow links into directories
        found += [str(Path(root, name).relative_to(path)) for name in dirs + files
                  if os.path.islink(os.path.join(root, name))]
    return sorted(found)


def sha256_file(path: Path) -> str:
    """The file's SHA-256, reading the next chunk while the last one is hashed: a file read from the disk (a resume
    on a node that did not write it) takes about the disk's time instead of the disk's plus the hash's."""
    digest = hashlib.sha256()
    buffers = [bytearray(_HASH_CHUNK), bytearray(_HASH_CHUNK)]  # two buffers for the whole file: no fresh memory
    with open(path, "rb", buffering=0) as handle, ThreadPoolExecutor(max_workers=1) as reader:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)  # a larger read-ahead
        turn = 0
        pending = reader.submit(handle.readinto, buffers[turn])
        while count := pending.result():
            ready, turn = buffers[turn], 1 - turn
            pending = reader.submit(handle.readinto, buffers[turn])
            digest.update(memoryview(ready)[:count])  # releases the GIL: the read and other files' hashes go on
    return digest.hexdigest()


def _threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def _describe(files: list[str], root: Path, checksums: bool) -> dict:
    def entry(name):
        file = root / name
        return name, {"bytes": file.stat().st_size, **({"sha256": sha256_file(file)} if checksums else {})}
    with ThreadPoolExecutor(max_workers=_threads()) as pool:
        return dict(pool.map(entry, files))


def build_manifest(path: Path, tag: str, checksums: bool, device, written: dict | None = None) -> dict:
    """Collective: every rank returns the whole manifest. `written`: what this rank's checkpoint writer recorded as
    it wrote ({relative name: entry}, hashed in the same pass as the write, trainer/train/checkpoint_io.py); taken as
    recorded when the file on disk has that size. Every other file (DeepSpeed's copied scripts, the trainer's JSON,
    another writer's files) is hashed here, the ranks splitting those bytes evenly."""
    rank, world = ranks.rank(), ranks.world_size()
    sizes = {name: (path / name).stat().st_size for name in checkpoint_files(path)}
    recorded: dict[str, dict] = {}
    for part in all_gather_text(json.dumps(written or {}), device):
        for name, entry in json.loads(part).items():
            agrees = recorded.get(name, entry) == entry and sizes.get(name) == entry["bytes"]
            recorded[name] = entry if agrees and ("sha256" in entry) == checksums else None  # else: hashed again
    hashed_here = {name: size for name, size in sizes.items() if recorded.get(name) is None}
    mine = _describe(_my_share_of_bytes(hashed_here, rank, world), path, checksums)
    files = {name: entry for name, entry in recorded.items() if entry is not None and name in sizes}
    for part in all_gather_text(json.dumps(mine), device):
        files.update(json.loads(part))
    return {"manifest_version": MANIFEST_VERSION, "tag": tag, "files": dict(sorted(files.items()))}


def local_manifest(path: Path, tag: str, checksums: bool = True) -> dict:
    """The manifest of files one rank wrote alone (a universal conversion): not a collective."""
    files = _describe(checkpoint_files(path), path, checksums)
    return {"manifest_version": MANIFEST_VERSION, "tag": tag, "files": dict(sorted(files.items()))}


def read_manifest(path: Path) -> dict | None:
    """The manifest in `COMPLETE`, or None for a checkpoint written before manifests (COMPLETE = the tag)."""
    text = (path / "COMPLETE").read_text()
    try:
        manifest = json.loads(text)
    except ValueError:
        return None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{path / 'COMPLETE'} is not a manifest this version can read; resume another "
                              f"checkpoint")
    for name, entry in manifest["files"].items():
        if not _is_entry(entry):
            raise CheckpointError(f"{path / 'COMPLETE'} lists {name!r} with {json.dumps(entry)[:80]}, not a size "
                                  f"and SHA-256 this version can read; resume another checkpoint")
    return manifest


def _is_entry(entry) -> bool:
    """{"bytes": n} or {"bytes": n, "sha256": 64 hex digits}: what build_manifest writes."""
    if not isinstance(entry, dict) or set(entry) - {"bytes", "sha256"}:
        return False
    size, digest = entry.get("bytes"), entry.get("sha256", "0" * 64)
    return (isinstance(size, int) and not isinstance(size, bool) and size >= 0 and isinstance(digest, str)
            and re.fullmatch(r"[0-9a-f]{64}", digest) is not None)


def _check_entry(root: Path, name: str, expected: dict) -> str | None:
    file = root / name
    if not file.is_file():
        return f"{name} is missing"
    size = file.stat().st_size
    if size != expected.get("bytes"):
        return (f"{name} is truncated ({size:,} of {expected['bytes']:,} bytes)" if size < expected["bytes"] else
                f"{name} was changed after it was saved ({size:,} bytes; {expected['bytes']:,} were written)")
    if "sha256" in expected and sha256_file(file) != expected["sha256"]:
        return f"{name} is corrupt or was changed after it was saved (its SHA-256 differs from the one recorded)"
    return None


# --- pickle vetting -----------------------------------------------------------------------------------

def deepspeed_state_classes() -> list:
    """The classes DeepSpeed 0.19.8 pickles into its checkpoints besides tensors and containers."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def may_be_unpickled(file: Path) -> bool:
    """Files DeepSpeed could hand to torch.load: by name, or by content (a zip or a pickle stream)."""
    if file.name.endswith(PICKLE_SUFFIXES):
        return True
    try:
        with open(file, "rb") as handle:
            head = handle.read(4)
    except OSError:
        return True
    return head.startswith(b"PK\x03\x04") or head[:1] == b"\x80"


def vet_file(file: Path, name: str) -> str | None:
    """None when a weights-only load accepts the file; else why it was refused."""
    with torch.serialization.safe_globals(deepspeed_state_classes()):
        try:
            try:
                torch.load(file, map_location="cpu", weights_only=True, mmap=True)  # mmap: tensor data not read
            except RuntimeError as err:
                if "mmap" not in str(err):
                    raise
                torch.load(file, map_location="cpu", weights_only=True)  # legacy (non-zip) format
        except Exception as err:  # torch raises UnpicklingError/RuntimeError naming the offending global
            text = str(err)
            found = re.search(r"GLOBAL ([\w.]+)|Unsupported global: GLOBAL ([\w.]+)", text)
            if found or "weights_only" in text.lower() or "Unsupported" in text:
                culprit = (found.group(1) or found.group(2)) if found else text.splitlines()[0][:200]
                return (f"{name} holds objects a weights-only load does not allow (Unsupported global {culprit}): "
                        f"it may run code when loaded. Only load checkpoints you trust")
            return f"{name} is truncated or corrupt (torch cannot read it: {text.splitlines()[0][:200]})"
    return None


# --- the check before any rank loads --------------------------------------------------------------------

def verify_checkpoint(path: Path, device, optional=lambda name: False, elsewhere=lambda name: False) -> list[str]:
    """Collective. Returns warnings; raises CheckpointError (on every rank, same text) when the checkpoint
    must not be loaded. `optional(name)`: files whose absence is a warning (RNG states); `elsewhere(name)`:
    files not loaded from this checkpoint, checked on their own when they are (a universal conversion inside it)."""
    rank, world = ranks.rank(), ranks.world_size()
    problems, warnings = [], []
    try:
        manifest = read_manifest(path)
    except CheckpointError as err:
        manifest, problems = None, [str(err)]
    problems += [f"{name} is a symbolic link (DeepSpeed writes none, and a link can lead a load outside the "
                 f"checkpoint): replace it with the file it points to" for name in symbolic_links(path)]
    on_disk = [name for name in all_files(path) if not elsewhere(name)]
    if manifest is not None:
        listed = manifest["files"]
        share = _my_share_of_bytes({name: entry["bytes"] for name, entry in listed.items()}, rank, world)
        with ThreadPoolExecutor(max_workers=_threads()) as pool:
            found = list(pool.map(lambda name: _check_entry(path, name, listed[name]), share))
        for name, problem in zip(share, found):
            if problem and problem.endswith("is missing") and optional(name):
                warnings.append(problem)
            elif problem:
                problems.append(problem)
    vet = [name for name in on_disk if may_be_unpickled(path / name)]
    for name in _my_share(vet, rank, world):
        if any(name in p for p in problems):
            continue  # already refused for its bytes
        problem = vet_file(path / name, name)
        if problem:
            problems.append(problem)
    everyone = [json.loads(part) for part in all_gather_text(json.dumps([problems, warnings]), device)]
    problems = sorted({p for part in everyone for p in part[0]})
    warnings = sorted({w for part in everyone for w in part[1]})
    if problems:
        raise CheckpointError(f"checkpoint {path} must not be resumed: " + "; ".join(problems))
    return warnings


# --- finite weights before COMPLETE ------------------------------------------------------------------------

def _master_weights(engine) -> list:
    """The fp32 master copies the optimizer steps (ZeRO-1/2/3, offloaded or not), when it keeps them."""
    optimizer = getattr(engine, "optimizer", None)
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat"):
        groups = getattr(optimizer, name, None)
        if groups:
            return [("optimizer fp32 master weights", g) for g in groups if torch.is_tensor(g)]
    return []


def nonfinite_weights(engine) -> dict[str, int]:
    """{parameter: inf/NaN values in it} (the largest count any rank holds: ZeRO-1/2 replicate the module's
    weights, ZeRO-3 partitions them). Collective.

    A tensor's minimum and maximum are both finite exactly when all its values are (a NaN or an inf is its own
    extreme, or turns it into NaN): one reduction without a temporary per tensor, where counting the non-finite
    values allocates a mask as large as the tensor (seconds for a 100M-parameter model with its fp32 master copy
    on a CPU). Only the tensors whose extremes are not finite are counted."""
    named = []
    for name, param in engine.module.named_parameters():
        local = getattr(param, "ds_tensor", None)
        named.append((name, local if local is not None else param.data))
    named += _master_weights(engine)
    zero = torch.zeros((), dtype=torch.int64, device=engine.device)
    extremes = torch.stack([torch.stack(torch.aminmax(t)).float().to(engine.device) if t.numel()
                            else torch.zeros(2, device=engine.device) for _, t in named])
    suspects = (~torch.isfinite(extremes)).any(dim=1).tolist()  # one device sync for all of them
    # the same length on every rank (a ZeRO-3 partition may be empty on some): the all-reduce pairs them by position
    counts = torch.stack([(~torch.isfinite(t)).sum().to(engine.device) if suspect else zero
                          for (_, t), suspect in zip(named, suspects)])
    if dist.is_initialized():
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    found: dict[str, int] = {}
    for (name, _), count in zip(named, counts.tolist()):
        if count:
            found[name] = found.get(name, 0) + int(count)
    return found
