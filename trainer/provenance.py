"""Which code, stack and layout produced a run: the `provenance:` section of `config.resolved.yaml` and the wandb config.

    git:             {commit, dirty} of the repository the trainer was imported from; commit and dirty are null with
                     a `reason` when there is no git or no repository (a pip-installed trainer), never an error
    trainer_version: the installed distribution's version (pyproject.toml)
    versions:        python, torch, deepspeed, transformers
    world:           world_size, nodes, ranks_per_node, data_parallel_size, tensor_parallel_size (AutoTP)
    resolved_hash:   `resolved_hash(record)`: the resolved config, minus fields that do not change what is trained

Two runs with the same `resolved_hash` trained the same configuration; with the same commit (and a clean tree) the
same code too. Nothing here imports torch, DeepSpeed or transformers: versions are read from the installed metadata.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
DISTRIBUTION = "deepspeed-preset-trainer"
PACKAGES = ("torch", "deepspeed", "transformers")

# Fields of the resolved record that say where or how this invocation runs, not what it trains: a resume, a shorter
# allocation, another output directory or a progress bar give the same hash.
VOLATILE = (("train", "resume"), ("train", "stop_after"), ("train", "output_dir"), ("logging", "progress_bar"),
            ("provenance",))


def resolved_hash(record: dict) -> str:
    """A stable hash of a resolved config record (`Resolved.record()`, or `config.resolved.yaml` read back): SHA-256
    of its canonical JSON (sorted keys) with the VOLATILE fields left out, as 'sha256:<hex>'."""
    stable = json.loads(json.dumps(record, default=str))  # a deep copy in JSON's types (tuples are lists)
    for path in VOLATILE:
        parent = stable
        for key in path[:-1]:
            parent = parent.get(key) if isinstance(parent, dict) else None
        if isinstance(parent, dict):
            parent.pop(path[-1], None)
    text = json.dumps(stable, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


def git_state(repo: Path = REPO) -> dict:
    """{"commit", "dirty"} of `repo`; both None with a `reason` when git or the repository is missing. Dirty means
    `git status --porcelain` lists something: a modified, staged or untracked (not ignored) file."""
    try:
        commit = _git(repo, "rev-parse", "HEAD")
        status = _git(repo, "status", "--porcelain", "--untracked-files=normal")
    except FileNotFoundError:
        return {"commit": None, "dirty": None, "reason": "git is not installed"}
    except subprocess.TimeoutExpired:
        return {"commit": None, "dirty": None, "reason": f"git did not answer within 10 s in {repo}"}
    except subprocess.CalledProcessError as err:
        why = (err.stderr or "").strip().splitlines()
        return {"commit": None, "dirty": None,
                "reason": f"{repo} is not a git checkout ({why[0] if why else f'git exit {err.returncode}'})"}
    changed = [line for line in status.splitlines() if line.strip()]
    return {"commit": commit, "dirty": bool(changed), "changed_files": len(changed)}


def _git(repo: Path, *args: str) -> str:
    result = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=10, check=True,
                            env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"})  # status must not take the index lock
    return result.stdout.strip()


def versions() -> dict:
    """Installed versions of the stack (None for a package that is not installed)."""
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def trainer_version() -> str | None:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None  # run from a source tree that was never pip-installed; git says which code it is


def world_layout(world_size: int, ranks_per_node: int, data_parallel_size: int, tensor_parallel_size: int) -> dict:
    return {"world_size": world_size, "nodes": max(1, world_size // max(ranks_per_node, 1)),
            "ranks_per_node": ranks_per_node, "data_parallel_size": data_parallel_size,
            "tensor_parallel_size": tensor_parallel_size}


def launcher_ranks_per_node(default: int) -> int:
    """Ranks on this node as the launcher says (DeepSpeed: LOCAL_SIZE; torchrun: LOCAL_WORLD_SIZE), else `default`."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return default


def collect(record: dict, world: dict, repo: Path = REPO) -> dict:
    """The provenance section for a run whose resolved record is `record` (without a provenance section)."""
    return {"git": git_state(repo), "trainer_version": trainer_version(), "versions": versions(), "world": world,
            "resolved_hash": resolved_hash(record)}
