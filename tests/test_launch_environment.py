"""Launcher variables left in the environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) are read in
one place (trainer/ranks.py launch_environment), by drawn cases: all five set and consistent is a launch, none is one
process, anything between is a named error listing every wrong variable and the way out, never a traceback or
DeepSpeed's MPI discovery. Commands that start ranks (generate, evaluate, train) refuse a half-set environment
before any work; commands that never start ranks (show, prepare-data) do not read it."""
from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from trainer import ranks
from trainer.__main__ import main
from trainer.errors import UserError

ROOT = Path(__file__).resolve().parent.parent
VALUES = {"RANK": ["0", "1", "5", "-1", "x", "", " 1", "１"], "WORLD_SIZE": ["1", "2", "8", "0", "two", ""],
          "LOCAL_RANK": ["0", "1", "3", "a"], "MASTER_ADDR": ["127.0.0.1", "node-1", "", " host"],
          "MASTER_PORT": ["29500", "1", "65535", "0", "70000", "p"]}


def consistent(env: dict[str, str]) -> bool:
    if set(env) != set(ranks.LAUNCH_VARIABLES):
        return False
    if not all(env[n].isascii() and env[n].isdigit() for n in ranks.NUMBERS):
        return False
    rank, world, local, port = (int(env[n]) for n in ranks.NUMBERS)
    return world >= 1 and rank < world and local <= rank and 1 <= port <= 65535 and \
        env["MASTER_ADDR"].strip() == env["MASTER_ADDR"] != ""


def test_drawn_launcher_environments_are_a_launch_one_process_or_a_named_error():
    draw = random.Random(386)
    seen = {"launch": 0, "none": 0, "refused": 0}
    for _ in range(2000):
        keep = draw.choice([0.0, 1.0, 1.0, draw.random()])  # none, all five, or some of them
        names = [n for n in ranks.LAUNCH_VARIABLES if draw.random() < keep]
        good = draw.random() < 0.5  # a launcher's values: the first of each list, and a rank below the world size
        env = {name: VALUES[name][0] if good else draw.choice(VALUES[name]) for name in names}
        try:
            launch = ranks.launch_environment(env)
        except UserError as err:
            seen["refused"] += 1
            assert env and not consistent(env)
            message = str(err)
            assert all(f"{name}={value!r}" in message for name, value in env.items())  # what was found, quoted
            assert all(name in message for name in set(ranks.LAUNCH_VARIABLES) - set(env))  # the missing, named
            assert "env -u " + " -u ".join(env) in message and "deepspeed --num_gpus" in message
            continue
        if launch is None:
            seen["none"] += 1
            assert not env
        else:
            seen["launch"] += 1
            assert consistent(env) and launch.rank == int(env["RANK"]) and launch.world_size == int(env["WORLD_SIZE"])
    assert min(seen.values()) > 10, seen


LEFTOVERS = [{"RANK": "5", "WORLD_SIZE": "2"}, {"RANK": "0", "WORLD_SIZE": "1"}, {"WORLD_SIZE": "2"},
             {"LOCAL_RANK": "1"}, {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}]


@pytest.fixture
def model_dir(tmp_path, pretrained_dir):
    model = tmp_path / "model"
    shutil.copytree(pretrained_dir, model)
    for file in (ROOT / "data" / "tiny" / "tokenizer").iterdir():
        shutil.copy(file, model / file.name)
    return model


@pytest.mark.slow  # the tiny model is built once per session (pretrained_dir)
@pytest.mark.parametrize("leftover", LEFTOVERS, ids=lambda env: "+".join(env))
def test_commands_that_start_ranks_refuse_a_leftover_by_name_before_any_work(leftover, model_dir, tmp_path,
                                                                             monkeypatch, capsys):
    for name in ranks.LAUNCH_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in leftover.items():
        monkeypatch.setenv(name, value)
    commands = [["generate", "--model", str(model_dir), "--prompt", "hi", "--greedy"],
                ["evaluate", "--model", str(model_dir), "--set", "data.source=data/tiny/pretrain.jsonl"],
                ["train", "--preset", "tiny_cpu", "--set", f"train.output_dir={tmp_path / 'run'}"]]
    for command in commands:
        code = main(command)
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err and "mpi4py" not in err, (command, err)
        assert "error: the environment holds launcher variables that are not a launch (" in err, (command, err)
        assert all(f"{name}={value!r}" in err for name, value in leftover.items()), err
    assert not (tmp_path / "run").exists()


def test_commands_that_never_start_ranks_do_not_read_them(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert main(["show", "tiny_cpu"]) == 0
    out = capsys.readouterr().out
    assert "world_size: 2" in out and "world_size: 8" not in out  # tiny_cpu's own two ranks
