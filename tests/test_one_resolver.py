"""One resolver (issue 38, item 4): `evaluate --set` goes through the rules `show` and `train` apply
(options.resolved_with_overrides), whether the config is a preset's, a run's saved one or a plain model's defaults.

The rule table (tests/rule_cases.py: the --set items that break tiny_cpu and what the message says) is drawn from:
what `resolve` refuses, evaluate refuses with the same words."""
from __future__ import annotations

import argparse
import random

import pytest
import yaml

from rule_cases import CASES, ROOT
from trainer.errors import ConfigError
from trainer.infer.evaluate import data_config
from trainer.infer.source import ModelSource, _saved_config, saved_world_size
from trainer.presets import load_preset
from trainer.resolve import resolve

PAIRS = str(ROOT / "data" / "tiny" / "preference.jsonl")
CONTEXT = 4096


def evaluate_args(sets, data=None, task=None, preset=None) -> argparse.Namespace:
    return argparse.Namespace(set=list(sets), data=data, task=task, seq_len=None, preset=preset, model="m")


def saved_run(world: int = 2) -> ModelSource:
    """A run directory's source as evaluate sees it: the record config.resolved.yaml holds, read back."""
    record = yaml.safe_load(yaml.safe_dump(resolve(load_preset("tiny_cpu"), world).record()))
    return ModelSource("hf", "run/hf", "a run", _saved_config(record, "run"), saved_world_size(record))


def test_the_issue_case_beta_minus_one_is_refused_for_a_plain_model_and_a_run():
    for source in (ModelSource("hf", "m", "a plain model"), saved_run()):
        with pytest.raises(ConfigError, match=r"preference\.beta=-1\.0 must be > 0.*from --set preference\.beta=-1"):
            data_config(evaluate_args(["preference.beta=-1"], PAIRS, "preference"), source, CONTEXT)


def test_drawn_betas_are_judged_as_show_judges_them():
    rng = random.Random(4)
    for _ in range(12):
        beta = rng.choice([-rng.uniform(0, 10), 0, rng.uniform(1e-3, 10), -1e-300, 1e13])
        sets = [f"preference.beta={beta!r}"]
        try:
            resolve(load_preset("tiny_cpu", sets + ["data.task=preference", f"data.source={PAIRS}"]))
            shown = None
        except ConfigError as err:
            shown = err.problems
        try:
            data_config(evaluate_args(sets, PAIRS, "preference"), saved_run(), CONTEXT)
            evaluated = None
        except ConfigError as err:
            evaluated = err.problems
        assert (shown is None) == (evaluated is None), (beta, shown, evaluated)


@pytest.mark.parametrize("seed", [1, 2])
def test_what_the_rule_table_breaks_evaluate_refuses_in_the_same_words(seed):
    """evaluate --preset tiny_cpu --set ...: the table's rows (a run's saved config fixes the batch numbers, so a row
    that changes the layout meets the batch triad there first)."""
    rng = random.Random(seed)
    for name in rng.sample(sorted(CASES), 6):
        case = CASES[name]
        with pytest.raises(ConfigError) as err:
            data_config(evaluate_args(case.breaks, preset="tiny_cpu"), ModelSource("hf", "m", "a model"), CONTEXT)
        assert [p for p in err.value.problems if all(f in p for f in case.says)], (name, err.value.problems)


def test_a_run_resolved_for_another_world_size_is_evaluated_at_its_own():
    """A run trained on 1 rank of a 2-rank preset: its saved batch numbers hold for 1 rank, not the preset's 2."""
    source = saved_run(world=1)
    assert source.world_size == 1
    cfg = data_config(evaluate_args(["train.eval_sequences=4"]), source, CONTEXT)
    assert cfg.train.eval_sequences == 4
