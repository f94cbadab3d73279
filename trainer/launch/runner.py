"""Running a checked launch with DeepSpeed's runner, torchrun, or sbatch: the command printed in full, the
fabric exported (the environment; DeepSpeed's pdsh runner also DS_ENV_FILE), `launch.json` written, then the
launcher started under the supervisor (signals forwarded, its exit code kept)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

from ..errors import UserError
from ..files import write_text_atomic
from ..resolve import Resolved
from . import supervisor
from .command import Rendezvous, cpu_offloaded, train_argv
from .fabric import Fabric
from .record import deepspeed_env_file, print_command, record_launch, script_path
from .slurm import SlurmJob, sbatch_script
from .topology import Topology


def run_launcher(args, resolved: Resolved, topology: Topology, fabric: Optional[Fabric], train_args: list[str]) -> int:
    if topology.launcher == "slurm":
        return run_slurm(args, resolved, topology, fabric, train_args)
    env = dict(fabric.env) if fabric else {}
    extra_record = {}
    if topology.launcher == "deepspeed" and topology.nodes > 1 and fabric:
        path, text = deepspeed_env_file(resolved, fabric, args.dry_run)
        env["DS_ENV_FILE"] = path  # absolute: DeepSpeed's os.path.join(~ and ., name) both resolve to it
        extra_record = {"deepspeed_env": {"path": path, "text": text}}
        if args.dry_run:
            print(f"launch: {path} (DS_ENV_FILE, read by DeepSpeed's runner for every node) would hold:\n"
                  + text.rstrip(), flush=True)
    words = launcher_words(args, resolved, topology, tuple(env.items()), train_args)
    print_command(words)
    if args.dry_run:
        return 0
    program = installed(words[len(env)])
    if topology.launcher != "torchrun" or not args.node_rank:  # torchrun runs on every node: node 0 records
        record_launch(resolved, args, topology, fabric, words, extra_record)
    proc = subprocess.Popen([program, *words[len(env) + 1:]], env={**os.environ, **env})
    return supervisor.Supervisor({proc.pid: 0}, args.failure_grace_s).run()


def launcher_words(args, resolved: Resolved, topology: Topology, env, train_args: list[str]) -> list[str]:
    where = Rendezvous(hostfile=topology.hostfile.path if topology.hostfile else "hostfile",
                       master_addr=args.master_addr or torchrun_master(args, topology), master_port=args.master_port,
                       node_rank=args.node_rank if args.node_rank is not None else "$NODE_RANK",
                       ssh_port=args.ssh_port, rdzv_backend=args.rdzv_backend, rdzv_id=args.rdzv_id)
    if topology.launcher == "torchrun" and topology.nodes > 1 and not args.dry_run:
        check_torchrun_node(args, topology)
    return train_argv(args.preset, args.overrides, topology.nodes, topology.ranks_per_node, cpu_offloaded(resolved),
                      topology.world_size, topology.launcher, env, where, train_args, script_path())


def torchrun_master(args, topology: Topology) -> Optional[str]:
    """torchrun with a hostfile: node 0 (its first host) is the rendezvous host."""
    return topology.hostfile.first_host if topology.launcher == "torchrun" and topology.hostfile else None


def check_torchrun_node(args, topology: Topology) -> None:
    if args.rdzv_backend:
        if not args.master_addr and not topology.hostfile:
            raise UserError("--rdzv-backend c10d: give --master-addr HOST (the rendezvous endpoint, the same on "
                            "every node)")
        return
    problems = []
    if args.node_rank is None or not 0 <= args.node_rank < topology.nodes:
        problems.append(f"--node-rank: this node's index in 0..{topology.nodes - 1} (each node runs the launch "
                        f"with its own), e.g. --node-rank $SLURM_NODEID")
    if not args.master_addr and not topology.hostfile:
        problems.append("--master-addr: the address of node 0, the same on every node")
    if problems:
        raise UserError(f"torchrun on {topology.nodes} nodes needs " + "; ".join(problems))


def installed(program: str) -> str:
    """The program on PATH, else beside this Python (a venv's deepspeed/torchrun, not activated)."""
    beside = Path(sys.executable).parent / program
    found = shutil.which(program) or (str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None)
    if found is None:
        where = {"deepspeed": "it comes with DeepSpeed", "torchrun": "it comes with torch"}.get(
            program, "run this on the cluster's login node, where Slurm is installed")
        raise UserError(f"{program} is not on PATH: {where} (activate the environment the trainer is installed "
                        f"in)" if program != "sbatch" else f"sbatch is not on PATH: {where}")
    return found


def run_slurm(args, resolved: Resolved, topology: Topology, fabric: Optional[Fabric], train_args: list[str]) -> int:
    """Write `<output_dir>/job.sbatch` and submit it with sbatch (printed first; --dry-run prints the script)."""
    cfg = resolved.config
    run_dir = str(Path(cfg.train.output_dir).resolve())
    job = SlurmJob(nodes=topology.nodes, gpus_per_node=0 if cfg.hardware.gpu == "cpu" else topology.ranks_per_node,
                   ranks_per_node=topology.ranks_per_node, time=args.time or "24:00:00",
                   grace_s=300 if args.signal_grace_s is None else args.signal_grace_s,
                   run_dir=run_dir, job_name=cfg.name or Path(args.preset).stem, partition=args.partition,
                   account=args.account)
    script = sbatch_script(job, args.preset, args.overrides, topology.world_size, fabric.env if fabric else (),
                           train_args, sys.executable, os.getcwd(), args.master_port or 29500)
    path = os.path.join(run_dir, "job.sbatch")
    words = ["sbatch", path]
    if args.dry_run:
        print(f"launch: {path} would hold:\n{script}", flush=True)
        print_command(words)
        return 0
    sbatch = installed("sbatch")
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, script, flag="job.sbatch")
    record_launch(resolved, args, topology, fabric, words, {"sbatch_script": path})
    print_command(words)
    return subprocess.run([sbatch, path]).returncode
