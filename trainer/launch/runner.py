"""Running a checked launch with DeepSpeed's runner, torchrun, or sbatch: the command printed in full, the
fabric exported (the environment; DeepSpeed's pdsh runner also DS_ENV_FILE, `dsenv`), `launch.json` written,
then the launcher started under the supervisor (signals forwarded, its exit code kept)."""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

from ..errors import UserError
from ..files import write_text_atomic
from ..redact import redact_argv
from ..resolve import Resolved
from . import supervisor
from .command import Rendezvous, cpu_offloaded, train_argv
from .dsenv import EnvFile, deepspeed_env_file, start_redacted
from .fabric import Fabric
from .record import owns_run_directory, print_command, record_launch, script_path, set_aside_for_a_fresh_launch
from ..shell import export_value_problem, pdsh_word_problem
from .signals import GUARD
from .slurm import SlurmJob, sbatch_script
from .topology import Topology


def run_launcher(args, resolved: Resolved, topology: Topology, fabric: Optional[Fabric], train_args: list[str]) -> int:
    if topology.launcher == "slurm":
        return run_slurm(args, resolved, topology, fabric, train_args)
    over_pdsh = topology.launcher == "deepspeed" and topology.hostfile is not None  # one host too (--force_multi)
    if over_pdsh:  # before anything is written
        words = launcher_words(args, resolved, topology, (), train_args)
        check_pdsh_words(words[words.index(script_path()):], words[0])
    run_dir = Path(resolved.config.train.output_dir)
    if not args.dry_run and owns_run_directory(args, topology.launcher):  # before this launch's writes
        set_aside_for_a_fresh_launch(resolved, getattr(args, "starts_fresh", False))
    with (deepspeed_env_file(fabric, run_dir, args.dry_run) if over_pdsh else contextlib.nullcontext()) as env_file:
        return start_launcher(args, resolved, topology, fabric, train_args, env_file)


def start_launcher(args, resolved: Resolved, topology: Topology, fabric: Optional[Fabric], train_args: list[str],
                   env_file: Optional[EnvFile]) -> int:
    env = dict(fabric.env) if fabric else {}
    extra_record = {}
    if env_file:
        env["DS_ENV_FILE"] = env_file.path  # absolute: DeepSpeed's os.path.join(~ and ., name) both resolve to it
        extra_record = {"deepspeed_env": env_file.as_dict()}
        if args.dry_run:
            print_deepspeed_env(env_file)
    words = launcher_words(args, resolved, topology, tuple(env.items()), train_args)
    print_command(words)
    if args.dry_run:
        note_if_missing(words[len(env)])
        return 0
    program = installed(words[len(env)])
    if owns_run_directory(args, topology.launcher):
        record_launch(resolved, args, topology, fabric, words, extra_record)
    stopped = GUARD.stop_code()
    if stopped is not None:
        return stopped
    proc, finish = start_redacted([program, *words[len(env) + 1:]], {**os.environ, **env},
                                  env_file.env.secret_values if env_file else [])
    # Signals go to this node's ranks, not to the launcher program: DeepSpeed's runner on one node dies of one (its
    # ranks run on), torchrun exits 1 after its ranks saved. Over pdsh the ranks are on other hosts: DeepSpeed's
    # runner passes the signal on itself there.
    code = supervisor.Supervisor({proc.pid: 0}, args.failure_grace_s, processes=[proc],
                                 through_ranks=not env_file).run()
    finish()
    return code


def print_deepspeed_env(env_file: EnvFile) -> None:
    if env_file.path == env_file.record:
        print(f"launch: {env_file.path} (DS_ENV_FILE, read by DeepSpeed's runner for every node) would hold:\n"
              + env_file.env.text().rstrip(), flush=True)
        return
    print(f"launch: {env_file.record} would hold (secrets as <redacted>: DS_ENV_FILE names a private 0600 copy "
          f"with their values, outside the run directory, removed when DeepSpeed's runner exits):\n"
          + env_file.env.text().rstrip(), flush=True)


def check_pdsh_words(remote: list[str], program: str) -> None:
    """What DeepSpeed's pdsh runner pastes into the command line each node's shell runs (`export NAME=value;
    ... cd <cwd>; <python> -m deepspeed.launcher.launch ... <script> <arguments>`) must reach it intact:
    refused here otherwise. (The DS_ENV_FILE lines are checked where they are read, `dsenv`.)"""
    named = [("the working directory (each node runs `cd` to it)", os.getcwd()),
             ("the Python of DeepSpeed's runner", interpreter(program))] + [("argument", w) for w in remote]
    problems = [f"{what} {word!r}: {pdsh_word_problem(word)}" for what, word in named if pdsh_word_problem(word)]
    prefixes = exported_prefixes()
    problems += [f"the environment variable {name} (DeepSpeed's runner exports every {'*, '.join(prefixes)}* "
                 f"variable to each node): {export_value_problem(value)}" for name, value in sorted(os.environ.items())
                 if name.startswith(prefixes) and export_value_problem(value)]
    if problems:
        raise UserError("launch --hostfile: DeepSpeed's pdsh runner pastes these into the command line each node's "
                        "shell runs:\n  " + "\n  ".join(problems) + "\nput such a value in a preset file (--preset "
                        "FILE.yaml), launch from a plain directory, fix the variable, or use --launcher torchrun or "
                        "slurm (they pass arguments as data)")


def exported_prefixes() -> tuple[str, ...]:
    """The variables DeepSpeed's runner copies from its environment into every node's `export`s."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.launcher.runner import EXPORT_ENVS
    return tuple(EXPORT_ENVS) + tuple(get_accelerator().export_envs())


def interpreter(program: str) -> str:
    """The Python that runs `program` (its #! line), where DeepSpeed's runner takes sys.executable from."""
    path = shutil.which(program) or str(Path(sys.executable).parent / program)
    try:
        with open(path, "rb") as handle:
            first = handle.readline(4096).decode("utf-8", "replace")
    except OSError:
        return sys.executable
    return first[2:].split()[0] if first.startswith("#!") and first[2:].split() else sys.executable


def launcher_words(args, resolved: Resolved, topology: Topology, env, train_args: list[str]) -> list[str]:
    where = Rendezvous(hostfile=topology.hostfile.path if topology.hostfile else "hostfile",
                       master_addr=args.master_addr or torchrun_master(args, topology), master_port=args.master_port,
                       node_rank=args.node_rank if args.node_rank is not None else "$NODE_RANK",
                       ssh_port=args.ssh_port, rdzv_backend=args.rdzv_backend, rdzv_id=args.rdzv_id,
                       hostfile_given=topology.hostfile is not None)
    if topology.launcher == "torchrun" and topology.nodes > 1:  # a dry run is checked as the real one
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


def note_if_missing(program: str) -> None:
    """A dry run checks everything the real one does; the program is the machine's, so it is a note (a Slurm
    script or a launch line may be previewed anywhere)."""
    try:
        installed(program)
    except UserError as err:
        print(f"launch: --dry-run: note: the real launch here would stop: {err}", file=sys.stderr, flush=True)


def run_slurm(args, resolved: Resolved, topology: Topology, fabric: Optional[Fabric], train_args: list[str]) -> int:
    """Write `<output_dir>/job.sbatch` and submit it with sbatch (printed first; --dry-run prints the script)."""
    cfg = resolved.config
    run_dir = str(Path(cfg.train.output_dir).resolve())
    job = SlurmJob(nodes=topology.nodes, gpus_per_node=0 if cfg.hardware.gpu == "cpu" else topology.ranks_per_node,
                   ranks_per_node=topology.ranks_per_node, time="24:00:00" if args.time is None else args.time,
                   grace_s=300 if args.signal_grace_s is None else args.signal_grace_s,
                   run_dir=run_dir, job_name=cfg.name or Path(args.preset).stem, partition=args.partition,
                   account=args.account,
                   job_name_source="name (the preset's name; --set name=JOB)" if cfg.name else
                   f"the preset file name {Path(args.preset).name!r} (the job name; --set name=JOB)")
    check_no_literal_secrets(args.overrides, train_args)
    script = sbatch_script(job, args.preset, args.overrides, topology.world_size, fabric.env if fabric else (),
                           train_args, sys.executable, os.getcwd(), args.master_port or 29500)
    path = os.path.join(run_dir, "job.sbatch")
    words = ["sbatch", path]
    if args.dry_run:
        print(f"launch: {path} would hold:\n{script}", flush=True)
        print_command(words)
        note_if_missing("sbatch")
        return 0
    sbatch = installed("sbatch")
    set_aside_for_a_fresh_launch(resolved, getattr(args, "starts_fresh", False))
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, script, flag="job.sbatch")
    record_launch(resolved, args, topology, fabric, words, {"sbatch_script": path})
    print_command(words)
    stopped = GUARD.stop_code()
    if stopped is not None:
        return stopped
    return subprocess.run([sbatch, path]).returncode


def check_no_literal_secrets(overrides: list[str], train_args: list[str]) -> None:
    """The script is kept in the run directory: a secret given literally would lie there."""
    argv = [word for item in overrides for word in ("--set", item)] + list(train_args)
    literal = [f"--set {word.partition('=')[0]}=..." for word, shown in zip(argv, redact_argv(argv)) if word != shown]
    if literal:
        raise UserError(f"launch --launcher slurm: {', '.join(literal)} would write a secret into job.sbatch in the "
                        f"run directory; give it as env:VARIABLE (e.g. --set deepspeed.comet.api_key=env:COMET_API_KEY)"
                        f" and export VARIABLE before the launch: sbatch passes this environment on to the job")
