"""An output path holding a control character (a pasted `--out "x<newline>"`) is refused for every output flag of
every command, naming the character; nothing is created (issue 38's weak pattern). The flags come from the parsers
(a flag added tomorrow is drawn too) and the characters and their places are drawn with a fixed seed."""
from __future__ import annotations

import argparse
import os
import random

import pytest

from trainer import paths
from trainer.__main__ import build_parser, subcommands

CONTROLS = [chr(c) for c in [*range(0x00, 0x20), *range(0x7f, 0xa0), 0x2028, 0x2029] if c]  # NUL: its own message


def output_flags() -> list[tuple[str, str, paths.PathKind]]:
    """(command, flag, its PathKind) for every output path flag of every command."""
    found = []
    for command, parser in subcommands(build_parser()[0]).items():
        for action in parser._actions:
            if isinstance(action.type, paths.PathKind) and action.type.role == "output":
                found.append((command, action.option_strings[-1] if action.option_strings else action.dest,
                              action.type))
    return found


def test_the_parsers_have_output_flags_to_draw_from():
    commands = {command for command, _, _ in output_flags()}
    assert {"prepare-data", "export", "evaluate", "generate"} <= commands


def test_a_control_character_in_an_output_path_is_refused_naming_it(tmp_path):
    rng = random.Random(38)
    for command, flag, kind in output_flags():
        for _ in range(6):
            name = "".join(rng.choice("abc_-.") for _ in range(rng.randint(1, 8))) + "".join(kind.suffixes[:1])
            char = rng.choice(CONTROLS + ["\n"] * 8)  # the trailing newline of a pasted line most of all
            at = rng.choice([len(name), 0, rng.randint(0, len(name))])
            text = str(tmp_path / (name[:at] + char + name[at:]))
            with pytest.raises(argparse.ArgumentTypeError, match=f"U\\+{ord(char):04X}"):
                kind(text)
    assert os.listdir(tmp_path) == []


def test_the_same_paths_without_the_character_are_accepted(tmp_path):
    rng = random.Random(39)
    for command, flag, kind in output_flags():
        name = "".join(rng.choice("abc_-.") for _ in range(rng.randint(1, 8))) + "x" + "".join(kind.suffixes[:1])
        assert kind(str(tmp_path / name)) == str(tmp_path / name), (command, flag)
