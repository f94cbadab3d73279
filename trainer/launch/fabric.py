"""Fabric profiles: the NCCL environment for a cluster's network, as data (`fabrics/<name>.env`, one
`NAME=value` per line, each with a comment saying why), exported to every rank.

`--fabric ib|roce|tcp|nvlink-ib|debug`, a path to an .env file of one's own, or several joined by commas
(`ib,debug`: later ones win). How the ranks get it depends on the launcher: DeepSpeed's pdsh runner exports
what its `.deepspeed_env` file lists on every node (`deepspeed_env_text`, written to the run directory and named
by DS_ENV_FILE, so the user's ~/.deepspeed_env and ./.deepspeed_env are read into it rather than clobbered);
torchrun and the node-local launcher pass their environment on; a Slurm script exports it before srun.
"""
from __future__ import annotations

import os
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..files import read_text


PROFILE_DIR = Path(__file__).resolve().parent / "fabrics"
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
UNSAFE = re.compile(r"[\"'`$\\\s;]")  # DeepSpeed's runner pastes values into `export K=v;` on the remote shell
# where DeepSpeed's runner looks for the user's own file (runner.py DEEPSPEED_ENVIRONMENT_PATHS, in that order)
USER_ENV_FILES = (Path("~/.deepspeed_env"), Path(".deepspeed_env"))


@dataclass(frozen=True)
class Fabric:
    name: str                         # as given: "ib", "ib,debug", "./my.env"
    sources: tuple[str, ...]          # the files read
    env: tuple[tuple[str, str], ...]  # (NAME, value), in file order, later profiles overriding

    def as_dict(self) -> dict:
        return {"name": self.name, "files": list(self.sources), "env": dict(self.env)}


def shipped_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.env"))


def load_fabric(spec: str) -> Fabric:
    env: dict[str, str] = {}
    sources = []
    for part in [p.strip() for p in spec.split(",")]:
        path = profile_path(part)
        sources.append(str(path))
        env.update(parse_env(read_text(path, "fabric profile", allow_empty=True), str(path)))
    return Fabric(spec, tuple(sources), tuple(env.items()))


def profile_path(name: str) -> Path:
    if name in shipped_profiles():
        return PROFILE_DIR / f"{name}.env"
    if name.endswith(".env") or os.sep in name:
        return Path(name)
    raise UserError(f"--fabric {name!r}: not a shipped profile ({', '.join(shipped_profiles())}) nor a path to an "
                    f".env file; give one of those (several joined by commas, e.g. ib,debug)")


def parse_env(text: str, source: str) -> dict[str, str]:
    """`NAME=value` lines; blank lines and `#` comments skipped; every bad line reported with file:line."""
    env, problems = {}, []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        if not sep or not NAME.match(name):
            problems.append(f"{source}:{number}: {line!r} is not NAME=value (a comment line starts with #)")
        elif UNSAFE.search(value):
            problems.append(f"{source}:{number}: the value of {name} has quotes, $, a backslash, ; or a space: it "
                            f"reaches the ranks through a remote shell's `export`; write it without them")
        else:
            env[name] = value
    if problems:
        raise UserError("fabric profile problems:\n  " + "\n  ".join(problems))
    return env


def deepspeed_env_text(fabric: Fabric) -> tuple[str, list[str]]:
    """The `.deepspeed_env` DeepSpeed's runner reads (plain `NAME=value` lines, no comments: it splits every line
    on '='): the profile, then the user's own files as DeepSpeed would have read them, so theirs still win.
    Returns (text, notes about variables the user's files override)."""
    merged = dict(fabric.env)
    notes = []
    for path in USER_ENV_FILES:
        path = path.expanduser()
        if not path.is_file():
            continue
        for name, value in parse_user_env(read_text(path, "DeepSpeed environment file", allow_empty=True)):
            if name in merged and merged[name] != value:
                notes.append(f"{path} sets {name}={value} over the fabric profile's {merged[name]}")
            merged[name] = value
    return "".join(f"{name}={value}\n" for name, value in merged.items()), notes


def parse_user_env(text: str) -> list[tuple[str, str]]:
    """A user's .deepspeed_env as DeepSpeed reads it (every line split once on '=', values stripped)."""
    return [(name.strip(), value.strip()) for name, _, value in (line.partition("=") for line in text.splitlines())
            if name.strip()]


def received_network_env(environ=os.environ) -> dict[str, str]:
    """The fabric variables a rank received."""
    return {k: v for k, v in sorted(environ.items()) if k.startswith(("NCCL_", "TORCH_NCCL_", "GLOO_", "UCX_"))}


def report_network_env(rank: int) -> None:
    """The first rank of each node says which fabric variables reached it: a profile that did not reach a node
    (a missing DS_ENV_FILE export, a scheduler that cleans the environment) shows here, not as a slow run."""
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    env = received_network_env()
    local = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE"))
    if not env and local in (None, os.environ.get("WORLD_SIZE")):  # one node, nothing set: nothing to say
        return
    listed = " ".join(f"{k}={v}" for k, v in env.items()) if env else "none (NCCL's defaults)"
    print(f"network: rank {rank} on {socket.gethostname()} received {listed}", file=sys.stderr, flush=True)
