"""`python -m trainer launch PRESET`: one entry for every way of starting the ranks.

    python -m trainer launch 7b_8xa100                                   # one node: deepspeed --num_gpus 8
    python -m trainer launch 70b_32xa100 --hostfile hosts --fabric ib    # DeepSpeed's runner over pdsh/ssh
    python -m trainer launch 70b_32xa100 --launcher torchrun --node-rank 0 --master-addr head   # on each node
    python -m trainer launch 70b_32xa100 --launcher slurm --time 2-00:00:00                       # sbatch
    python -m trainer launch 7b_8xa100 --launcher local [--nnodes N --node-rank R --master-addr A]  # node-local
    ... [--dry-run] [-- --resume auto]

Before anything starts, the topology (a hostfile's hosts and slots, or --nnodes x --nproc-per-node) is checked
against the preset and its world size fed into config resolution: the batch triad, zero_hpz_partition_size
and the AutoTP size are checked for the ranks that will really run, and the ranks get it as --world-size.
The command is printed in full before it runs (`--dry-run`: printed, nothing written, exit 0); the run
directory gets `launch.json` (command, hostfile, fabric) before the ranks start. `--launcher local` (also
chosen by --nnodes/--node-rank/--nproc-per-node without --launcher) is `supervisor`: it starts this node's
ranks itself and keeps the preemption promise as PID 1 or under srun.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Optional

from .. import numbers, paths
from ..errors import UserError
from ..options import add_train_arguments
from ..presets import load_preset
from ..resolve import Resolved
from . import supervisor
from .command import Rendezvous, train_argv
from .fabric import Fabric, load_fabric, shipped_profiles
from .record import print_command, record_launch
from .shell import check_host
from .topology import Topology, resolve_for, topology_of


LAUNCHERS = ("deepspeed", "torchrun", "slurm", "local")
NODE_LOCAL_FLAGS = ("nnodes", "node_rank", "nproc_per_node")
# flags that only one launcher reads: given with another, they would do nothing
LAUNCHER_ONLY = {"ssh_port": "deepspeed", "rdzv_backend": "torchrun", "rdzv_id": "torchrun", "time": "slurm",
                 "signal_grace_s": "slurm", "partition": "slurm", "account": "slurm"}


def launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("preset_name", nargs="?", metavar="PRESET",
                        help="shipped preset name or path (or --preset); after `--`: arguments for every rank's train")
    parser.add_argument("--launcher", choices=LAUNCHERS, default=None,
                        help="deepspeed (default), torchrun, slurm (writes and submits an sbatch script), or local "
                             "(this node's ranks, PID 1 safe; the default when --nnodes/--node-rank is given)")
    parser.add_argument("--hostfile", type=paths.input_file("hostfile"),
                        help="DeepSpeed hostfile (`host slots=N` per line): the nodes to run on")
    parser.add_argument("--fabric", help=f"network profile exported to every rank: {', '.join(shipped_profiles())}, "
                                         f"a path to an .env file, or several joined by commas (ib,debug)")
    parser.add_argument("--dry-run", action="store_true", help="print what would run, write nothing, exit 0")
    parser.add_argument("--ssh-port", type=numbers.PORT, help="deepspeed: the port sshd listens on on every host")
    parser.add_argument("--rdzv-backend", choices=("c10d",), help="torchrun: dynamic rendezvous (node ranks "
                        "assigned) instead of the static one at --master-addr with --node-rank")
    parser.add_argument("--rdzv-id", help="torchrun with --rdzv-backend: the job's id (the same on every node)")
    parser.add_argument("--time", help="slurm: the job's time limit (default 24:00:00)")
    parser.add_argument("--signal-grace-s", type=numbers.WHOLE_SECONDS,
                        help="slurm: SIGTERM this many seconds before the time limit, to checkpoint (default 300)")
    parser.add_argument("--partition", help="slurm: the partition")
    parser.add_argument("--account", help="slurm: the account")
    supervisor.launch_arguments(parser)  # --nproc-per-node, --nnodes, --node-rank, --master-addr/-port, ...
    add_train_arguments(parser)  # --preset, --set, --resume, --rehearse, --world-size: passed on to every rank
    parser.set_defaults(preset=None)


def launch(args) -> int:
    args.preset, extra = preset_and_train_args(args)
    args.launcher = args.launcher or ("local" if any(getattr(args, k) is not None for k in NODE_LOCAL_FLAGS)
                                      else "deepspeed")
    check_launcher_flags(args)
    fabric = load_fabric(args.fabric) if args.fabric else None
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's import banner is not the printed command
        config = load_preset(args.preset, args.overrides)
    topology = topology_of(args, config)
    resolved = resolve_for(args, config, topology)
    train_args = supervisor.train_flags(args) + extra
    if args.launcher == "local":
        return run_local(args, resolved, topology, fabric, extra)
    from .runner import run_launcher
    return run_launcher(args, resolved, topology, fabric, train_args)


def preset_and_train_args(args) -> tuple[str, list[str]]:
    """PRESET is the positional word or --preset; the words after `--` go to every rank's train."""
    if args.preset_name and args.preset and args.preset_name != args.preset:
        raise UserError(f"launch: two presets, {args.preset_name!r} and --preset {args.preset!r}: give one")
    preset = args.preset_name or args.preset
    if preset is None:
        raise UserError("launch: give a PRESET (a shipped name, see `python -m trainer presets`, or a path), e.g. "
                        "python -m trainer launch tiny_cpu")
    return preset, list(getattr(args, "passthrough", []))


def check_launcher_flags(args) -> None:
    unused = [f"--{name.replace('_', '-')} ({owner} only)" for name, owner in LAUNCHER_ONLY.items()
              if getattr(args, name) is not None and owner != args.launcher]
    if unused:
        raise UserError(f"launch --launcher {args.launcher}: {', '.join(unused)} would do nothing here; leave "
                        f"{'it' if len(unused) == 1 else 'them'} out or choose that launcher")
    if args.master_addr is not None:  # it reaches torchrun, ssh/pdsh command lines and every rank's environment
        check_host(args.master_addr, "--master-addr")


def run_local(args, resolved: Resolved, topology: Topology, fabric: Optional[Fabric], extra: list[str]) -> int:
    """The node-local launcher; node 0 records the launch, every node exports the fabric to its ranks."""
    args.nnodes, args.node_rank = topology.nodes, args.node_rank or 0
    args.nproc_per_node = topology.ranks_per_node
    env = fabric.env if fabric else ()
    words = train_argv(args.preset, args.overrides, topology.nodes, topology.ranks_per_node, launcher="local",
                       world_size=topology.world_size, env=env, python=sys.executable,
                       where=Rendezvous(master_addr=args.master_addr, master_port=args.master_port,
                                        node_rank=args.node_rank), train_args=supervisor.train_flags(args) + extra)
    print_command(words)
    if args.dry_run:
        return 0
    if args.node_rank == 0:
        record_launch(resolved, args, topology, fabric, words)
    os.environ.update(env)
    return supervisor.launch(args, extra)


