"""A local hub cache as huggingface_hub lays it out (blobs named by content, snapshots of links to them, refs naming a
commit), for runs that load a model by hub id with no network (HF_HUB_OFFLINE=1, HF_HUB_CACHE=<root>)."""
from __future__ import annotations

import hashlib
from pathlib import Path


def make_hub_cache(root: Path, repo_id: str, snapshots: dict[str, Path]) -> Path:
    """`repo_id` at each commit of `snapshots` ({40-hex commit: a model directory}); refs/main names the first.
    Returns refs/main (write another commit into it to move the ref, as a download of a newer revision does)."""
    folder = root / ("models--" + repo_id.replace("/", "--"))
    (folder / "blobs").mkdir(parents=True, exist_ok=True)
    for commit, directory in snapshots.items():
        snapshot = folder / "snapshots" / commit
        snapshot.mkdir(parents=True)
        for file in sorted(p for p in directory.iterdir() if p.is_file()):
            data = file.read_bytes()
            blob = hashlib.sha256(data).hexdigest()
            (folder / "blobs" / blob).write_bytes(data)
            (snapshot / file.name).symlink_to(f"../../blobs/{blob}")
    ref = folder / "refs" / "main"
    ref.parent.mkdir(exist_ok=True)
    ref.write_text(next(iter(snapshots)))
    return ref


def commit_id(seed: int) -> str:
    return hashlib.sha1(str(seed).encode()).hexdigest()
