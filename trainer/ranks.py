"""Which rank this process is, whether or not a process group exists (a plain `python` run, a unit test
and the first lines of a launch have none): one place instead of `if dist.is_initialized()` everywhere.

Before a group exists, the launcher's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) are read
here and only here (`launch_environment`): all of them set and consistent is a launch; none set is one process;
anything between (a leftover RANK=5 WORLD_SIZE=2 in a shell, a WORLD_SIZE of 'two') is a named error before any
work. DeepSpeed itself, given fewer than all five, would go looking for MPI (`ModuleNotFoundError: mpi4py`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping, Optional

import torch.distributed as dist

from .errors import UserError, clip

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
NUMBERS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")


@dataclass(frozen=True)
class Launch:
    """What a launcher (deepspeed, torchrun, the trainer's own) told this process."""
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def launch_environment(environ: Optional[Mapping[str, str]] = None) -> Optional[Launch]:
    """The launcher's variables: None when none is set (one process), a Launch when all are set and agree, else a
    UserError naming every variable that is wrong, its value, and the two ways out."""
    environ = os.environ if environ is None else environ
    given = {name: environ[name] for name in LAUNCH_VARIABLES if name in environ}
    if not given:
        return None
    problems = launch_problems(given)
    if problems:
        shown = ", ".join(f"{name}={clip(repr(value), 40)}" for name, value in given.items())
        raise UserError(f"the environment holds launcher variables that are not a launch ({shown}): "
                        + "; ".join(problems) + ". A one-process command needs none of them: unset them (`env "
                        + " ".join(f"-u {name}" for name in given) + " python -m trainer ...`, or `unset "
                        + " ".join(given) + "` in this shell); to run on several ranks, start the command with a "
                        "launcher (`deepspeed --num_gpus N ...`), which sets all of them")
    return Launch(int(given["RANK"]), int(given["WORLD_SIZE"]), int(given["LOCAL_RANK"]), given["MASTER_ADDR"],
                  int(given["MASTER_PORT"]))


def launch_problems(given: dict[str, str]) -> list[str]:
    missing = [name for name in LAUNCH_VARIABLES if name not in given]
    problems = [f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set (a launcher sets all of "
                f"{', '.join(LAUNCH_VARIABLES)})"] if missing else []
    numbers = {}
    for name in NUMBERS:
        value = given.get(name)
        if value is not None and not (value.isascii() and value.isdigit()):
            problems.append(f"{name}={clip(repr(value), 40)} is not a whole number")
        elif value is not None:
            numbers[name] = int(value)
    rank, world, local, port = (numbers.get(name) for name in NUMBERS)
    if world is not None and world < 1:
        problems.append(f"WORLD_SIZE={world} must be at least 1")
    elif world is not None and rank is not None and rank >= world:
        problems.append(f"RANK={rank} is not below WORLD_SIZE={world} (ranks count from 0)")
    if local is not None and rank is not None and local > rank:
        problems.append(f"LOCAL_RANK={local} is above RANK={rank}")
    if port is not None and not 1 <= port <= 65535:
        problems.append(f"MASTER_PORT={port} is not a port (1-65535)")
    if "MASTER_ADDR" in given and (not given["MASTER_ADDR"].strip() or given["MASTER_ADDR"] != given["MASTER_ADDR"].strip()):
        problems.append(f"MASTER_ADDR={clip(repr(given['MASTER_ADDR']), 40)} is not a host name or address")
    return problems


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def launched_world_size() -> int:
    """The ranks the launcher started (WORLD_SIZE), known before the process group exists; 1 without one."""
    launch = launch_environment()
    return launch.world_size if launch else 1


def launched_rank() -> int:
    """This process's rank as the launcher said (0 without one), before or without a process group."""
    launch = launch_environment()
    return launch.rank if launch else 0
