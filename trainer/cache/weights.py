"""What decides a model's outputs, as a cache key's input: the identity of its weights and code, found once.

- No name_or_path (from scratch): the model section's architecture and the init seed decide every weight.
- A local directory: every file a load can read (weights, configs, code, tokenizer files; hidden entries aside)
  by name, size and SHA-256. The hashes are remembered by stat (trainer/cache/contents.py): a file is read once per
  version, by the first rank to ask, and a later start (or another rank of the node) reads no weight file.
- A hub id: the commit the local hub cache's ref resolves to (the ref `from_pretrained` just loaded), and every file
  of that snapshot by name and blob (the hub's own content address: a weight file's blob is named by its SHA-256),
  so a ref that moves to other weights is another identity; a snapshot file that is not a blob link is hashed as a
  local file.
"""
from __future__ import annotations

import os
from pathlib import Path

from .contents import content_hashes
from .errors import CacheError

REVISION = "main"  # the revision from_pretrained loads when none is given (the trainer gives none)
UNUSED_BY_FORWARD = ("lora", "gradient_checkpointing")  # settings that never change the model's outputs


def model_identity(model_cfg, seed: int, cache_dir: Path) -> dict:
    """The model's identity: its settings that decide a forward, plus its weights' and code's identity."""
    settings = {k: v for k, v in vars(model_cfg).items() if k not in UNUSED_BY_FORWARD}
    path = model_cfg.name_or_path
    if not path:
        return {"settings": _plain(settings), "inline_seed": seed}
    root = Path(path).expanduser()
    weights = local_identity(root, cache_dir) if root.is_dir() else hub_identity(path, cache_dir)
    return {"settings": _plain(settings), "weights": weights}


def _plain(value):
    if hasattr(value, "__dataclass_fields__"):
        return _plain(vars(value))
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def visible_files(root: Path) -> dict[str, Path]:
    """Every regular file below `root` a load can read, by its name relative to `root` (hidden entries, such as
    huggingface_hub's `.cache/` download records, are never read by a load)."""
    found = {}
    for directory, subdirectories, files in os.walk(root, followlinks=False):
        subdirectories[:] = sorted(d for d in subdirectories if not d.startswith("."))
        for name in sorted(files):
            if not name.startswith("."):
                file = Path(directory) / name
                found[str(file.relative_to(root))] = file
    return found


def local_identity(root: Path, cache_dir: Path) -> dict:
    files = visible_files(root)
    hashes = content_hashes(root.resolve(), files, cache_dir)
    return {"files": [[name, file.stat().st_size, hashes[name]] for name, file in files.items()]}


def hub_cache_root() -> Path:
    from huggingface_hub import constants
    return Path(constants.HF_HUB_CACHE)


def hub_identity(repo_id: str, cache_dir: Path, revision: str = REVISION) -> dict:
    from huggingface_hub.file_download import repo_folder_name
    try:
        folder = hub_cache_root() / repo_folder_name(repo_id=repo_id, repo_type="model")
    except ValueError as err:  # not a repo id huggingface_hub accepts
        raise CacheError(f"model.name_or_path {repo_id!r} is neither a local directory nor a hub id ({err})") from None
    ref = folder / "refs" / revision
    try:
        commit = ref.read_text().strip()
    except OSError:
        raise CacheError(f"model.name_or_path {repo_id!r}: no {ref} in the local hub cache, so the weights this run "
                         f"loaded cannot be identified (download the model first, or give a local directory)") \
            from None
    snapshot = folder / "snapshots" / commit
    if not commit or not snapshot.is_dir():
        raise CacheError(f"model.name_or_path {repo_id!r}: {ref} names commit {commit!r}, which has no snapshot in "
                         f"{folder / 'snapshots'}; download the model again")
    files = visible_files(snapshot)
    blobs, loose = {}, {}
    for name, file in files.items():
        target = os.readlink(file) if file.is_symlink() else ""
        if target and Path(target).parent.name == "blobs":
            blobs[name] = "blob:" + Path(target).name
        else:
            loose[name] = file
    hashed = content_hashes(snapshot.resolve(), loose, cache_dir) if loose else {}
    return {"hub": repo_id, "revision": revision, "commit": commit,
            "files": [[name, blobs.get(name) or hashed[name]] for name in files]}
