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


def a_pretrained_dir(tmp_path, **fields) -> str:
    """What `model.name_or_path` points at for resolve: a transformers config.json (no weights are read)."""
    import json
    config = {"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 512, "num_local_experts": 8,
              "num_experts_per_tok": 2, "max_position_embeddings": 8192, **fields}
    folder = tmp_path / "-".join(["pretrained", *(f"{k}{v}" for k, v in fields.items())])
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_a_pretrained_models_architecture_is_its_config_json(tmp_path):
    """The resolved config records what from_pretrained builds, not the preset's numbers, and says what it replaced;
    every rule sees the real model (4 experts cannot be split 8 ways; a sequence past its positions); a --set that
    contradicts config.json is refused, naming both."""
    from trainer.options import resolved_with_overrides

    def resolved(*items):
        return resolved_with_overrides(lambda sets: load_preset("mixtral_8x7b_8xa100", sets), list(items),
                                       "mixtral_8x7b_8xa100", None)
    path = a_pretrained_dir(tmp_path)
    run = resolved(f"model.name_or_path={path}")
    model = run.config.model
    assert (model.num_experts, model.hidden_size, model.num_layers, model.vocab_size) == (8, 64, 2, 512)
    assert any("config.json decides the pretrained model's architecture" in n and "model.hidden_size 4096 -> 64" in n
               for n in run.notices)
    with pytest.raises(ConfigError, match=r"model\.num_experts=4: the pretrained model .* has num_experts=8 .*"
                                          r"\(from --set model\.num_experts=4\)"):
        resolved(f"model.name_or_path={path}", "model.num_experts=4")
    assert resolved(f"model.name_or_path={path}", "model.num_experts=8").config.model.num_experts == 8
    with pytest.raises(ConfigError, match=r"autoep_size=8 must divide the 4 experts per layer"):
        resolved(f"model.name_or_path={a_pretrained_dir(tmp_path, num_local_experts=4)}")
    with pytest.raises(ConfigError, match=r"data\.seq_len=4096 exceeds model\.max_position_embeddings=256"):
        resolved(f"model.name_or_path={a_pretrained_dir(tmp_path, max_position_embeddings=256)}")


def problem_lines(err: str) -> list[str]:
    """The `  - ...` lines of a refusal, in order."""
    return [line.strip() for line in err.splitlines() if line.lstrip().startswith("- ")]


@pytest.mark.parametrize("seed", [11, 12])
def test_every_command_that_takes_set_refuses_a_drawn_rule_as_show_does(seed, tmp_path, capsys):
    """Rows drawn from the rule table, each given to every command that takes --set and resolves without ranks:
    each refuses it with exit 2, no traceback, the problems `show` prints, and nothing written. (train resolves
    the same way once its process group is up: tests/test_bad_input.py runs it.)"""
    from trainer.__main__ import main
    from trainer.model import hf_config
    model = tmp_path / "model"  # evaluate resolves before it reads a weight: a config.json and a tokenizer
    hf_config(load_preset("tiny_cpu").model, "sdpa").save_pretrained(str(model))
    for file in (ROOT / "data" / "tiny" / "tokenizer").iterdir():
        (model / file.name).write_bytes(file.read_bytes())
    log = tmp_path / "run.log"
    log.write_text("RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB\n")
    out = tmp_path / "out"
    out.mkdir()
    commands = {"export": ["export", "tiny_cpu", "-o", str(out / "ds.json")], "lint": ["lint", "tiny_cpu"],
                "launch": ["launch", "tiny_cpu", "--dry-run"], "doctor": ["doctor", "tiny_cpu", str(log)],
                "autotune": ["autotune", "tiny_cpu", "--dry-run"],
                "prepare-data": ["prepare-data", "--preset", "tiny_cpu"],
                "evaluate": ["evaluate", "--model", str(model), "--preset", "tiny_cpu"]}
    rng = random.Random(seed)
    before = sorted(p.name for p in tmp_path.iterdir())
    for name in rng.sample(sorted(CASES), 2):
        items = [w for item in CASES[name].breaks for w in ("--set", item)]
        assert main(["show", "tiny_cpu", *items]) == 2, name
        shown = problem_lines(capsys.readouterr().err)
        assert shown, name
        for command in rng.sample(sorted(commands), 4):
            code = main(commands[command] + items)
            err = capsys.readouterr().err
            assert code == 2 and "Traceback" not in err, (name, command, err[-600:])
            assert problem_lines(err) == shown, (name, command, err[-600:])
    assert sorted(p.name for p in tmp_path.iterdir()) == before and not list(out.iterdir())


def test_drawn_ipo_betas_are_refused_exactly_where_the_trainers_loss_is_not_finite():
    """preference.beta drawn over its whole range with the IPO loss: resolve refuses it exactly when the trainer's
    own loss (trainer/train/preference.py, in float32 as it runs) is infinite for a drawn batch: beta=1e-300 used to
    pass and every step was skipped."""
    import math

    import torch

    from trainer.config import PreferenceConfig
    from trainer.rules import FLOAT32_MAX
    from trainer.train.preference import preference_losses
    rng = random.Random(42)
    base = ["data.task=preference", f"data.source={PAIRS}", "preference.loss=ipo"]
    seen = {True: 0, False: 0}
    for _ in range(40):
        beta = 10 ** rng.choice([rng.uniform(-300, -40), rng.uniform(-22, -18), rng.uniform(-18, 12)])
        target = 1 / (2 * beta)
        if target < 1e154 and abs(math.log(target * target / FLOAT32_MAX)) < 0.05:
            continue  # at float32's edge the last bit decides: not a question for a user
        logps = [torch.randn(4) * rng.uniform(0.1, 50) for _ in range(4)]
        lengths = (torch.randint(1, 64, (4,)), torch.randint(1, 64, (4,)))
        for value in logps:
            value.requires_grad_(True)
        losses = preference_losses(*logps, PreferenceConfig(beta=beta, loss="ipo"), lengths)["losses"]
        losses.mean().backward()
        finite = bool(torch.isfinite(losses).all()) and all(bool(torch.isfinite(v.grad).all()) for v in logps)
        try:
            resolve(load_preset("tiny_cpu", base + [f"preference.beta={beta!r}"]))
            accepted = True
        except ConfigError as err:
            accepted = False
            assert any("preference.beta=" in p and "ipo" in p for p in err.problems), err.problems
        assert accepted == finite, (beta, accepted, finite)
        seen[finite] += 1
    assert min(seen.values()) >= 5, seen
