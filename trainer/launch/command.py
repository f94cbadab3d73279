"""The one command line that trains a preset, as the planner, the doctor and the preset headers print it."""
from __future__ import annotations

import shlex
from typing import Optional

from .. import ds as dsc

LAUNCHERS = ("deepspeed", "torchrun")


def train_command(preset: str, overrides: list[str] = (), nodes: int = 1, gpus_per_node: int = 1,
                  cpu_offload: bool = False, world_size: Optional[int] = None, launcher: str = "deepspeed",
                  env: tuple[tuple[str, str], ...] = ()) -> str:
    """The one command line that trains `preset` on nodes x gpus_per_node ranks, as the planner, the doctor
    and the preset headers print it: DeepSpeed's runner (a hostfile for several nodes), or torchrun on each
    node (static rendezvous at $MASTER_ADDR, this node's index in $NODE_RANK) where ssh from one node to the
    others is not available. CPU offload gets --bind_cores_to_rank (the CPU optimizer wants its own cores).
    `world_size` is passed on as --world-size; `env` prefixes VAR=value assignments. Under a scheduler, run
    the same arguments with `python -m trainer launch` (see its module docstring)."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher {launcher!r}: one of {', '.join(LAUNCHERS)}")
    words = [f"{name}={value}" for name, value in env]
    words += _torchrun(nodes, gpus_per_node) if launcher == "torchrun" else _deepspeed(nodes, gpus_per_node,
                                                                                       cpu_offload)
    words += ["train.py", "--preset", preset]
    if world_size is not None:
        words += ["--world-size", str(world_size)]
    for item in overrides:
        words += ["--set", item]
    return " ".join(_quote(w) for w in words)


def _deepspeed(nodes: int, gpus_per_node: int, cpu_offload: bool) -> list[str]:
    words = ["deepspeed"]
    if nodes > 1:
        words += ["--hostfile", "hostfile", "--num_nodes", str(nodes)]
    words += ["--num_gpus", str(gpus_per_node)]
    if cpu_offload:
        words.append("--bind_cores_to_rank")
    return words


def _torchrun(nodes: int, gpus_per_node: int) -> list[str]:
    words = ["torchrun", "--nproc_per_node", str(gpus_per_node)]
    if nodes > 1:  # the same line on every node; the shell fills in which node it is
        words += ["--nnodes", str(nodes), "--node_rank", "$NODE_RANK", "--master_addr", "$MASTER_ADDR",
                  "--master_port", "29500"]
    return words


def _quote(word: str) -> str:
    # $NODE_RANK and $MASTER_ADDR are for the shell to expand on each node: quoting would pass them literally
    return word if word.startswith("$") and word[1:].isidentifier() else shlex.quote(word)


def command_for(resolved, preset: str, overrides: list[str], world_size: Optional[int] = None,
                launcher: str = "deepspeed", env: tuple[tuple[str, str], ...] = ()) -> str:
    """`train_command` for a resolved config: its world size, laid out as its hardware section says when
    that matches (else on one node), and its offload devices. `world_size` (the --world-size the config was
    resolved for) is carried over so the ranks resolve the same config."""
    hw = resolved.config.hardware
    nodes, per_node = ((hw.nodes, hw.gpus_per_node) if resolved.world_size == hw.nodes * hw.gpus_per_node
                       else (1, resolved.world_size))
    cpu_offload = "cpu" in (dsc.offload_optimizer_device(resolved.ds), dsc.offload_param_device(resolved.ds))
    return train_command(preset, overrides, nodes, per_node, cpu_offload, world_size, launcher, env)
