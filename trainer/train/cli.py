"""`python -m trainer train` (what `train.py` runs under deepspeed/torchrun): secrets kept out of the logs,
`--resume` as an override, the process group torn down however the run ends."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

from ..options import add_train_arguments
from ..presets import with_overrides
from ..redact import redact_argv, warn_about_literal_secrets
from ..resolve import launcher_world_size


def train_arguments(parser: argparse.ArgumentParser) -> None:
    add_train_arguments(parser)  # shared with `launch`, which passes them on to every rank
    # DeepSpeed's autotuner (`python -m trainer autotune`) runs each experiment as train.py ... --deepspeed_config
    # <base64 JSON>: that config becomes the preset's whole DeepSpeed section for the experiment
    parser.add_argument("--deepspeed_config", help=argparse.SUPPRESS)


def config_source(args) -> tuple[str, list[str], Optional[int]]:
    """What a rank's config is resolved from: the preset, its overrides (an autotuner experiment's DeepSpeed
    section folded in) and the world size. `launch` compares it with and without the words after `--`: a word
    that changes it would make the ranks run a config the launcher never checked. (--resume is where the run
    starts, not what it is: it is folded in by `train` below.)"""
    overrides = list(args.overrides)
    if args.deepspeed_config:
        from .. import ds as dsc
        experiment = dsc.experiment_overrides(dsc.decode_launcher_config(args.deepspeed_config))
        overrides = with_overrides(overrides, experiment)
    return args.preset, overrides, args.world_size


def train(args, hooks=None) -> int:
    from ..distributed import end_distributed  # heavy imports (torch, deepspeed) only when training
    from .run import run_training
    if os.environ.get("RANK", "0") == "0":
        warn_about_literal_secrets(args.overrides)
    sys.argv[:] = redact_argv(sys.argv)  # what wandb records as the run's command line
    preset, overrides, world_size = config_source(args)
    if args.resume is not None:  # the flag wins over a --set train.resume
        overrides = with_overrides(overrides, [f"train.resume={'null' if args.resume == 'off' else args.resume}"])
    succeeded = False
    try:
        code = run_training(preset, overrides, rehearse=args.rehearse,
                            world_size=world_size or launcher_world_size(), hooks=hooks)
        succeeded = True
        return code
    finally:
        end_distributed(succeeded)
