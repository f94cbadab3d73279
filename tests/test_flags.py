"""Every numeric flag of every command reads its number through one typed layer (trainer/numbers.py), and the
config schema uses the same kinds (issue: hardening round 2).

The tests enumerate argparse's own actions, so a flag added tomorrow is covered without being listed here: a
bare `type=int`/`type=float` fails the first test, and every typed flag gets the hostile values below.
"""
from __future__ import annotations

import argparse

import pytest

from trainer import numbers
from trainer.__main__ import build_parser, main

ALWAYS_REFUSED = ["nan", "inf", "-inf", "1e30", "1e400", "99999999999999999999999", "ten", "", "0x10", "1.5.2"]


def commands() -> dict[str, argparse.ArgumentParser]:
    parser, _ = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {"(top level)": parser, **sub.choices}


def flags_of(parser: argparse.ArgumentParser):
    return [a for a in parser._actions if a.option_strings and a.type is not None]


NUMERIC = [(name, action) for name, parser in commands().items() for action in flags_of(parser)
           if isinstance(action.type, numbers.Kind)]
IDS = [f"{name} {action.option_strings[0]}" for name, action in NUMERIC]


def test_no_flag_reads_a_bare_int_or_float():
    bare = [f"{name} {action.option_strings[0]}" for name, parser in commands().items()
            for action in flags_of(parser) if action.type in (int, float)]
    assert not bare, f"flags that take a number without a kind from trainer/numbers.py: {bare}"
    assert len(NUMERIC) >= 35  # the layer is in use: every command's numbers, not a few


def run_flag(capsys, command: str, action: argparse.Action, value: str) -> tuple[int, str]:
    """Parse only (a value that passed would otherwise start the command): argparse's exit code and stderr."""
    words = [value] * (action.nargs if isinstance(action.nargs, int) else 1)  # --profile-steps START END
    before = [] if command == "(top level)" else [command]
    parser, _ = build_parser()
    try:
        parser.parse_args([*before, action.option_strings[0], *words])
        code = 0
    except SystemExit as stop:
        code = stop.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("command,action", NUMERIC, ids=IDS)
def test_every_numeric_flag_refuses_hostile_numbers(capsys, command, action):
    kind = action.type
    refused = list(ALWAYS_REFUSED)
    assert kind.low is not None and kind.low >= 0, f"{action.option_strings[0]}: a kind with no lower bound"
    refused.append("-1")
    if kind.low > 0 or kind.low_open:
        refused.append("0")
    if kind.integer:
        refused.append("2.5")
    for value in refused:
        code, err = run_flag(capsys, command, action, value)
        assert code == 2, (action.option_strings[0], value, err[-500:])
        assert f"argument {action.option_strings[0]}" in err or any(f"argument {o}" in err
                                                                    for o in action.option_strings), err[-500:]
        assert "Traceback" not in err


@pytest.mark.parametrize("command,action", NUMERIC, ids=IDS)
def test_every_numeric_flag_takes_the_values_its_kind_allows(command, action):
    kind = action.type
    smallest = kind.low if not kind.low_open else (kind.low + 0.5 if not kind.integer else kind.low + 1)
    assert kind(str(smallest)) == smallest
    if kind.high is not None and not kind.high_open:
        assert kind(str(kind.high)) == kind.high
    if kind.integer:
        assert kind(f"{int(smallest)}e0") == int(smallest) and isinstance(kind(f"{int(smallest)}e0"), int)


def test_the_dispatcher_returns_a_bad_flag_as_exit_2(capsys):
    assert main(["generate", "--model", "m", "--prompt", "hi", "--temperature", "inf"]) == 2
    err = capsys.readouterr().err
    assert "argument --temperature: 'inf' is not a finite number" in err and "Traceback" not in err


def test_a_machine_bound_kind_names_the_machine():
    cores = numbers.available_cores()
    with pytest.raises(argparse.ArgumentTypeError, match=f"{cores} cores"):
        numbers.PROCESSES(str(cores + 1))


@pytest.mark.parametrize("item,fragment", [
    ("train.micro_batch_size=1e30", "too large to be an exact integer"),
    ("train.max_steps=99999999999999999999999", "beyond a 64-bit integer"),
    ("train.seed=-1", "train.seed=-1 must be >= 0"),
    ("train.lr=.inf", "not a finite number"),
    ("train.betas=[0.9, 1.5]", "train.betas[1]=1.5 must be >= 0 and < 1"),
    ("hardware.cpu_ram_gb=1e12", "hardware.cpu_ram_gb"),
    ("data.sources=[{path: a, weight: -2}, {path: b}]", "data.sources[0].weight=-2"),
    ("model.lora.dropout=1", "model.lora.dropout=1.0 must be >= 0 and < 1"),
])
def test_set_values_get_the_same_kinds(capsys, item, fragment):
    """The schema's numbers are checked by the same kinds: named, with the --set item blamed."""
    assert main(["show", "tiny_cpu", "--set", item]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "(from --set" in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv,fragment", [
    (["plan", "--model", "1e400", "--gpu", "a100-80g"], "parameter count '1e400' must be >= 1"),
    (["plan", "--model", "-7", "--gpu", "a100-80g", "--hidden-size", "8", "--num-layers", "2"],
     "parameter count '-7' must be >= 1"),
    (["plan", "{dir}/inf.yaml"], "hidden_size"),
    (["plan", "{dir}/nan.yaml"], "cpu_ram_gb"),
    (["plan", "--model", "7b", "--gpu", "a100-80g", "--gpus-per-node", "100000"], "<= 1024 (ranks per node"),
    (["prepare-data", "--source", "x.jsonl", "--tokenizer", "t", "--seq-len", "1"], "at least 2"),
    (["show", "tiny_cpu", "--set", "data.seq_len=1"], "data.seq_len=1 must be >= 2"),
    (["preflight", "--sizes", ""], "--sizes ''"),
])
def test_numbers_from_files_and_ranges_use_the_same_kinds(capsys, tmp_path, argv, fragment):
    """A count written in a scenario file, a parameter count beyond a float, a node of 100000 GPUs, a one-token
    sequence, an empty size list: each a named refusal (exit 2), never an OverflowError or a silent default."""
    (tmp_path / "inf.yaml").write_text("model: 7000000000\nhidden_size: .inf\nnum_layers: 32\ngpu: a100-80g\n")
    (tmp_path / "nan.yaml").write_text("model: 7b\ngpu: a100-80g\ncpu_ram_gb: .nan\n")
    assert main([word.replace("{dir}", str(tmp_path)) for word in argv]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err, err
