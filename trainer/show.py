"""The config commands: `presets` (list them), `show` (a preset fully resolved), `export` (its DeepSpeed JSON)."""
from __future__ import annotations

import argparse
import json
import sys

import yaml

from . import paths
from .files import check_target, finite_json, write_text_atomic
from .options import add_preset_arguments, load_and_resolve
from .presets import list_presets
from .redact import REDACTED, redact, redacted_keys


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
    document = {**resolved.record(), "notices": resolved.notices}  # record(): secrets redacted (docs/security.md)
    if resolved.config.hardware.gpu != "cpu":  # the planner's estimate, GB: the numbers lint prints
        from .plan.estimate import memory_report, plan_for_resolved
        document["estimate_gb"] = memory_report(plan_for_resolved(resolved))
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        print(yaml.safe_dump(document, sort_keys=False, width=120), end="")
    return 0


# --- export ------------------------------------------------------------------------------------


def export_arguments(parser: argparse.ArgumentParser) -> None:
    add_preset_arguments(parser)
    parser.add_argument("-o", "--output", required=True, type=paths.output_file("DeepSpeed JSON", stdout_ok=True),
                        help="where to write the DeepSpeed JSON ('-' = stdout)")


def export(args) -> int:
    if args.output != "-":
        check_target(args.output)  # before the work: a bad -o is reported first, and alone
    resolved = load_and_resolve(args)
    text = finite_json(redact(resolved.ds))  # secrets stay out of every file (docs/security.md)
    for key in redacted_keys(resolved.ds):
        print(f"note: deepspeed.{key} is {REDACTED} in the exported JSON (secrets stay out of files); set it where the config "
              f"is used, e.g. from the environment", file=sys.stderr)
    if args.output == "-":
        sys.stdout.write(text)
        return 0
    out = write_text_atomic(args.output, text)
    print(f"wrote {out} (world size {resolved.world_size}, ZeRO stage {resolved.summary()['zero_stage']})",
          file=sys.stderr)
    return 0
