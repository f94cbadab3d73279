"""Flags that do nothing in the mode given are refused by one mechanism (issue 38, item 5): a flag's dependency is
declared beside it (trainer/flag_needs.py) and `python -m trainer` checks every declared one after parsing.

The declared flags are drawn from the parsers themselves, with drawn values."""
from __future__ import annotations

import argparse
import contextlib
import io
import math
import random

import pytest

from trainer import flag_needs
from trainer.__main__ import build_parser, main, subcommands


def declared() -> list[tuple[str, argparse.ArgumentParser, argparse.Action]]:
    parser, _ = build_parser()
    return [(command, sub, action) for command, sub in subcommands(parser).items() for action in sub._actions
            if getattr(action, flag_needs.ATTRIBUTE, None)]


def test_the_issue_flags_declare_what_they_need():
    flags = {(command, (action.option_strings or [action.metavar])[-1]) for command, _, action in declared()}
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
                                   else rng.choice([0.5, 3, "/tmp", "scenarios/seed1_7b_8xa100.yaml"]))
            args = argparse.Namespace(**values)
            named = [p for p in flag_needs.unmet(parser, args)
                     if p.startswith((action.option_strings or [action.metavar])[0] + " ")
                     or p.startswith("/".join(action.option_strings) + " ")]
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


# --- the property: a flag accepted on a command line changes what the command does -----------------------------
# `plan` and `launch --dry-run` print everything they would do, so a flag that is accepted and leaves the output
# unchanged for every drawn value did nothing. Flags drawn from the parsers themselves (a flag added tomorrow is
# drawn too), values drawn from their kinds, bases where each mode is in force.
BASES = {
    "plan": [["--model", "7b", "--gpu", "a100-80g", "--gpus-per-node", "8"],
             ["--model", "7b", "--gpu", "a100-80g", "--inference", "--context", "4096"],
             ["--model", "7b", "--gpu", "a100-80g", "--task", "dpo", "--gpus-per-node", "8"],
             ["--model", "mixtral-8x7b", "--gpu", "h100-80g", "--gpus-per-node", "8"]],
    "launch": [["tiny_cpu", "--dry-run"], ["tiny_cpu", "--launcher", "slurm", "--dry-run"],
               ["70b_32xa100", "--launcher", "slurm", "--dry-run"],
               ["70b_32xa100", "--launcher", "torchrun", "--node-rank", "1", "--master-addr", "head", "--dry-run"],
               ["70b_32xa100", "--launcher", "local", "--node-rank", "1", "--master-addr", "head", "--dry-run"]],
}
WORDS = {"--gpu": ["h100-80g", "a100-40g", "rtx4090", "l4"], "--task": ["pretrain", "lora", "dpo", "dpo-lora"],
         "--dtype": ["fp16", "fp32"], "--reference": ["engine", "precomputed", "adapter"], "--model": ["1b", "13b", "70b"],
         "--nvme-path": ["/nv", "/scratch/x"], "--fabric": ["tcp", "ib", "debug"], "--time": ["1:00:00", "30"],
         "--partition": ["gpu", "p2"], "--account": ["acct", "b"], "--rdzv-id": ["job1", "x"],
         "--master-addr": ["10.0.0.2", "node7"], "--resume": ["off", "/ckpt"], "--hostfile": ["{hosts}"]}
# Flags whose effect a printed plan or dry run cannot show, each with the reason: not a flag that does nothing.
UNSEEN = {"--failure-grace-s": "acts when a rank fails", "--local-rank": "set by launchers, hidden",
          "--json": "the same plan in another form", "--dry-run": "the base", "--world-size": "checked, not chosen",
          "--gpus-per-node": "a bound the plan may not reach", "--nodes": "a bound the plan may not reach",
          "--cpu-ram-gb": "a bound the plan may not reach", "--nvme-gb": "a bound the plan may not reach",
          "-o": "a file", "--chart": "a file", "--write-preset": "a file", "--set": "resolved", "--preset": "the base",
          "--help": "exits", "--inference": "the base"}


def drawn_value(rng: random.Random, action: argparse.Action, hosts: str):
    from trainer.numbers import Kind
    flag = action.option_strings[-1]
    if action.nargs == 0:
        return []
    if action.choices:
        return [rng.choice([c for c in action.choices if c != action.default])]
    if flag in WORDS:
        return [rng.choice(WORDS[flag]).format(hosts=hosts)]
    if isinstance(action.type, Kind):
        low, high = max(action.type.low, 1 if action.type.integer else 0.01), min(action.type.high, 1e5)
        value = math.exp(rng.uniform(math.log(low), math.log(high)))
        return [str(int(value)) if action.type.integer else f"{value:.3g}"]
    raise AssertionError(f"{flag}: no way to draw a value (add it to WORDS)")


def outcome(argv: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue() + "\0" + err.getvalue()


@pytest.mark.parametrize("command", sorted(BASES))
def test_a_flag_that_is_accepted_changes_what_the_command_prints(command, tmp_path):
    """For every flag of the parser, on a drawn base: drawn values are refused with a named error, or at least one
    changes the printed plan / dry run. Accepted and unchanged for every value is a flag that does nothing."""
    hosts = tmp_path / "hosts"
    hosts.write_text("node1 slots=8\nnode2 slots=8\nnode3 slots=8\nnode4 slots=8\n")
    parser = subcommands(build_parser()[0])[command]
    rng = random.Random(f"needs-{command}")
    silent = []
    for action in parser._actions:
        if not action.option_strings or set(action.option_strings) & set(UNSEEN):
            continue
        flag = action.option_strings[-1]
        base = [command, *rng.choice(BASES[command])]
        if flag in base:
            continue
        code, before = outcome(base)
        assert code in (0, 1), (base, before[-400:])
        results = [outcome(base + [flag, *drawn_value(rng, action, str(hosts))]) for _ in range(2)]
        for result_code, text in results:
            assert result_code in (0, 1, 2) and "Traceback" not in text, (base, flag, text[-400:])
        if all(c == code and text == before for c, text in results):
            silent.append(f"{' '.join(base)} {flag}")
    assert not silent, "accepted and changed nothing: " + "; ".join(silent)
