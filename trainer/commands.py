"""The commands of `python -m trainer` as data: the module that implements each, its purpose in one line, an example
that works, and the page of docs/ to read. `--help` is the first doc a user opens, so every command's help ends with
its example and its page (tests/test_docs.py checks both).

Light on purpose: nothing here imports a command's module, so `python -m trainer` and `--help` stay fast and never
import torch or DeepSpeed.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class Command:
    module: str    # where `<name>_arguments(parser)` and `<name>(args)` live
    purpose: str   # one line, shown in the command list
    example: str   # one command line that works as written
    page: str      # the docs/ page (and anchor) that explains the job
    heavy: bool = False  # imports torch, DeepSpeed or datasets to do its work; every other command stays light
                         # (tests/test_light_commands.py holds each of those to it)


COMMANDS = {
    "presets": Command("trainer.show", "list the shipped presets",
                       "python -m trainer presets", "docs/training.md#presets"),
    "show": Command("trainer.show", "print a preset's fully resolved config and derived numbers",
                    "python -m trainer show tiny_cpu --set train.lr=1e-3 --world-size 4", "docs/training.md#presets"),
    "export": Command("trainer.show", "write a preset's resolved DeepSpeed JSON",
                      "python -m trainer export 70b_8xa100 -o ds_config.json", "docs/training.md#presets"),
    "train": Command("trainer.train.cli", "train (run it under deepspeed/torchrun; same as train.py)",
                     "deepspeed --num_gpus 2 train.py --preset tiny_cpu --set train.max_steps=50",
                     "docs/training.md", heavy=True),
    "launch": Command("trainer.launch.cli", "start a preset's ranks: deepspeed (hostfile), torchrun, slurm or node-local",
                      "python -m trainer launch 70b_32xa100 --launcher slurm --time 2-00:00:00 --dry-run",
                      "docs/multi-node.md"),
    "preflight": Command("trainer.preflight.cli", "before a run: bus bandwidth, free memory, same versions and config "
                                                  "on every rank",
                         "deepspeed --num_gpus 2 --module trainer preflight --preset tiny_cpu --json preflight.json",
                         "docs/multi-node.md#preflight", heavy=True),
    "autotune": Command("trainer.autotune.cli", "run DeepSpeed's autotuner over what the planner says fits (CUDA)",
                        "python -m trainer autotune 7b_8xa100 --dry-run", "docs/plan-doctor-lint.md#autotuning",
                        heavy=True),
    "plan": Command("trainer.plan.cli", "choose ZeRO stage, offload, micro-batch and launch line for a model and GPUs",
                    "python -m trainer plan --model 70b --gpu a100-80g --gpus-per-node 8 --task full",
                    "docs/plan-doctor-lint.md#plan"),
    "doctor": Command("trainer.diagnose.doctor", "diagnose a failed run's log and propose the next change",
                      "python -m trainer doctor 7b_8xa100 tests/logs/real/cuda_oom_1.log",
                      "docs/plan-doctor-lint.md#doctor"),
    "lint": Command("trainer.diagnose.lint", "check a resolved preset against the tuning checklist",
                    "python -m trainer lint 70b_32xa100", "docs/plan-doctor-lint.md#lint"),
    "prepare-data": Command("trainer.data.cli", "tokenize a preset's data once into token shards on disk",
                            "python -m trainer prepare-data --preset 1b_pretrain_8xh100", "docs/data.md",
                            heavy=True),
    "generate": Command("trainer.infer.generate", "complete prompts with a trained model (init_inference, TP, "
                                                  "ZeRO-Inference)",
                        'python -m trainer generate --model runs/tiny_cpu --prompt "Once upon a time" --greedy',
                        "docs/inference.md#generate", heavy=True),
    "evaluate": Command("trainer.infer.evaluate", "loss and perplexity of a model on data, or of a run on its eval set; "
                                              "preference pairs: accuracy and reward margin",
                        "python -m trainer evaluate --model runs/tiny_cpu", "docs/inference.md#evaluate",
                        heavy=True),
    "report": Command("trainer.report.cli", "draw runs' metrics.jsonl (loss, lr, grad norm, tokens/s, memory) as "
                                            "PNG or HTML",
                      "python -m trainer report runs/tiny_cpu -o report.png", "docs/experiments.md#report"),
}

SUMMARY = "a reference LLM training framework on DeepSpeed, with presets named by model and hardware"
FIRST_READ = "README.md (the two commands, a tour), then docs/ (one page per job)"


def subparser_options(name: str) -> dict:
    """What `add_parser` gets for a command: its purpose as help and description, and an epilog with the example and
    the page to read (raw, so the example keeps its line)."""
    command = COMMANDS[name]
    return dict(help=command.purpose, description=command.purpose[0].upper() + command.purpose[1:] + ".",
                epilog=f"example:\n  {command.example}\n\nread: {command.page}",
                formatter_class=argparse.RawDescriptionHelpFormatter)


def listing() -> str:
    """`python -m trainer` alone: every command with its one line, and where to read on."""
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {command.purpose}" for name, command in COMMANDS.items())
    return (f"python -m trainer <command> [flags]: {SUMMARY}\n\ncommands:\n{rows}\n\n"
            f"python -m trainer <command> --help: its flags, an example and the page to read.\n"
            f"first read: {FIRST_READ}\n")
