"""An sbatch script for a preset: one task per node, each running the node-local launcher, so the
preemption promise holds under Slurm.

`#SBATCH --signal=TERM@<grace>` has Slurm send SIGTERM to every job step's tasks (the node-local launchers,
which forward it to their ranks and wait for the checkpoint) <grace> seconds before the time limit kills the
job; the batch shell itself is not signalled (that would be `B:`), it just waits for srun. The node list,
master address and a DeepSpeed-style hostfile (kept in the run directory, for the record and for `preflight`)
come from the allocation: `scontrol show hostnames "$SLURM_JOB_NODELIST"`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from ..errors import UserError
from .command import Rendezvous, train_argv
from ..shell import ShellVariable, export, join, quote, sbatch_token


TIME = re.compile(r"(\d+-)?\d+(:\d{2}){0,2}")  # Slurm's formats: MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]


@dataclass(frozen=True)
class SlurmJob:
    nodes: int
    gpus_per_node: int            # 0: CPU ranks, no --gpus-per-node
    ranks_per_node: int
    time: str                     # --time, the job's wall-clock limit
    grace_s: int                  # SIGTERM this long before the limit: time to save a checkpoint
    run_dir: str                  # train.output_dir: the Slurm log and the hostfile go there
    job_name: str
    partition: Optional[str] = None
    account: Optional[str] = None
    job_name_source: str = "name"  # where job_name came from, for an error about it


def check_job(job: SlurmJob) -> None:
    problems = []
    if not TIME.fullmatch(job.time):
        problems.append(f"--time {job.time!r}: not a Slurm time (MM, HH:MM:SS or D-HH:MM:SS)")
    if job.grace_s < 30:
        problems.append(f"--signal-grace-s {job.grace_s}: under 30 s leaves no time to save a checkpoint; give the "
                        f"seconds a save takes on this preset, with margin")
    if problems:
        raise UserError("; ".join(problems))


def directives(job: SlurmJob) -> list[str]:
    """The `#SBATCH` lines. sbatch parses them itself, not a shell: every value is checked to be one plain
    token (`sbatch_token`), named by its flag or key when it is not."""
    lines = [f"#SBATCH --job-name={sbatch_token(job.job_name, job.job_name_source)}",
             f"#SBATCH --nodes={job.nodes}",
             "#SBATCH --ntasks-per-node=1",  # one node-local launcher per node; it starts the node's ranks
             f"#SBATCH --cpus-per-task={max(1, job.ranks_per_node)}"]
    if job.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={job.gpus_per_node}")
    lines += [f"#SBATCH --time={sbatch_token(job.time, '--time')}",
              f"#SBATCH --signal=TERM@{job.grace_s}",
              f"#SBATCH --output={sbatch_token(job.run_dir, 'train.output_dir (the run directory)')}/slurm-%j.out"]
    lines += [f"#SBATCH --partition={sbatch_token(job.partition, '--partition')}"] if job.partition else []
    lines += [f"#SBATCH --account={sbatch_token(job.account, '--account')}"] if job.account else []
    return lines


def sbatch_script(job: SlurmJob, preset: str, overrides: list[str], world_size: int, env: tuple[tuple[str, str], ...],
                  train_args: list[str], python: str, workdir: str, master_port: int) -> str:
    """The script: directives, then a body where every value is a quoted word (`shell.quote`) or the
    launch's own shell variable; the run directory is named once, as RUN_DIR."""
    check_job(job)
    header = directives(job)
    node_launcher = join(train_argv(preset, overrides, job.nodes, job.ranks_per_node, world_size=world_size,
                                    launcher="local", where=Rendezvous(master_port=master_port,
                                                                       node_rank=ShellVariable("SLURM_NODEID")),
                                    train_args=train_args, python=python))
    lines = ["#!/bin/bash",
             f"# {job.job_name}: {job.nodes} node(s) x {job.ranks_per_node} rank(s), written by python -m trainer "
             f"launch --launcher slurm", *header,
             "set -euo pipefail", f"cd {quote(workdir)}", f"RUN_DIR={quote(job.run_dir)}", "",
             "# the fabric profile, exported to every rank (srun passes the environment on)"]
    lines += [export(name, value) for name, value in env]
    lines += ["",
              "# the allocation's nodes: node 0 is the rendezvous host",
              'HOSTS=$(scontrol show hostnames "$SLURM_JOB_NODELIST")',
              'export MASTER_ADDR=$(echo "$HOSTS" | head -n 1)',
              'mkdir -p "$RUN_DIR"',
              f'echo "$HOSTS" | sed "s/$/ slots={int(job.ranks_per_node)}/" > "$RUN_DIR/hostfile.$SLURM_JOB_ID"',
              f'echo "launch: nodes $(echo $HOSTS), master $MASTER_ADDR:{int(master_port)}, hostfile '
              f'$RUN_DIR/hostfile.$SLURM_JOB_ID"',
              "",
              "# one node-local launcher per node; $SLURM_NODEID is expanded on each node, not here.",
              "# --kill-on-bad-exit: a failed node ends the step instead of leaving the others in a collective",
              f"srun --nodes={job.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c "
              f"{quote('exec ' + node_launcher)}",
              ""]
    return "\n".join(lines)
