"""Fabric profiles: the NCCL environment for a cluster's network, as data (`fabrics/<name>.env`, one
`NAME=value` per line, each with a comment saying why), exported to every rank.

`--fabric ib|roce|tcp|nvlink-ib|debug`, a path to an .env file of one's own, or several joined by commas
(`ib,debug`: later ones win). How the ranks get it depends on the launcher: DeepSpeed's pdsh runner exports
what its `.deepspeed_env` file lists on every node (`dsenv`: the profile merged with the user's own files);
torchrun and the node-local launcher pass their environment on; a Slurm script exports it before srun.
A profile is data that is printed with the command and recorded in launch.json: its values must reach a
remote shell intact (`shell.export_value_problem`) and it holds no secret (those stay in the environment or
~/.deepspeed_env).
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
from ..redact import looks_secret
from ..shell import export_value_problem


PROFILE_DIR = Path(__file__).resolve().parent / "fabrics"
NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


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
    env, problems, first = {}, [], {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        twice = duplicate(name, number, first, source) if sep and NAME.match(name) else None
        if twice:
            problems.append(twice)
        elif not sep or not NAME.match(name):
            problems.append(f"{source}:{number}: {line!r} is not NAME=value (a comment line starts with #)")
        elif looks_secret(name):
            problems.append(f"{source}:{number}: {name} looks like a secret: a fabric profile is printed with the "
                            f"command and recorded in launch.json; export it in the environment (or, for "
                            f"DeepSpeed's multi-node runner, put it in ~/.deepspeed_env) instead")
        elif export_value_problem(value):
            problems.append(f"{source}:{number}: the value of {name}: {export_value_problem(value)} (it reaches "
                            f"the ranks through a remote shell's `export`); write it without them")
        else:
            env[name] = value
    if problems:
        raise UserError("fabric profile problems:\n  " + "\n  ".join(problems))
    return env


def duplicate(name: str, number: int, first: dict[str, int], source: str) -> str | None:
    """`NAME` set a second time in one file: which value was meant is not for the reader to guess (a shell, DeepSpeed
    and this file's readers would all keep the last silently). Remembers the first line of each name."""
    if name in first:
        return (f"{source}:{number}: {name} is set again (first at {source}:{first[name]}): keep one line "
                f"(another file, e.g. a later profile in --fabric a,b, may override it)")
    first[name] = number
    return None


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
