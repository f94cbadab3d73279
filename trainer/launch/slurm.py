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
import shlex
from dataclasses import dataclass
from typing import Optional

from ..errors import UserError
from .command import Rendezvous, join, train_argv


TIME = re.compile(r"^(\d+-)?\d+(:\d{2}){0,2}$")  # Slurm's formats: MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]


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


def check_job(job: SlurmJob) -> None:
    problems = []
    if not TIME.match(job.time):
        problems.append(f"--time {job.time!r}: not a Slurm time (MM, HH:MM:SS or D-HH:MM:SS)")
    if job.grace_s < 30:
        problems.append(f"--signal-grace-s {job.grace_s}: under 30 s leaves no time to save a checkpoint; give the "
                        f"seconds a save takes on this preset, with margin")
    if problems:
        raise UserError("; ".join(problems))


def sbatch_script(job: SlurmJob, preset: str, overrides: list[str], world_size: int, env: tuple[tuple[str, str], ...],
                  train_args: list[str], python: str, workdir: str, master_port: int) -> str:
    check_job(job)
    node_launcher = join(train_argv(preset, overrides, job.nodes, job.ranks_per_node, world_size=world_size,
                                    launcher="local", where=Rendezvous(master_port=master_port,
                                                                       node_rank="$SLURM_NODEID"),
                                    train_args=train_args, python=python))
    run_dir = shlex.quote(job.run_dir)
    lines = ["#!/bin/bash",
             f"# {job.job_name}: {job.nodes} node(s) x {job.ranks_per_node} rank(s), written by python -m trainer "
             f"launch --launcher slurm",
             f"#SBATCH --job-name={job.job_name}",
             f"#SBATCH --nodes={job.nodes}",
             "#SBATCH --ntasks-per-node=1",  # one node-local launcher per node; it starts the node's ranks
             f"#SBATCH --cpus-per-task={max(1, job.ranks_per_node)}"]
    if job.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={job.gpus_per_node}")
    lines += [f"#SBATCH --time={job.time}",
              f"#SBATCH --signal=TERM@{job.grace_s}",
              f"#SBATCH --output={job.run_dir}/slurm-%j.out"]
    lines += [f"#SBATCH --partition={job.partition}"] if job.partition else []
    lines += [f"#SBATCH --account={job.account}"] if job.account else []
    lines += ["set -euo pipefail", f"cd {shlex.quote(workdir)}", "",
              "# the fabric profile, exported to every rank (srun passes the environment on)"]
    lines += [f"export {name}={shlex.quote(value)}" for name, value in env]
    lines += ["",
              "# the allocation's nodes: node 0 is the rendezvous host",
              'HOSTS=$(scontrol show hostnames "$SLURM_JOB_NODELIST")',
              'export MASTER_ADDR=$(echo "$HOSTS" | head -n 1)',
              f"mkdir -p {run_dir}",
              f'echo "$HOSTS" | sed "s/$/ slots={job.ranks_per_node}/" > {run_dir}/hostfile.$SLURM_JOB_ID',
              f'echo "launch: nodes $(echo $HOSTS), master $MASTER_ADDR:{master_port}, hostfile '
              f'{job.run_dir}/hostfile.$SLURM_JOB_ID"',
              "",
              "# one node-local launcher per node; $SLURM_NODEID is expanded on each node, not here.",
              "# --kill-on-bad-exit: a failed node ends the step instead of leaving the others in a collective",
              f"srun --nodes={job.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c "
              f"{shlex.quote('exec ' + node_launcher)}",
              ""]
    return "\n".join(lines)
