"""What every doctor test checks of a proposal: the trainer's own loader accepts its overrides, and the rerun
line starts as many ranks as the preset resolves for, with arguments the trainer's train CLI parses."""
from __future__ import annotations

import argparse
import re
import shlex

from trainer.options import add_train_arguments
from trainer.presets import load_preset, with_overrides
from trainer.resolve import resolve

ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def with_nvme(overrides: list[str], nvme_dir: str | None) -> list[str]:
    """NVMe proposals name /local_nvme, which the strict loader requires to exist: point them at `nvme_dir`."""
    return [o.replace("/local_nvme", nvme_dir) if nvme_dir else o for o in overrides]


def assert_resolves(preset: str, overrides: list[str], nvme_dir: str | None = None, world_size: int | None = None):
    return resolve(load_preset(preset, with_nvme(overrides, nvme_dir)), world_size)


def launched_ranks(runner: list[str]) -> int:
    """Ranks a `deepspeed ...` or `torchrun ...` runner starts (nodes x per node)."""
    def value(flag: str, default: int) -> int:
        return int(runner[runner.index(flag) + 1]) if flag in runner else default
    if runner[0] == "deepspeed":
        return value("--num_nodes", 1) * value("--num_gpus", 1)
    assert runner[0] == "torchrun", runner
    return value("--nnodes", 1) * value("--nproc_per_node", 1)


def assert_the_trainer_accepts(command: str, preset: str, nvme_dir: str | None = None,
                               world_size: int | None = None) -> None:
    """The rerun line launches as many ranks as the config resolves for (the preset's world, or --world-size)
    and the train CLI parses its arguments; its --set items resolve."""
    words = [w for w in shlex.split(command.split("  # not resolved here")[0]) if not ENV_ASSIGNMENT.match(w)]
    split = words.index("train.py")
    runner, train_args = words[:split], words[split + 1:]
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    args = parser.parse_args(train_args)
    assert args.preset == preset, command
    assert args.world_size == world_size, command
    ranks = launched_ranks(runner)
    resolved = assert_resolves(preset, args.overrides, nvme_dir, args.world_size)
    assert resolved.world_size == ranks, command


LADDERS = {"cuda_oom", "init_oom"}  # their "then" rungs stack: each is judged after the ones before it


def assert_pasteable(preset: str, base: list[str], d, nvme_dir: str | None = None) -> None:
    """The first proposal, and each further one, resolves against the preset (the OOM ladder's rungs on top
    of the earlier rungs; other alternatives on their own)."""
    applied = list(base)
    for proposal in ([d.proposal] if d.proposal else []) + d.then:
        stack = d.failure in LADDERS and proposal is not d.proposal
        assert_resolves(preset, with_overrides(applied if stack else list(base), proposal.overrides), nvme_dir)
        if stack or proposal is d.proposal:
            applied = with_overrides(applied, proposal.overrides)
