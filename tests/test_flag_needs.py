"""Flags that do nothing in the mode given are refused by one mechanism (issue 38, item 5): a flag's dependency is
declared beside it (trainer/flag_needs.py) and `python -m trainer` checks every declared one after parsing.

The declared flags are drawn from the parsers themselves, with drawn values."""
from __future__ import annotations

import argparse
import random

import pytest

from trainer import flag_needs
from trainer.__main__ import build_parser, main, subcommands


def declared() -> list[tuple[str, argparse.ArgumentParser, argparse.Action]]:
    parser, _ = build_parser()
    return [(command, sub, action) for command, sub in subcommands(parser).items() for action in sub._actions
            if getattr(action, flag_needs.ATTRIBUTE, None)]


def test_the_issue_flags_declare_what_they_need():
    flags = {(command, action.option_strings[-1]) for command, _, action in declared()}
    assert {("generate", "--top-p"), ("generate", "--nvme-path"), ("evaluate", "--nvme-path"),
            ("plan", "--checkpoint-offload"), ("launch", "--node-rank")} <= flags


def test_a_declared_flag_is_refused_exactly_when_its_need_does_not_hold():
    """Defaults everywhere, the flag given a drawn value, the other flags drawn from their choices: the flag is
    named by `unmet` if and only if its declared need is false for that command line."""
    rng = random.Random(5)
    for command, parser, action in declared():
        for _ in range(8):
            values = {a.dest: a.default for a in parser._actions if a.dest != argparse.SUPPRESS}
            for other in parser._actions:
                if other.choices and other is not action and other.dest in values:
                    values[other.dest] = rng.choice([*other.choices, other.default])
                elif other.nargs == 0 and other.dest in values and other is not action:
                    values[other.dest] = rng.choice([True, other.default])
            values[action.dest] = (rng.choice([c for c in action.choices if c != action.default]) if action.choices
                                   else rng.choice([0.5, 3, "/tmp"]))
            args = argparse.Namespace(**values)
            named = [p for p in flag_needs.unmet(parser, args) if p.startswith(action.option_strings[0])]
            need = getattr(action, flag_needs.ATTRIBUTE)
            assert bool(named) != need.holds(args), (command, action.option_strings, values)


@pytest.mark.parametrize("argv,flag", [
    (["generate", "--model", "m", "--prompt", "hi", "--top-p", "0.9"], "--top-p"),
    (["generate", "--model", "m", "--prompt", "hi", "--zero-inference", "cpu", "--nvme-path", "/tmp"], "--nvme-path"),
    (["plan", "--inference", "--model", "7b", "--checkpoint-offload", "on"], "--checkpoint-offload"),
    (["launch", "tiny_cpu", "--launcher", "deepspeed", "--node-rank", "1", "--dry-run"], "--node-rank"),
])
def test_the_command_line_refuses_them_naming_the_flag(argv, flag, capsys):
    assert main(argv) == 2
    assert f"{flag} does nothing without" in capsys.readouterr().err


def test_with_what_they_need_they_pass_this_check(capsys):
    assert main(["plan", "--model", "7b", "--gpu", "h100-80g", "--checkpoint-offload", "on"]) == 0
    assert main(["launch", "tiny_cpu", "--launcher", "torchrun", "--node-rank", "0", "--nnodes", "2",
                 "--master-addr", "10.0.0.1", "--dry-run"]) == 0
    assert "does nothing without" not in capsys.readouterr().err
