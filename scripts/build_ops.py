"""Build ahead the DeepSpeed ops a preset's run JIT-loads, so its first run loads them in seconds.

    .venv/bin/python scripts/build_ops.py tiny_cpu                 # what `scripts/setup.sh tiny_cpu` runs
    .venv/bin/python scripts/build_ops.py my.yaml --set deepspeed.zero_optimization.offload_optimizer={device: cpu}
    .venv/bin/python scripts/build_ops.py --ops fused_adam,cpu_adam  # by name, as trainer/ds/ops.py names them

The ops are read from the preset's resolved DeepSpeed config (trainer/ds/ops.py) and built into this
environment's extensions directory (trainer/jit_env.py) with the trainer's own progress lines: before each op,
whether it is built and how long a build takes here; every 30 s while it builds; after, how long it took. Only
this machine's accelerator can be built for: a GPU preset's ops are built on the GPU machine (run this there).
Exit 0 when every op is ready, 1 when one failed (its error printed), 2 for a bad preset.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from trainer import ds as dsc  # noqa: E402  (imports trainer first: this environment's extensions directory)
from trainer import jit_env, jit_ops, waits  # noqa: E402
from trainer.errors import UserError  # noqa: E402
from trainer.presets import load_preset  # noqa: E402
from trainer.resolve import resolve  # noqa: E402


def say(line: str) -> None:
    print(f"build_ops: {line}", flush=True)


def builder_classes(accelerator) -> dict:
    """Op name -> builder class name, from the accelerator's own op_builder package (every op it can build)."""
    module = importlib.import_module(accelerator.op_builder_dir())
    return {cls.NAME: name for name, cls in vars(module).items()
            if isinstance(cls, type) and isinstance(getattr(cls, "NAME", None), str)}


def ops_for(preset: str, overrides: list[str], device: str) -> list[str]:
    resolved = resolve(load_preset(preset, overrides))
    gpu = resolved.config.hardware.gpu
    if (gpu == "cpu") != (device == "cpu"):
        raise UserError(f"{preset} runs on {gpu} and this machine's accelerator is {device}: DeepSpeed builds ops "
                        f"for the accelerator it runs on, so build them on the machine that runs {preset}")
    return dsc.jit_ops(resolved.ds, resolved.world_size, device)


def build(op: str, classes: dict, accelerator) -> bool:
    name = classes.get(op)
    builder = accelerator.create_op_builder(name) if name else None
    if builder is None:
        say(f"{op}: the {accelerator.device_name()} accelerator has no builder for it; a run would fail the same way")
        return False
    try:
        builder.load()
    except UserError:
        raise
    except Exception as err:  # the build's own output (compiler errors) is above; `trainer doctor` reads it
        say(f"{op}: failed: {type(err).__name__}: {err}")
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("presets", nargs="*", metavar="PRESET", help="shipped preset name or YAML path")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--ops", default="", metavar="OP,...", help="also build these ops by name (the test suite "
                                                                       "builds every op its launches load first)")
    args = parser.parse_args(argv)
    named = [op for op in args.ops.split(",") if op]
    if not args.presets and not named:
        parser.error("name a preset or --ops")
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's import banner
        from deepspeed.accelerator import get_accelerator
        accelerator = get_accelerator()
    jit_ops.install(say)
    started, ok = time.monotonic(), True
    try:
        wanted = list(dict.fromkeys([op for preset in args.presets
                                     for op in ops_for(preset, args.overrides, accelerator.device_name())] + named))
        say(f"{', '.join(args.presets + named)} on {accelerator.device_name()}: {', '.join(wanted) or 'no JIT ops'}")
        classes = builder_classes(accelerator)
        for op in wanted:
            ok = build(op, classes, accelerator) and ok
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    say(f"{'done' if ok else 'FAILED'} in {waits.duration(time.monotonic() - started)}")
    return 0 if ok else 1


if __name__ == "__main__":
    jit_env.resolve_interpreter()  # the ops of the real path a symlinked virtualenv stands for
    sys.exit(main())
