"""The one command line that trains a preset, as the planner, the doctor and the preset headers print it."""
from __future__ import annotations

import shlex

from .. import ds as dsc


def train_command(preset: str, overrides: list[str] = (), nodes: int = 1, gpus_per_node: int = 1,
                  cpu_offload: bool = False) -> str:
    """The one command line that trains `preset` on nodes x gpus_per_node ranks, as the planner, the doctor
    and the preset headers print it: DeepSpeed's runner (a hostfile for several nodes). CPU offload gets
    --bind_cores_to_rank (the CPU optimizer wants its own cores). Under a scheduler, run the same
    arguments with `python -m trainer launch` (see its module docstring)."""
    words = ["deepspeed"]
    if nodes > 1:
        words += ["--hostfile", "hostfile", "--num_nodes", str(nodes)]
    words += ["--num_gpus", str(gpus_per_node)]
    if cpu_offload:
        words.append("--bind_cores_to_rank")
    words += ["train.py", "--preset", preset]
    for item in overrides:
        words += ["--set", item]
    return " ".join(shlex.quote(w) for w in words)


def command_for(resolved, preset: str, overrides: list[str]) -> str:
    """`train_command` for a resolved config: its world size, laid out as its hardware section says when
    that matches (else on one node), and its offload devices."""
    hw = resolved.config.hardware
    nodes, per_node = ((hw.nodes, hw.gpus_per_node) if resolved.world_size == hw.nodes * hw.gpus_per_node
                       else (1, resolved.world_size))
    cpu_offload = "cpu" in (dsc.offload_optimizer_device(resolved.ds), dsc.offload_param_device(resolved.ds))
    return train_command(preset, overrides, nodes, per_node, cpu_offload)
