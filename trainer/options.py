"""Arguments every command that takes a preset shares (`--preset`/positional, `--set`, `--world-size`, the train
flags the launcher passes on), and reading a preset into a resolved config with stdout kept clean."""
from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Callable, Optional

from . import numbers
from .config import Config
from .presets import blamed, load_preset, preset_path, with_overrides
from .resolve import Resolved, resolve


def add_preset_arguments(parser: argparse.ArgumentParser, positional: bool = True) -> None:
    if positional:
        parser.add_argument("preset", help="shipped preset name or path to a preset .yaml")
    else:
        parser.add_argument("--preset", default="tiny_cpu", help="shipped preset name or path (default: tiny_cpu)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a preset value (repeatable), e.g. --set deepspeed.zero_optimization.stage=3")
    parser.add_argument("--world-size", type=numbers.COUNT, default=None,
                        help="resolve for this many ranks (default: hardware.nodes x hardware.gpus_per_node)")


def load_and_resolve(args) -> Resolved:
    """The preset with its --set items, resolved for --world-size."""
    return resolved_with_overrides(lambda overrides: load_preset(args.preset, overrides), args.overrides,
                                   str(preset_path(args.preset)), args.world_size)


def resolved_with_overrides(load: Callable[[list[str]], Config], overrides: list[str], source: str,
                            world_size: Optional[int]) -> Resolved:
    """The one way a command turns a config and its --set items into what it runs: `load(overrides)` resolved,
    every problem blamed on the --set item or on `source` (a preset file, a run's saved config) it came from. So
    `evaluate --set preference.beta=-1` is refused as `show` and `train` refuse it."""
    # DeepSpeed logs to stdout (e.g. "Setting accelerator to CPU" on import); keep stdout for the
    # YAML/JSON that `show` and `export -o -` print, so it can be piped into a file.
    with contextlib.redirect_stdout(sys.stderr):
        config = load(overrides)
        with blamed(source, overrides, alone=lambda: resolve(load([]), world_size)):
            check_no_architecture_override(config, overrides)
            return resolve_run(config, world_size)


def check_no_architecture_override(config, overrides: list[str]) -> None:
    """`--set model.num_experts=8` over a pretrained model whose config.json has 4 would be replaced by the 4 that
    runs (resolve.adopt_pretrained_architecture): the item would do nothing, so it is refused, naming both."""
    from .errors import ConfigError
    from .resolve import pretrained_architecture
    runs = pretrained_architecture(config)
    asked = {item.split("=", 1)[0].strip(): item for item in overrides if "=" in item}
    problems = [f"model.{name}={getattr(config.model, name)}: the pretrained model {config.model.name_or_path} has "
                f"{name}={value} (its config.json decides its architecture; from_pretrained would build {value}): "
                f"remove the --set item, or train from scratch (--set model.name_or_path=null)"
                for name, value in runs.items()
                if f"model.{name}" in asked and getattr(config.model, name) != value]
    if problems:
        raise ConfigError(problems, "the command line")


def resolve_run(config, world_size: Optional[int] = None) -> Resolved:
    """`resolve`, and train.epochs turned into train.max_steps from the prepared data (trainer/data/epochs.py, imported
    only then: it reads the data)."""
    if config.train.epochs is None:
        return resolve(config, world_size)
    from .data.epochs import resolve_run as with_epochs
    return with_epochs(config, world_size)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    add_preset_arguments(parser, positional=False)
    parser.add_argument("--resume", default=None, help="'auto', a checkpoint path, or 'off' (overrides train.resume)")
    parser.add_argument("--rehearse", action="store_true",
                        help="run the preset's DeepSpeed features on a shrunk model with the ranks present")
    parser.add_argument("--local_rank", "--local-rank", type=numbers.RANK, default=-1,
                        help=argparse.SUPPRESS)  # launcher


def add_rank_arguments(parser: argparse.ArgumentParser) -> None:
    """What `python -m trainer train` (each rank) takes: the train flags, and DeepSpeed's autotuner's own."""
    add_train_arguments(parser)
    # DeepSpeed's autotuner (`python -m trainer autotune`) runs each experiment as train.py ... --deepspeed_config
    # <base64 JSON>: that config becomes the preset's whole DeepSpeed section for the experiment
    parser.add_argument("--deepspeed_config", help=argparse.SUPPRESS)


def config_source(args) -> tuple[str, list[str], Optional[int]]:
    """What a rank's config is resolved from: the preset, its overrides (an autotuner experiment's DeepSpeed
    section folded in) and the world size. `launch` compares it with and without the words after `--`: a word
    that changes it would make the ranks run a config the launcher never checked. (--resume is where the run
    starts, not what it is: `train.cli.train` folds it in.)"""
    overrides = list(args.overrides)
    if args.deepspeed_config:
        from . import ds as dsc
        experiment = dsc.experiment_overrides(dsc.decode_launcher_config(args.deepspeed_config))
        overrides = with_overrides(overrides, experiment)
    return args.preset, overrides, args.world_size
