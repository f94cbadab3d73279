"""The config commands (`presets`, `show`, `export`) and the `train` entry point's arguments."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

import yaml

from .errors import UserError
from .presets import list_presets, load_preset
from .redact import redact_argv, warn_about_literal_secrets
from .resolve import Resolved, launcher_world_size, resolve


def add_preset_arguments(parser: argparse.ArgumentParser, positional: bool = True) -> None:
    if positional:
        parser.add_argument("preset", help="shipped preset name or path to a preset .yaml")
    else:
        parser.add_argument("--preset", default="tiny_cpu", help="shipped preset name or path (default: tiny_cpu)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override a preset value (repeatable), e.g. --set deepspeed.zero_optimization.stage=3")
    parser.add_argument("--world-size", type=int, default=None,
                        help="resolve for this many ranks (default: hardware.nodes x hardware.gpus_per_node)")


def load_and_resolve(args) -> Resolved:
    # DeepSpeed logs to stdout (e.g. "Setting accelerator to CPU" on import); keep stdout for the
    # YAML/JSON that `show` and `export -o -` print, so it can be piped into a file.
    with contextlib.redirect_stdout(sys.stderr):
        config = load_preset(args.preset, args.overrides)
        return resolve(config, args.world_size)


# --- presets -----------------------------------------------------------------------------------

def presets_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def presets(args) -> int:
    rows = list_presets()
    width = max(len(name) for name, _ in rows)
    for name, description in rows:
        print(f"{name:<{width}}  {description}")
    return 0


# --- show --------------------------------------------------------------------------------------

def show_arguments(parser: argparse.ArgumentParser) -> None:
    add_preset_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print JSON instead of YAML")


def show(args) -> int:
    resolved = load_and_resolve(args)
    document = {**resolved.document(), "notices": resolved.notices}
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        print(yaml.safe_dump(document, sort_keys=False, width=120), end="")
    return 0


# --- export ------------------------------------------------------------------------------------

def export_arguments(parser: argparse.ArgumentParser) -> None:
    add_preset_arguments(parser)
    parser.add_argument("-o", "--output", required=True, help="where to write the DeepSpeed JSON ('-' = stdout)")


def export(args) -> int:
    resolved = load_and_resolve(args)
    text = json.dumps(resolved.ds, indent=2) + "\n"
    if args.output == "-":
        sys.stdout.write(text)
        return 0
    out = Path(args.output)
    if out.parent and not out.parent.exists():
        raise UserError(f"-o {args.output}: directory {out.parent} does not exist")
    out.write_text(text)
    print(f"wrote {out} (world size {resolved.world_size}, ZeRO stage {resolved.summary()['zero_stage']})",
          file=sys.stderr)
    return 0


# --- train -------------------------------------------------------------------------------------

def train_arguments(parser: argparse.ArgumentParser) -> None:
    add_preset_arguments(parser, positional=False)
    parser.add_argument("--resume", default=None, help="'auto', a checkpoint path, or 'off' (overrides train.resume)")
    parser.add_argument("--rehearse", action="store_true",
                        help="run the preset's DeepSpeed features on a shrunk model with the ranks present")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=-1, help=argparse.SUPPRESS)  # launcher


def train(args) -> int:
    from .loop import end_distributed, run_training  # heavy imports (torch, deepspeed) only when training
    if os.environ.get("RANK", "0") == "0":
        warn_about_literal_secrets(args.overrides)
    sys.argv[:] = redact_argv(sys.argv)  # what wandb records as the run's command line
    overrides = list(args.overrides)
    if args.resume is not None:
        overrides.append(f"train.resume={'null' if args.resume == 'off' else args.resume}")
    succeeded = False
    try:
        code = run_training(args.preset, overrides, rehearse=args.rehearse,
                            world_size=args.world_size or launcher_world_size())
        succeeded = True
        return code
    finally:
        end_distributed(succeeded)
