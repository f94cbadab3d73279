"""`python -m trainer autotune PRESET`: DeepSpeed's autotuner over what the planner says fits, the best config
written as a new preset.

    python -m trainer autotune 7b_8xa100 --dry-run          # print the tuning config and the command (any machine)
    python -m trainer autotune 7b_8xa100                    # on the GPU node: tune, then write the preset
    python -m trainer autotune 7b_8xa100 --from-results runs/autotune/7b_8xa100/results   # only write the preset

Both halves DeepSpeed needs are generated: the `autotuning` block in a DeepSpeed JSON (trainer/ds/autotuning.py:
the preset's resolved config, ZeRO stages and micro-batches cut to what fits, the preset's global batch kept),
and `deepspeed --autotuning tune ... train.py --preset P --deepspeed_config THAT.json`; DeepSpeed then launches
one short run per experiment (train.py takes each experiment's config as the preset's DeepSpeed section).
`--autotuning tune`, not `run`: `run` relaunches the best experiment's own command, whose config still has
autotuning on, so it stops again after end_profile_step; train the written preset instead.
CUDA only: the autotuner times CUDA events and sizes micro-batches from GPU memory; on CPU it refuses.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from .. import numbers, paths
from .. import ds as dsc
from ..errors import UserError
from ..files import check_target, write_text_atomic
from ..options import add_preset_arguments, load_and_resolve
from ..presets import PRESET_DIR, with_overrides
from .results import preset_document, read_results
from .space import describe, search_space


# The experiments' own runs, kept out of the preset's run directory and its checkpoints (no resume from them).
EXPERIMENT_SETS = ("train.resume=null", "train.save_every=0", "train.eval_every=0", "logging.wandb_mode=disabled")


def autotune_arguments(parser: argparse.ArgumentParser) -> None:
    add_preset_arguments(parser)
    parser.add_argument("--dir", type=paths.output_dir("autotuning directory"),
                        help="autotuning directory: config, experiments, results (default runs/autotune/"
                                      "PRESET)")
    parser.add_argument("-o", "--output", type=paths.output_file("preset", suffixes=(".yaml", ".yml")),
                        help="the preset to write (default presets/PRESET_autotuned.yaml)")
    parser.add_argument("--metric", choices=("throughput", "latency", "flops"), default="throughput",
                        help="what the autotuner maximises (default throughput)")
    parser.add_argument("--full", action="store_true", help="after the micro-batches, also tune each stage's ZeRO "
                                                            "buckets and overlap (fast=false: many more runs)")
    parser.add_argument("--profile-steps", type=numbers.COUNT, nargs=2, default=(3, 5), metavar=("START", "END"),
                        help="steps timed in each experiment (default 3 5)")
    parser.add_argument("--master-port", type=numbers.PORT, default=29500,
                        help="first experiment's port (each adds one)")
    parser.add_argument("--dry-run", action="store_true", help="print the tuning config and the command; run nothing")
    parser.add_argument("--from-results", metavar="DIR", type=paths.input_dir("results directory"),
                        help="write the preset from a finished autotuning results "
                                                              "dir (no tuning)")


def autotune(args) -> int:
    resolved = load_and_resolve(args)
    name = Path(args.preset).stem
    work = Path(args.dir or f"runs/autotune/{name}")
    output = args.output or str(PRESET_DIR / f"{name}_autotuned.yaml")
    check_target(output, "-o")
    if not args.from_results:  # the default --dir too, for a dry run as for the real one (which creates it)
        paths.output_dir("autotuning directory (--dir)").check(str(work))
    space = search_space(resolved)
    if args.from_results:  # writing needs no GPU
        return write_preset(args, read_results(args.from_results), output, space)
    if resolved.config.hardware.gpu == "cpu":
        raise UserError(f"preset {args.preset} runs on CPU ranks (hardware.gpu: cpu): DeepSpeed's autotuner profiles "
                        f"CUDA (CUDA-event timers, GPU memory for the micro-batch range); tune a GPU preset on its "
                        f"GPUs")
    if not space.stages:
        left_out = "\n  ".join(space.left_out)
        raise UserError(f"nothing the autotuner can run fits these GPUs (the planner):\n  {left_out}\ntrain "
                        f"{args.preset} as planned (`python -m trainer plan --model {args.preset}`) instead")
    config, command = tuning_job(args, resolved, space, work)
    for line in describe(space):
        print(f"search space: {line}", file=sys.stderr)
    if args.dry_run:
        print(json.dumps(config, indent=2))
        print(" ".join(command))
        for problem in runtime_problems():  # the machine, not the inputs: a dry run may be made anywhere
            print(f"autotune: --dry-run: note: the real run here would stop: {problem}", file=sys.stderr)
        return 0
    problems = runtime_problems()
    if problems:
        raise UserError(problems[0])
    if shutil.which("pdsh") is None:
        print("autotune: pdsh is not installed: DeepSpeed cleans up after each experiment with pdsh (pkill); "
              "the experiments still run, each ending with a FileNotFoundError in the log", file=sys.stderr)
    work.mkdir(parents=True, exist_ok=True)
    write_text_atomic(str(work / "ds_config_autotuning.json"), json.dumps(config, indent=2) + "\n", "--dir")
    print(f"autotune: {' '.join(command)}", file=sys.stderr, flush=True)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    code = subprocess.run(command, env=env).returncode  # the experiments call `deepspeed` by name
    if code != 0:
        raise UserError(f"the autotuner exited with code {code}; its experiments' logs are under {work / 'results'}")
    return write_preset(args, read_results(work / "results"), output, space)


def tuning_job(args, resolved, space, work: Path) -> tuple[dict, list[str]]:
    """The tuning config (with its experiments checked against the installed DeepSpeed) and the command."""
    from ..launch.command import command_for
    start, end = args.profile_steps
    if not 1 <= start < end:
        raise UserError(f"--profile-steps {start} {end}: need 1 <= START < END")
    block = dsc.autotuning_block(str(work / "results"), str(work / "experiments"), dsc.autotp_size(resolved.ds),
                                 args.metric, fast=not args.full, start_profile_step=start, end_profile_step=end)
    config = dsc.tuning_config(resolved.ds, space.stages, space.micro_batches, space.per_rank_batch, block)
    for experiment in dsc.experiment_configs(config):
        problems = dsc.check_keys(experiment)
        if problems:  # the builder's bug, not the user's
            raise RuntimeError(f"autotuning experiment config rejected by the installed DeepSpeed: {problems}")
    sets = with_overrides(args.overrides, [*EXPERIMENT_SETS, f"train.output_dir={work / 'run'}"])
    line = command_for(resolved, args.preset, sets, args.world_size).split(" ")
    if line[0] != "deepspeed":
        raise RuntimeError(f"expected a deepspeed launch line, got {line[0]}")
    command = ["deepspeed", "--autotuning", "tune", "--master_port", str(args.master_port), *line[1:],
               "--deepspeed_config", str(work / "ds_config_autotuning.json")]
    return config, command


def runtime_problems() -> list[str]:
    """What this machine lacks for tuning: the real run stops at the first, a dry run names them as notes."""
    import torch
    problems = []
    if not torch.cuda.is_available():
        problems.append("autotune needs CUDA GPUs: DeepSpeed's autotuner times CUDA events and sizes micro-batches "
                        "from GPU memory, and none is visible here; run it on the GPU node (--dry-run prints the "
                        "config and the command on any machine)")
    if importlib.util.find_spec("tabulate") is None:  # DeepSpeed's Autotuner asserts it is installed
        problems.append("DeepSpeed's autotuner needs the tabulate package: pip install tabulate==0.10.0 (or "
                        "pip install -e '.[gpu]')")
    return problems


def write_preset(args, best, output: str, space) -> int:
    name = Path(output).stem
    text = preset_document(args.preset, args.overrides, best, name, describe(space))
    if args.dry_run:  # the same reading and checks as for real; only the write is left out
        print(text, end="")
        print(f"autotune: --dry-run: {output} would hold the preset above; nothing was written", file=sys.stderr)
        return 0
    write_text_atomic(output, text, "-o")
    print(f"autotune: best {best.experiment}: {best.samples_per_s:.2f} samples/s; wrote preset {output}",
          file=sys.stderr)
    return 0
