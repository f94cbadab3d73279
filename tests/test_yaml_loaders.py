"""parse_yaml reads with libyaml's parser where PyYAML has it (9x faster) and with the pure-Python one otherwise:
the two must build the same values and refuse the same documents, in the Python parser's words."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import yaml

from trainer import files
from trainer.errors import UserError

pytestmark = pytest.mark.quick

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted(p for p in ROOT.rglob("*.yaml") if ".venv" not in p.parts and "runs" not in p.parts)
needs_libyaml = pytest.mark.skipif(files._CLoader is None, reason="this PyYAML has no libyaml")


def python_parser(text: str):
    return yaml.load(text, Loader=files._Loader)


@needs_libyaml
def test_every_shipped_yaml_file_reads_the_same_with_both_parsers():
    assert len(SHIPPED) > 20  # presets, templates, the accelerator and version tables, model configs
    for path in SHIPPED:
        text = path.read_text()
        assert yaml.load(text, Loader=files._CLoader) == python_parser(text), path


@needs_libyaml
def test_drawn_documents_read_the_same_with_both_parsers():
    draw = random.Random(41)
    scalars = ["5e8", "1e-4", "-2E+3", "0x10", "0o7", "1_000", "yes", "no", "on", "null", "~", "'quoted'", '"a\\tb"',
               "2026-12-07", "1.5", ".inf", "-.nan", "auto", "a b", "[1, 2]", "{k: v}", "!!str 12", "''"]
    for _ in range(300):
        keys = draw.sample(["lr", "stage", "micro", "dtype", "name", "eps", "w"], draw.randint(1, 5))
        text = "".join(f"{key}: {draw.choice(scalars)}\n" if draw.random() < 0.8 else
                       f"{key}:\n  inner: {draw.choice(scalars)}\n  list:\n    - {draw.choice(scalars)}\n"
                       for key in keys)
        assert files.parse_yaml(text) == python_parser(text), text


@pytest.mark.parametrize("text, words", [
    ("a: 1\nb: 2\na: 3\n", "line 3: duplicate key 'a' (first at line 1)"),
    ("a: &x [*x]\n", "an alias refers to itself"),
    ("a: &a [1, 2]\n" + "".join(f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n"
                                 for p, c in zip("abcde", "bcdef")) + "g: [*f, *f]\n", "an alias bomb"),
    ("x: [" * 3, "not valid YAML: 'while parsing a flow node"),
    ("a: \ud800\n", "unacceptable character #xd800"),
    ("[" * 1100, "nested too deeply to be a config"),  # past libyaml's 1,000 levels: the Python parser's words
    ("a: !!python/object:os.system x\n", "could not determine a constructor"),
])
def test_a_refused_document_is_named_in_the_python_parsers_words(text, words):
    with pytest.raises(UserError) as refused:
        files.parse_yaml(text, "preset p.yaml")
    assert str(refused.value).startswith("preset p.yaml: ") and words in str(refused.value)
