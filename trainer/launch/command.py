"""The one command line that trains a preset, as the planner, the doctor, the preset headers and `python -m
trainer launch` print (and run) it: DeepSpeed's runner, torchrun, or the node-local launcher (what a Slurm
script runs on each node)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from .. import ds as dsc
from ..shell import EnvAssignment, ShellVariable, join


LAUNCHERS = ("deepspeed", "torchrun", "local")
DEFAULT_PORT = 29500  # deepspeed's and torchrun's default rendezvous port
MASTER_ADDR, NODE_RANK = ShellVariable("MASTER_ADDR"), ShellVariable("NODE_RANK")


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet and how the nodes are reached. The defaults are the lines the planner prints:
    a file named `hostfile`, and for torchrun/local the shell's $MASTER_ADDR and $NODE_RANK on each node."""
    hostfile: str = "hostfile"
    master_addr: Optional[str] = None   # deepspeed: None asks the first host (`hostname -I` over ssh)
    master_port: Optional[int] = None
    node_rank: Union[int, ShellVariable] = NODE_RANK
    ssh_port: Optional[int] = None      # deepspeed's runner: ssh/pdsh to this port on every host
    rdzv_backend: Optional[str] = None  # torchrun: c10d (dynamic rendezvous, node ranks assigned) instead of static
    rdzv_id: Optional[str] = None
    hostfile_given: bool = False        # deepspeed: a hostfile of the user's, kept however many hosts it lists


def train_argv(preset: str, overrides: list[str] = (), nodes: int = 1, gpus_per_node: int = 1,
               cpu_offload: bool = False, world_size: Optional[int] = None, launcher: str = "deepspeed",
               env: tuple[tuple[str, str], ...] = (), where: Rendezvous = Rendezvous(), train_args: list[str] = (),
               script: str = "train.py", python: str = "python") -> list[str]:
    """The words of `train_command` (the VAR=value assignments first), for a caller that runs them."""
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher {launcher!r}: one of {', '.join(LAUNCHERS)}")
    words = [EnvAssignment(name, value) for name, value in env]
    if launcher == "deepspeed":
        words += _deepspeed(nodes, gpus_per_node, cpu_offload, where) + [script]
    elif launcher == "torchrun":
        words += _torchrun(nodes, gpus_per_node, where) + [script]
    else:
        words += _local(nodes, gpus_per_node, where, python)
    words += ["--preset", preset]
    if world_size is not None:
        words += ["--world-size", str(world_size)]
    for item in overrides:
        words += ["--set", item]
    return words + list(train_args)


def train_command(preset: str, overrides: list[str] = (), nodes: int = 1, gpus_per_node: int = 1,
                  cpu_offload: bool = False, world_size: Optional[int] = None, launcher: str = "deepspeed",
                  env: tuple[tuple[str, str], ...] = (), **layout) -> str:
    """The one command line that trains `preset` on nodes x gpus_per_node ranks, as the planner, the doctor
    and the preset headers print it: DeepSpeed's runner (a hostfile for several nodes), or torchrun on each
    node (static rendezvous at $MASTER_ADDR, this node's index in $NODE_RANK) where ssh from one node to the
    others is not available, or the node-local launcher (`python -m trainer launch --launcher local`, which
    keeps the preemption promise under a scheduler). CPU offload gets --bind_cores_to_rank (the CPU optimizer
    wants its own cores). `world_size` is passed on as --world-size; `env` prefixes VAR=value assignments;
    `layout` is train_argv's where/train_args/script/python."""
    return join(train_argv(preset, overrides, nodes, gpus_per_node, cpu_offload, world_size, launcher, env, **layout))


def _deepspeed(nodes: int, gpus_per_node: int, cpu_offload: bool, where: Rendezvous) -> list[str]:
    words = ["deepspeed"]
    if nodes > 1 or where.hostfile_given:
        words += ["--hostfile", where.hostfile, "--num_nodes", str(nodes)]
    if nodes == 1 and where.hostfile_given:
        # DeepSpeed's runner runs one active host on *this* machine, whatever the hostfile names, unless told
        # --force_multi: then it reaches that host over pdsh/ssh like several (it ssh-checks it either way)
        words.append("--force_multi")
    words += ["--num_gpus", str(gpus_per_node)]
    if where.master_addr:
        words += ["--master_addr", where.master_addr]
    if where.master_port:
        words += ["--master_port", str(where.master_port)]
    if where.ssh_port and (nodes > 1 or where.hostfile_given):
        words += ["--ssh_port", str(where.ssh_port)]
    if cpu_offload:
        words.append("--bind_cores_to_rank")
    return words


def _torchrun(nodes: int, gpus_per_node: int, where: Rendezvous) -> list[str]:
    words = ["torchrun", "--nproc_per_node", str(gpus_per_node)]
    addr, port = where.master_addr or MASTER_ADDR, where.master_port or DEFAULT_PORT
    endpoint = addr.followed_by(f":{port}") if isinstance(addr, ShellVariable) else f"{addr}:{port}"
    if nodes > 1 and where.rdzv_backend:  # the same line on every node; torchrun numbers the nodes itself
        words += ["--nnodes", str(nodes), "--rdzv_backend", where.rdzv_backend, "--rdzv_endpoint", endpoint,
                  "--rdzv_id", where.rdzv_id or "trainer"]
    elif nodes > 1:  # the same line on every node; the shell fills in which node it is
        words += ["--nnodes", str(nodes), "--node_rank", _word(where.node_rank), "--master_addr", addr,
                  "--master_port", str(port)]
    elif where.master_port:
        words += ["--master_port", str(where.master_port)]
    return words


def _local(nodes: int, gpus_per_node: int, where: Rendezvous, python: str) -> list[str]:
    words = [python, "-m", "trainer", "launch", "--launcher", "local", "--nproc-per-node", str(gpus_per_node)]
    if nodes > 1:
        words += ["--nnodes", str(nodes), "--node-rank", _word(where.node_rank), "--master-addr",
                  where.master_addr or MASTER_ADDR]
    if where.master_port:
        words += ["--master-port", str(where.master_port)]
    return words


def _word(value: Union[int, ShellVariable]) -> str:
    return value if isinstance(value, ShellVariable) else str(value)  # str() of a ShellVariable is plain text


def cpu_offloaded(resolved) -> bool:
    return "cpu" in (dsc.offload_optimizer_device(resolved.ds), dsc.offload_param_device(resolved.ds))


def command_for(resolved, preset: str, overrides: list[str], world_size: Optional[int] = None,
                launcher: str = "deepspeed", env: tuple[tuple[str, str], ...] = (), master_port: Optional[int] = None,
                train_args: tuple[str, ...] = ()) -> str:
    """`train_command` for a resolved config: its world size, laid out as its hardware section says when
    that matches (else on one node), and its offload devices. `world_size` (the --world-size the config was
    resolved for) is carried over so the ranks resolve the same config; `master_port` moves the rendezvous,
    `train_args` follow the preset (`--resume auto`)."""
    hw = resolved.config.hardware
    nodes, per_node = ((hw.nodes, hw.gpus_per_node) if resolved.world_size == hw.nodes * hw.gpus_per_node
                       else (1, resolved.world_size))
    return train_command(preset, overrides, nodes, per_node, cpu_offloaded(resolved), world_size, launcher, env,
                         where=Rendezvous(master_port=master_port), train_args=list(train_args))
