"""`python -m trainer train` (what `train.py` runs under deepspeed/torchrun): secrets kept out of the logs,
`--resume` as an override, the process group torn down however the run ends."""
from __future__ import annotations

import argparse
import sys

from ..options import add_rank_arguments, config_source
from ..presets import with_overrides
from ..redact import redact_argv, warn_about_literal_secrets
from ..resolve import launcher_world_size


def train_arguments(parser: argparse.ArgumentParser) -> None:
    add_rank_arguments(parser)  # shared with `launch`, which checks the words it passes on to every rank


def train(args, hooks=None) -> int:
    from ..distributed import end_distributed  # heavy imports (torch, deepspeed) only when training
    from .run import run_training
    from .. import ranks  # torch: only when training
    if ranks.launched_rank() == 0:  # a half-set launcher environment is a named error here, before any work
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
