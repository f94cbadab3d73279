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
from pathlib import Path
from typing import Optional

from .. import numbers, paths
from ..errors import UserError
from ..flag_needs import needs
from ..options import add_rank_arguments, add_train_arguments, config_source
from ..presets import load_preset
from ..resolve import Resolved
from ..run_dir import check_not_foreign, previous_run
from . import supervisor
from .command import Rendezvous, train_argv
from .fabric import Fabric, load_fabric, shipped_profiles
from .record import owns_run_directory, print_command, record_launch, set_aside_for_a_fresh_launch
from ..shell import check_host
from .topology import Topology, resolve_for, topology_of


LAUNCHERS = ("deepspeed", "torchrun", "slurm", "local")
NODE_LOCAL_FLAGS = ("nnodes", "node_rank", "nproc_per_node")


def launcher_of(args) -> str:
    """The launcher this command line runs: --launcher, else local when a node-local flag is given, else deepspeed."""
    return args.launcher or ("local" if any(getattr(args, k, None) is not None for k in NODE_LOCAL_FLAGS)
                             else "deepspeed")


def only(*launchers: str) -> tuple:
    """A flag's need (trainer/flag_needs.py): that one of `launchers` runs."""
    return (f"--launcher {' or '.join(launchers)}", lambda args: launcher_of(args) in launchers)


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
    needs(parser.add_argument("--ssh-port", type=numbers.PORT, help="deepspeed: the port sshd listens on on every "
                                                                    "host"),
          "--launcher deepspeed with --hostfile (one node runs here, no ssh)",
          lambda args: launcher_of(args) == "deepspeed" and args.hostfile is not None)
    needs(parser.add_argument("--rdzv-backend", choices=("c10d",), help="torchrun: dynamic rendezvous (node ranks "
                              "assigned) instead of the static one at --master-addr with --node-rank"),
          *only("torchrun"))
    needs(parser.add_argument("--rdzv-id", help="torchrun with --rdzv-backend: the job's id (the same on every "
                                                "node)"),
          "--launcher torchrun with --rdzv-backend (the static rendezvous has no job id)",
          lambda args: launcher_of(args) == "torchrun" and args.rdzv_backend is not None)
    needs(parser.add_argument("--time", help="slurm: the job's time limit (default 24:00:00)"), *only("slurm"))
    needs(parser.add_argument("--signal-grace-s", type=numbers.WHOLE_SECONDS,
                              help="slurm: SIGTERM this many seconds before the time limit, to checkpoint (default "
                                   "300)"), *only("slurm"))
    needs(parser.add_argument("--partition", help="slurm: the partition"), *only("slurm"))
    needs(parser.add_argument("--account", help="slurm: the account"), *only("slurm"))
    supervisor.launch_arguments(parser)  # --nproc-per-node, --nnodes, --node-rank, --master-addr/-port, ...
    add_train_arguments(parser)  # --preset, --set, --resume, --rehearse, --world-size: passed on to every rank
    parser.set_defaults(preset=None)


def launch(args) -> int:
    args.preset, extra = preset_and_train_args(args)
    args.launcher = launcher_of(args)
    check_launcher_flags(args)
    check_passthrough(args, extra)
    fabric = load_fabric(args.fabric) if args.fabric else None
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's import banner is not the printed command
        config = load_preset(args.preset, args.overrides)
    topology = topology_of(args, config)
    resolved = resolve_for(args, config, topology)
    check_output_dir(resolved)
    resume_by_default(args, resolved, extra)  # and args.starts_fresh: whether a previous run is set aside
    if args.starts_fresh and owns_run_directory(args, args.launcher):  # a dry run refuses one too
        run_dir = Path(resolved.config.train.output_dir)
        check_not_foreign(run_dir, previous_run(run_dir, keep_startup_files=False))
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


def check_passthrough(args, extra: list[str]) -> None:
    """The words after `--` reach every rank's `train` as they are: refused here when train's parser would
    not take them (every rank would stop there), when they are the launcher's own hidden flags, or when they
    change what the rank's config is resolved from (`train.cli.config_source`: --preset, --set, --world-size,
    --deepspeed_config, whatever train grows): the ranks would run a config this launch never checked."""
    if not extra:
        return
    parser = RankParser(prog="train", add_help=False, exit_on_error=False)
    add_rank_arguments(parser)
    ours = ["--preset", args.preset, *[w for item in args.overrides for w in ("--set", item)]]
    if args.world_size is not None:
        ours += ["--world-size", str(args.world_size)]
    ours += supervisor.train_flags(args)
    try:
        base, _ = parser.parse_known_args(ours)
        full, unknown = parser.parse_known_args(ours + extra)
    except argparse.ArgumentError as err:
        raise UserError(f"launch: the words after `--` ({' '.join(extra)}): every rank's train would refuse them: "
                        f"{err}; see python -m trainer train --help") from None
    if unknown:
        raise UserError(f"launch: {' '.join(unknown)} after `--`: train takes no such argument (every rank would "
                        f"stop at it); see python -m trainer train --help")
    problems = []
    for action in parser._actions:
        if not action.option_strings or getattr(full, action.dest) == getattr(base, action.dest):
            continue
        flag = shown_flag(action, extra, getattr(base, action.dest), getattr(full, action.dest))
        if action.help == argparse.SUPPRESS:
            problems.append(f"{flag} is set by the launcher (or DeepSpeed's autotuner), not by hand")
        elif changes_config(config_source, base, action.dest, getattr(full, action.dest)):
            problems.append(f"{flag} changes the config the ranks run, which this launch checked without it; give "
                            f"it before `--` (a launch flag, checked and passed on to every rank)")
        elif getattr(base, action.dest) != action.default:
            problems.append(f"{flag} is given before `--` too; give it once")
    if problems:
        raise UserError("launch: after `--`:\n  " + "\n  ".join(problems))


def shown_flag(action: argparse.Action, extra: list[str], before, after) -> str:
    """The flag as the user wrote it after `--`, with what it added (`--set train.lr=1`)."""
    flag = next((w.partition("=")[0] for w in extra if w.partition("=")[0] in action.option_strings),
                action.option_strings[0])
    if isinstance(after, list):
        return " ".join(f"{flag} {item}" for item in after[len(before or []):])
    return flag if isinstance(after, bool) else f"{flag} {after}"


class RankParser(argparse.ArgumentParser):
    """train's parser, as each rank will run it; a word it refuses is an exception here, not an exit."""

    def error(self, message: str):
        raise argparse.ArgumentError(None, message)


def changes_config(config_source, base: argparse.Namespace, dest: str, value) -> bool:
    changed = argparse.Namespace(**{**vars(base), dest: value})
    try:
        return config_source(changed) != config_source(base)
    except UserError:
        return True  # a value train could not even read changes it too


PREEMPTIBLE = ("slurm", "local")  # the launchers a scheduler restarts: a requeued Slurm job, a rescheduled pod


def resume_by_default(args, resolved: Resolved, extra: list[str]) -> None:
    """A launcher that a scheduler restarts resumes by default: its script or command passes `--resume auto`, so a
    requeued job continues from its newest checkpoint instead of starting over (a first start with nothing to
    resume starts fresh and says so). Whatever the user chose wins: --resume (before or after `--`), a --set or
    preset train.resume."""
    resume_after_dashes = [extra[i + 1] if word == "--resume" and i + 1 < len(extra) else word.partition("=")[2]
                           for i, word in enumerate(extra) if word == "--resume" or word.startswith("--resume=")]
    chosen = args.resume or (resume_after_dashes[-1] if resume_after_dashes else None)
    args.starts_fresh = chosen == "off" or (chosen is None and resolved.config.train.resume is None)
    if args.launcher not in PREEMPTIBLE or chosen is not None or resolved.config.train.resume is not None:
        return
    args.resume = "auto"
    args.starts_fresh = False
    print(f"launch: --launcher {args.launcher} resumes by default (--resume auto: a restarted or requeued job "
          f"continues from the newest checkpoint in {resolved.config.train.output_dir}/checkpoints; with none there "
          f"it starts fresh); --resume off starts fresh every time", file=sys.stderr, flush=True)


def check_output_dir(resolved: Resolved) -> None:
    """The run directory is checked the same way for a dry run and a real one (a dry run creates nothing):
    launch.json, the DeepSpeed env file and job.sbatch go there before the ranks start."""
    try:
        paths.output_dir("train.output_dir").check(str(resolved.config.train.output_dir))
    except UserError as err:
        raise UserError(f"{err} (the run directory; --set train.output_dir=PATH)") from None


def check_launcher_flags(args) -> None:
    if args.master_addr is not None:  # it reaches torchrun, ssh/pdsh command lines and every rank's environment
        check_host(args.master_addr, "--master-addr")


def run_local(args, resolved: Resolved, topology: Topology, fabric: Optional[Fabric], extra: list[str]) -> int:
    """The node-local launcher; node 0 records the launch, every node exports the fabric to its ranks."""
    args.nnodes, args.node_rank = topology.nodes, args.node_rank or 0
    args.nproc_per_node = topology.ranks_per_node
    supervisor.check_topology(args, args.nproc_per_node)  # what the real launch checks, before the dry run ends
    env = fabric.env if fabric else ()
    words = train_argv(args.preset, args.overrides, topology.nodes, topology.ranks_per_node, launcher="local",
                       world_size=topology.world_size, env=env, python=sys.executable,
                       where=Rendezvous(master_addr=args.master_addr, master_port=args.master_port,
                                        node_rank=args.node_rank), train_args=supervisor.train_flags(args) + extra)
    print_command(words)
    if args.dry_run:
        return 0
    if owns_run_directory(args, "local"):
        set_aside_for_a_fresh_launch(resolved, getattr(args, "starts_fresh", False))
        record_launch(resolved, args, topology, fabric, words)
    os.environ.update(env)
    return supervisor.launch(args, extra)


