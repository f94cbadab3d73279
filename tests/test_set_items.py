"""`--set` items and config files say who is to blame and never keep one of two values silently (issue: hardening
round 2): a key set twice (two --set items, a --set of a section and of a key in it, a JSON object with a key
twice) is an error naming both; a --set that would replace a whole section needs the explicit `:=`; a mistake
made on the command line is blamed on the command line, not on the preset file."""
from __future__ import annotations

import pytest

from trainer.__main__ import main
from trainer.presets import apply_overrides, load_preset, with_overrides


def error_of(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("items,fragments", [
    (["train.lr=1e-3", "train.lr=2e-3"], ["'train.lr=2e-3'", "'train.lr=1e-3'", "both set train.lr"]),
    (["train.max_steps=5", "train={max_steps: 6}"], ["both set train", "give it once"]),
    (["deepspeed.zero_optimization:={stage: 2}", "deepspeed.zero_optimization.stage=3"],
     ["both set deepspeed.zero_optimization"]),
    (["train.lr:=1e-3", "train.lr=2e-3"], ["both set train.lr"]),
])
def test_a_key_set_twice_names_both_items(capsys, items, fragments):
    argv = ["show", "tiny_cpu"] + [word for item in items for word in ("--set", item)]
    err = error_of(capsys, *argv)
    assert all(f in err for f in fragments), err


def test_a_section_replaced_by_a_mapping_needs_the_explicit_form(capsys):
    err = error_of(capsys, "show", "tiny_cpu", "--set", "train={lr: 1e-3}")
    assert "would replace all of train" in err and "max_steps" in err and "train:={...}" in err
    # the explicit form replaces on purpose; the keys not given fall back to the schema's defaults
    config = load_preset("tiny_cpu", ["train:={lr: 1e-3, output_dir: runs/x}"])
    assert config.train.lr == 1e-3 and config.train.max_steps == 1000  # TrainConfig's default, not the preset's
    assert load_preset("tiny_cpu").train.max_steps != 1000


def test_a_mapping_that_keeps_every_key_is_a_plain_set():
    raw = {"deepspeed": {"zero_optimization": {"stage": 2}}}
    out = apply_overrides(raw, ["deepspeed.zero_optimization={stage: 3, overlap_comm: true}"])
    assert out["deepspeed"]["zero_optimization"] == {"stage": 3, "overlap_comm": True}


def test_the_trainers_own_changes_replace_the_users_item_instead_of_repeating_it():
    """A resume flag, the doctor's proposal, a batch kept across topologies: one item per key in the result."""
    merged = with_overrides(["train.micro_batch_size=8", "train.lr=1e-3", "train={seed: 1}"],
                            ["train.micro_batch_size=4", "train.seed=2"])
    assert merged == ["train.lr=1e-3", "train.micro_batch_size=4", "train.seed=2"]
    load_preset("tiny_cpu", merged)  # and it loads: no key twice


@pytest.mark.parametrize("item,blamed_key", [
    ("trian.lr=1", "'trian'"),
    ("train.lrr=1", "'train.lrr'"),
    ("deepspeed.zero_optimisation={stage: 3}", "deepspeed.zero_optimisation"),
    ("model.lora.rr=2", "'model.lora.rr'"),
])
def test_a_command_line_mistake_is_blamed_on_the_command_line(capsys, item, blamed_key):
    err = error_of(capsys, "show", "tiny_cpu", "--set", item)
    assert "in the command line" in err and blamed_key in err and f"(from --set {item})" in err, err
    assert "tiny_cpu.yaml" not in err


def test_a_json_object_with_a_key_twice_is_refused(capsys, tmp_path):
    template = tmp_path / "dup.json"
    template.write_text('{"zero_optimization": {"stage": 2, "stage": 3}}')
    err = error_of(capsys, "show", "tiny_cpu", "--set", f"deepspeed_template={template}")
    assert "duplicate key 'stage'" in err and str(template) in err


@pytest.mark.parametrize("items", [["deepspeed.train_batch_size=7"],
                                   ["train.micro_batch_size=3", "deepspeed.train_batch_size=8"]])
def test_a_problem_naming_no_key_is_blamed_on_the_set_items_when_the_preset_alone_is_fine(capsys, items):
    """The batch triad names no key of the --set item that broke it: the preset alone resolves, so the items did."""
    err = error_of(capsys, "show", "tiny_cpu", *[w for item in items for w in ("--set", item)])
    assert "in the command line" in err and "tiny_cpu.yaml" not in err, err
    assert "(from the --set items " + " ".join(f"--set {item}" for item in items) + ")" in err, err


def test_a_preset_that_fails_alone_is_still_blamed_on_its_file(capsys, tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text(load_text("tiny_cpu").replace("micro_batch_size: 8", "micro_batch_size: 8\n  "
                                                                           "global_batch_size: 7"))
    err = error_of(capsys, "show", str(broken), "--set", "train.lr=1e-3")
    assert f"in {broken}" in err and "(from the --set items" not in err, err


def load_text(name: str) -> str:
    from trainer.presets import preset_path
    return preset_path(name).read_text()
