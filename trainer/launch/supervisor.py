"""`python -m trainer launch --launcher local`: start this node's ranks and keep the preemption promise.

    python -m trainer launch 7b_8xa100 --launcher local [--set k=v ...] [-- --resume auto]      # one node
    python -m trainer launch 70b_32xa100 --nnodes 4 --node-rank $NODE_RANK --master-addr $HEAD   # each node

Why not `deepspeed` or `torchrun` under a scheduler: Kubernetes sends SIGTERM to PID 1 only, and Slurm
(`--signal=B:TERM@120`) to the batch shell. The deepspeed runner then dies at once, or as PID 1 in a
container ignores the signal, and the ranks are SIGKILLed later without a checkpoint; even when it does
forward the signal it exits -15 while the ranks are still saving, so the job reads as failed.

This launcher
- starts `--nproc-per-node` ranks of `python -m trainer train ...` with RANK, LOCAL_RANK, WORLD_SIZE,
  MASTER_ADDR and MASTER_PORT set (static rendezvous, the same env torchrun gives);
- forwards SIGTERM/SIGINT/SIGHUP to every rank (ranks treat signals within 5 s as one request, so a
  scheduler that signals the whole process group too is fine), waits for their checkpoint, and exits 0
  when every rank exited 0 -- a preempted run that saved is a success; its handlers are up from the
  launch's first instant (`signals`): a signal before the ranks start stops the launch with 128+N, one
  while they start reaches each of them;
- works as PID 1: it reaps every child, including orphans reparented to it;
- when one rank fails, gives the others a few seconds to exit on their own, then kills them (a save needs
  every rank: with one gone the rest can only hang in a collective) and exits with the failed rank's code.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import Optional

from .. import numbers, shm_buffers
from ..flag_needs import needs
from ..errors import UserError
from ..redact import redact_argv
from ..shell import join
from .signals import GUARD, LaunchSignals, hold, send


POLL_S = 0.1


def launch_arguments(parser: argparse.ArgumentParser) -> None:
    """The node-local launcher's flags (`python -m trainer launch` registers them with its own)."""
    parser.add_argument("--nproc-per-node", type=numbers.RANKS_PER_NODE, default=None,
                        help="ranks on this node (default: the preset's hardware.gpus_per_node)")
    parser.add_argument("--nnodes", type=numbers.COUNT, default=None, help="nodes in the job (default: hardware.nodes)")
    needs(parser.add_argument("--node-rank", type=numbers.RANK, default=None, help="this node's index, 0..nnodes-1"),
          "a launcher started on each node (local or torchrun; deepspeed and slurm number the nodes themselves)",
          lambda args: getattr(args, "launcher", None) in (None, "local", "torchrun"))
    needs(parser.add_argument("--master-addr", default=None,
                              help="address of node 0 (local: default 127.0.0.1; deepspeed: the first host's "
                                   "`hostname -I`)"),
          "a launcher that is told where node 0 is (deepspeed, torchrun or local; slurm's node 0 is the "
          "allocation's first node)", lambda args: getattr(args, "launcher", None) != "slurm")
    parser.add_argument("--master-port", type=numbers.PORT, default=None,
                        help="rendezvous port on node 0 (default 29500)")
    needs(parser.add_argument("--failure-grace-s", type=numbers.GRACE_SECONDS, default=5.0,
                              help="after one rank fails, seconds the others get to exit before they are killed"),
          "--launcher local (the launcher that starts and stops the ranks itself)",
          lambda args: getattr(args, "launcher", None) == "local" or getattr(args, "launcher", None) is None and
          any(getattr(args, k, None) is not None for k in ("nnodes", "node_rank", "nproc_per_node")))


def launch(args, extra: list[str] = ()) -> int:
    """Start this node's ranks (`python -m trainer launch --launcher local`, topology already checked there)."""
    args.master_addr = args.master_addr or "127.0.0.1"
    args.master_port = args.master_port or 29500
    train_args = rank_arguments(args) + list(extra)
    nproc = args.nproc_per_node
    check_topology(args, nproc)
    world = args.nnodes * nproc
    print(f"launch: {nproc} rank(s) on node {args.node_rank} of {args.nnodes} (world {world}), rendezvous "
          f"{args.master_addr}:{args.master_port}: python -m trainer train {join(redact_argv(train_args))}",
          file=sys.stderr, flush=True)
    GUARD.install()  # `python -m trainer launch` did at its first instant; this is for a caller in-process
    stopped = GUARD.stop_code()
    if stopped is not None:
        return stopped
    code = Supervisor({}, args.failure_grace_s, processes=start_ranks(train_args, nproc, args)).run()
    if code != 0:
        remove_crashed_buffers(args, nproc)
    return code


def remove_crashed_buffers(args, nproc: int) -> None:
    """A rank that crashed or was killed never removes its DeepSpeed CPU all-reduce buffer (69 MB of /dev/shm, i.e.
    RAM, per rank: trainer/shm_buffers.py); every rank of this node has exited by now, so nobody reads them."""
    first = args.node_rank * nproc
    paths = [shm_buffers.buffer_path(args.master_addr, args.master_port, rank) for rank in range(first, first + nproc)]
    removed = shm_buffers.remove(paths)
    if removed:
        print(f"launch: removed {removed} shared-memory buffer(s) the failed ranks left in /dev/shm",
              file=sys.stderr, flush=True)


def rank_arguments(args) -> list[str]:
    """The `python -m trainer train` arguments every rank gets."""
    argv = ["--preset", args.preset]
    for item in args.overrides:
        argv += ["--set", item]
    if args.world_size:
        argv += ["--world-size", str(args.world_size)]
    return argv + train_flags(args)


def train_flags(args) -> list[str]:
    """--resume and --rehearse as the launch got them, for every rank's train."""
    argv = []
    if args.resume is not None:
        argv += ["--resume", args.resume]
    if args.rehearse:
        argv.append("--rehearse")
    return argv


def check_topology(args, nproc: int) -> None:
    problems = []
    if nproc < 1:
        problems.append(f"--nproc-per-node={nproc} must be >= 1")
    if args.nnodes < 1 or not 0 <= args.node_rank < args.nnodes:
        problems.append(f"--node-rank={args.node_rank} must be in [0, --nnodes={args.nnodes})")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        problems.append(f"--master-port={args.master_port} is not a port")
    if problems:
        raise UserError("; ".join(problems))


def start_ranks(train_args: list[str], nproc: int, args, signals: LaunchSignals = GUARD) -> list[subprocess.Popen]:
    """This node's ranks, started in the launcher's process group; each is adopted by `signals` the moment
    it exists (a signal that came while the earlier ones started reaches it too). The caller keeps the
    Popen objects: subprocess reaps the exited children of dropped ones, and their exit codes would be lost."""
    world = args.nnodes * nproc
    ranks = []
    for local_rank in range(nproc):
        if local_rank:
            hold("between-ranks")
        rank = args.node_rank * nproc + local_rank
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(nproc), "NODE_RANK": str(args.node_rank), "GROUP_RANK": str(args.node_rank),
               # what the deepspeed runner sets too (DeepSpeed's CPU shared-memory all-reduce reads LOCAL_SIZE)
               "LOCAL_SIZE": str(nproc), "CROSS_RANK": str(args.node_rank), "CROSS_SIZE": str(args.nnodes),
               "MASTER_ADDR": args.master_addr, "MASTER_PORT": str(args.master_port), "PYTHONUNBUFFERED": "1"}
        ranks.append(subprocess.Popen([sys.executable, "-m", "trainer", "train", *train_args], env=env))
        signals.adopt(ranks[-1].pid, rank)
    return ranks


class Supervisor:
    """Forwards signals to the ranks (through `signals`, whose children are the live ranks), reaps every child
    (PID 1 duty), and turns the ranks' exits into one code."""

    def __init__(self, ranks: dict[int, int], failure_grace_s: float, signals: Optional[LaunchSignals] = None,
                 processes: list[subprocess.Popen] = (), through_ranks: bool = False):
        self.signals = signals or GUARD
        if through_ranks:  # a launcher program that does not pass signals on: they go to the ranks under it
            self.signals.through_ranks.update(ranks)
        self.processes = list(processes)  # held, so subprocess never reaps them behind reap()'s back
        self.installed_here = self.signals.install()  # False under `python -m trainer launch`: installed at start
        if ranks:
            self.signals.starting = True  # they exist: a signal from now on is theirs
        for pid, rank in ranks.items():
            self.signals.adopt(pid, rank)
        self.live = self.signals.children
        self.codes: dict[int, int] = {}
        self.first_failure: tuple[int, int] | None = None  # (rank, code)
        self.failure_grace_s = failure_grace_s
        self.kill_at: float | None = None

    @property
    def signalled(self) -> bool:
        return self.signals.signalled

    def run(self) -> int:
        try:
            while self.live:
                self.signals.deliver()
                self.reap()
                if self.kill_at is not None and time.monotonic() >= self.kill_at:
                    self.kill_the_rest()
                time.sleep(POLL_S)
        finally:
            if self.installed_here:
                self.signals.restore()
        return self.exit_code()

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:  # no children left at all
                self.live.clear()
                return
            if pid == 0:
                return
            if pid not in self.live:
                continue  # an orphan reparented to us (we are PID 1): reaped, nothing else to do
            rank, code = self.live.pop(pid), os.waitstatus_to_exitcode(status)
            code = 128 - code if code < 0 else code  # killed by signal N -> 128+N, as a shell reports it
            self.codes[rank] = code
            if code != 0 and self.first_failure is None:
                self.first_failure = (rank, code)
                if self.live:
                    print(f"launch: rank {rank} exited with code {code}; the other {len(self.live)} rank(s) get "
                          f"{self.failure_grace_s:g}s to exit, then are killed (a checkpoint needs every rank)",
                          file=sys.stderr, flush=True)
                    self.kill_at = time.monotonic() + self.failure_grace_s

    def kill_the_rest(self) -> None:
        for pid in self.live:
            send(pid, signal.SIGKILL)
        self.kill_at = None

    def exit_code(self) -> int:
        if self.first_failure is None:
            if self.signalled:
                print("launch: every rank exited 0 after the signal (checkpoint saved); resume with --resume auto",
                      file=sys.stderr, flush=True)
            return 0
        rank, code = self.first_failure
        if self.signalled and len(self.codes) > 1:
            print("launch: exit codes by rank: " + ", ".join(f"{r}: {c}" for r, c in sorted(self.codes.items())),
                  file=sys.stderr, flush=True)
        print(f"launch: failed: rank {rank} exited with code {code}", file=sys.stderr, flush=True)
        return code
