"""Bad configs are refused with a message that names the key and the fix, all problems at once.

The cross-field rule table (tests/rule_cases.py) through resolve(), plus strict loading (unknown keys, types), the
DeepSpeed key checks (including typos DeepSpeed 0.19.8 silently ignores and removed features),
impossible values, leftover "auto", and the CLI's error path (message on stderr, no traceback).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

from rule_cases import CASES

from trainer import rules
from trainer.__main__ import main
from trainer.errors import ConfigError, UserError
from trainer.presets import config_from_dict, deep_merge, load_preset, with_overrides
from trainer.resolve import resolve


def base(**changes) -> dict:
    """A small valid config (2 CPU ranks, ZeRO-2, fp32) with `changes` merged in (None deletes)."""
    raw = {
        "name": "t",
        "hardware": {"gpu": "cpu", "gpus_per_node": 2, "nodes": 1},
        "model": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "intermediate_size": 128, "vocab_size": 256,
                  "max_position_embeddings": 128},
        "data": {"source": "data/tiny/pretrain.jsonl", "seq_len": 64},
        "train": {"micro_batch_size": 2, "grad_accum": 1, "precision": "fp32", "warmup_steps": 1, "max_steps": 10},
        "deepspeed": {"zero_optimization": {"stage": 2}},
    }
    return deep_merge(raw, changes)


def problems_of(raw: dict, world: int | None = None) -> list[str]:
    with pytest.raises(ConfigError) as err:
        resolve(config_from_dict(raw), world)
    return err.value.problems


def one_problem(raw: dict, *fragments: str, world: int | None = None) -> str:
    """The resolve error must contain a problem holding every fragment."""
    problems = problems_of(raw, world)
    hits = [p for p in problems if all(f in p for f in fragments)]
    assert hits, f"no problem mentions {fragments}; got {problems}"
    return hits[0]


def test_base_config_is_valid():
    resolved = resolve(config_from_dict(base()))
    assert resolved.batch.global_batch_size == 4


# --- the rule table (tests/rule_cases.py) through resolve() ----------------------------------------

def ds(**zero) -> dict:
    return {"deepspeed": {"zero_optimization": zero}}


def test_every_rule_has_a_case():
    assert {rule.__name__ for rule in rules.RULES} <= set(CASES)
    assert {name for name, case in CASES.items() if case.where == "rules"} == {rule.__name__ for rule in rules.RULES}


@pytest.mark.parametrize("name", sorted(CASES))
def test_check_rejects_its_bad_config(name):
    case = CASES[name]
    with pytest.raises(ConfigError) as err:
        resolve(load_preset("tiny_cpu", case.breaks))
    hits = [p for p in err.value.problems if all(f in p for f in case.says)]
    assert hits, f"no problem mentions all of {case.says}; got {err.value.problems}"


@pytest.mark.parametrize("name", sorted(n for n, case in CASES.items() if case.fix is not None))
def test_check_accepts_the_config_once_fixed(name):
    case = CASES[name]
    resolve(load_preset("tiny_cpu", with_overrides(case.breaks, case.fix)))


@pytest.mark.parametrize("case,fragments", [
    ({"nvme_path": None}, ["offload_optimizer.nvme_path is missing", "local NVMe"]),
    ({"nvme_path": "/no/such/nvme"}, ["nvme_path '/no/such/nvme' does not exist", "create it"]),
    ({"buffer_count": 3}, ["offload_optimizer.buffer_count=3", "buffer_count >= 4"]),
])
def test_nvme_offload_path_and_buffers(case, fragments, tmp_path):
    block = deep_merge({"device": "nvme", "nvme_path": str(tmp_path), "buffer_count": 4}, case)
    one_problem(base(**ds(stage=3, offload_optimizer=block)), *fragments)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_nvme_path_must_be_writable(tmp_path):
    tmp_path.chmod(0o500)
    try:
        one_problem(base(**ds(stage=3, offload_param={"device": "nvme", "nvme_path": str(tmp_path)})),
                    "is not writable")
    finally:
        tmp_path.chmod(0o700)


def test_precision_without_its_deepspeed_block_is_refused():
    # DeepSpeed would train in fp32 while the run says bf16/fp16
    one_problem(base(train={"precision": "bf16"}), "train.precision=bf16", "deepspeed.bf16: {enabled: auto}")


# --- strict loading: unknown keys, with the closest valid key and the file name -----------------

@pytest.mark.parametrize("section,yaml_text,key,suggestion", [
    ("top", "hardwre: {gpu: cpu}", "hardwre", "hardware"),
    ("hardware", "hardware: {gpus_per_nod: 2}", "hardware.gpus_per_nod", "gpus_per_node"),
    ("model", "model: {hiden_size: 64}", "model.hiden_size", "hidden_size"),
    ("model.lora", "model: {lora: {rr: 8}}", "model.lora.rr", "r"),
    ("data", "data: {seqlen: 64}", "data.seqlen", "seq_len"),
    ("train", "train: {warmup_step: 10}", "train.warmup_step", "warmup_steps"),
    ("logging", "logging: {log_evry: 5}", "logging.log_evry", "log_every"),
])
def test_unknown_trainer_key_names_key_file_and_closest(section, yaml_text, key, suggestion, tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text(f"deepspeed_template: zero2.json\n{yaml_text}\n")
    with pytest.raises(ConfigError) as err:
        load_preset(str(path))
    message = str(err.value)
    assert f"unknown key '{key}'" in message
    assert f"did you mean '{suggestion}'" in message
    assert str(path) in message


def test_unknown_key_from_set_override():
    with pytest.raises(ConfigError, match=r"unknown key 'train\.lrr' \(did you mean 'lr'\?\)"):
        load_preset("tiny_cpu", ["train.lrr=1e-4"])


# --- DeepSpeed keys ---------------------------------------------------------------------------

@pytest.mark.parametrize("override,fragments", [
    # DeepSpeed 0.19.8 raises on these itself, but less helpfully
    ("deepspeed.zero_optimization.overlap_com=true",
     ["deepspeed.zero_optimization.overlap_com", "did you mean 'overlap_comm'"]),
    ("deepspeed.zero_optimization.offload_optimizer.pin_memmory=true",
     ["deepspeed.zero_optimization.offload_optimizer.pin_memmory", "did you mean 'pin_memory'"]),
    ("deepspeed.zero_optimisation.stage=2", ["deepspeed.zero_optimisation", "did you mean 'zero_optimization'"]),
    ("deepspeed.bf16.enable=true", ["deepspeed.bf16.enable", "enabled"]),
    # DeepSpeed 0.19.8 silently ignores these
    ("deepspeed.activation_checkpointing.partition_activation=true",
     ["deepspeed.activation_checkpointing.partition_activation", "silently ignored",
      "did you mean 'partition_activations'"]),
    ("deepspeed.aio.thread_count=1", ["deepspeed.aio.thread_count", "silently ignored", "intra_op_parallelism"]),
    ("deepspeed.flops_profiler.enable=true",
     ["deepspeed.flops_profiler.enable", "silently ignored", "did you mean 'enabled'"]),
    ("deepspeed.optimizer.params.weight_decy=0.1",
     ["deepspeed.optimizer.params.weight_decy", "did you mean 'weight_decay'"]),
    ("deepspeed.scheduler.params.warmup_num_step=5",
     ["deepspeed.scheduler.params.warmup_num_step", "did you mean 'warmup_num_steps'"]),
])
def test_deepspeed_typos_are_errors(override, fragments):
    overrides = [override, "model.gradient_checkpointing=true"]  # so activation_checkpointing is legitimate
    with pytest.raises(ConfigError) as err:
        resolve(load_preset("tiny_cpu", overrides))
    assert any(all(f in p for f in fragments) for p in err.value.problems), err.value.problems


def test_removed_nebula_block():
    with pytest.raises(ConfigError) as err:
        resolve(load_preset("tiny_cpu", ["deepspeed.nebula={enabled: true}"]))
    assert any(p.startswith("deepspeed.nebula:") and "removed" in p for p in err.value.problems)


@pytest.mark.parametrize("optimizer", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"])
def test_removed_communication_optimizers_point_to_zeropp(optimizer):
    with pytest.raises(ConfigError) as err:
        resolve(load_preset("tiny_cpu", [f"deepspeed.optimizer.type={optimizer}"]))
    message = str(err.value)
    assert f"'{optimizer}' was removed" in message
    assert "ZeRO++ quantized gradients" in message and "zero_quantized_gradients" in message


def test_unknown_optimizer_and_scheduler_names():
    with pytest.raises(ConfigError) as err:
        resolve(load_preset("tiny_cpu", ["deepspeed.optimizer.type=AdamWW", "deepspeed.scheduler.type=WarmupLr"]))
    message = str(err.value)
    assert "unknown optimizer 'AdamWW'" in message and "did you mean 'adamw'" in message
    assert "unknown scheduler 'WarmupLr'" in message and "did you mean 'WarmupLR'" in message


def resolve_preset(override):
    return resolve(load_preset("tiny_cpu", [override]))


def load_preset_only(override):
    return load_preset("tiny_cpu", [override])


def assert_problem(build, override, fragments):
    """`build(override)` raises a ConfigError with one problem that contains every fragment."""
    with pytest.raises(ConfigError) as err:
        build(override)
    assert any(all(f in p for f in fragments) for p in err.value.problems), err.value.problems


@pytest.mark.parametrize("override,fragments", [
    ("deepspeed.zero_optimization=3", ["deepspeed.zero_optimization", "expected a mapping", "3"]),
    ("deepspeed.optimizer.params=5", ["deepspeed.optimizer.params", "expected a mapping"]),
    ("deepspeed.scheduler.params=5", ["deepspeed.scheduler.params", "expected a mapping"]),
    ("deepspeed.aio=5", ["deepspeed.aio", "expected a mapping"]),
    ("deepspeed=5", ["deepspeed", "expected a mapping"]),
])
def test_deepspeed_blocks_that_are_not_mappings(override, fragments):
    assert_problem(resolve_preset, override, fragments)


# --- wrong types and impossible values ---------------------------------------------------------

@pytest.mark.parametrize("override,fragments", [
    ("train.lr=fast", ["train.lr", "expected a number", "'fast'"]),
    ("model.num_layers=2.5", ["model.num_layers", "expected an integer", "2.5"]),
    ("hardware.gpus_per_node=true", ["hardware.gpus_per_node", "expected an integer"]),
    ("train.betas=[0.9]", ["train.betas", "expected 2 values"]),
    ("train.precision=bf32", ["train.precision", "'bf32' is not one of", "'bf16'"]),
    ("model.lora.target_modules=q_proj", ["model.lora.target_modules", "expected a list"]),
])
def test_wrong_types_in_trainer_sections(override, fragments):
    assert_problem(load_preset_only, override, fragments)


@pytest.mark.parametrize("override,fragments", [
    ("deepspeed.zero_optimization.stage=three", ["deepspeed.zero_optimization.stage", "'three'"]),
    ("deepspeed.zero_optimization.stage=5", ["deepspeed.zero_optimization.stage", "Input should be 0, 1, 2 or 3 (got 5)"]),
    ("deepspeed.zero_optimization.reduce_bucket_size=-1",
     ["deepspeed.zero_optimization.reduce_bucket_size", "greater than 0", "-1"]),
    ("deepspeed.zero_optimization.allgather_bucket_size=-5e8",
     ["deepspeed.zero_optimization.allgather_bucket_size", "greater than or equal to 0"]),
    ("deepspeed.zero_optimization.overlap_comm=maybe", ["deepspeed.zero_optimization.overlap_comm", "'maybe'"]),
    ("deepspeed.train_micro_batch_size_per_gpu=0", ["deepspeed.train_micro_batch_size_per_gpu", "positive integer"]),
])
def test_wrong_types_and_ranges_in_deepspeed_section(override, fragments):
    assert_problem(resolve_preset, override, fragments)


@pytest.mark.parametrize("lr", [0, -1e-4])
def test_learning_rate_must_be_positive(lr):
    one_problem(base(train={"lr": lr, "min_lr": 0.0}), f"train.lr={float(lr)}", "must be > 0")


@pytest.mark.parametrize("changes,fragments", [
    ({"data": {"seq_len": 256}}, ["data.seq_len=256", "model.max_position_embeddings=128"]),
    ({"model": {"num_heads": 5}}, ["model.hidden_size=64", "divisible by model.num_heads=5"]),
    ({"model": {"num_kv_heads": 3}}, ["model.num_heads=4", "model.num_kv_heads=3"]),
    ({"hardware": {"gpu": "a100-81g"}}, ["hardware.gpu", "'a100-81g'", "a100-80g", "trainer/accelerators.yaml"]),
    ({"train": {"warmup_steps": 11}}, ["train.warmup_steps=11", "max_steps"]),
    ({"train": {"micro_batch_size": "lots"}}, ["train.micro_batch_size", "'lots'", "positive integer or 'auto'"]),
    ({"data": {"source": ""}}, ["data.source and data.sources: give exactly one"]),
    ({"data": {"sources": [{"path": "a"}]}}, ["data.source and data.sources: give exactly one"]),
    ({"data": {"source": "", "sources": [{"path": "a", "weight": -1}, {"path": "b", "weight": 1}]}},
     ["data.sources[0].weight=-1.0 must be >= 0"]),
    ({"data": {"source": "", "sources": [{"path": "a/train.jsonl"}, {"path": "b/train.jsonl"}]}},
     ["data.sources[1].name: 'train' (taken from its path", "data.sources[0]'s name", "its own name:"]),
    ({"data": {"source": "", "sources": [{"path": "a", "name": "web"}, {"path": "b", "name": "web"}]}},
     ["data.sources[1].name: 'web' is also data.sources[0]'s name"]),
    ({"data": {"source": "", "sources": [{"path": "a", "name": "../../x"}, {"path": "b"}]}},
     ["data.sources[0].name: '../../x' names files of the cache", "without slashes"]),
    ({"data": {"source": "", "sources": [{"path": "a", "name": ".."}, {"path": "b"}]}},
     ["data.sources[0].name: '..'"]),
    ({"model": {"lora": {"enabled": True}}}, ["model.lora.enabled", "model.name_or_path"]),
])
def test_impossible_trainer_values(changes, fragments):
    one_problem(base(**changes), *fragments)


@pytest.mark.parametrize("key", ["sub_group_size", "stage", "overlap_comm"])
def test_auto_where_no_rule_fills_it(key):
    raw = base(**ds(**{"stage": 3, key: "auto"}))
    one_problem(raw, f"deepspeed.zero_optimization.{key}", "'auto' has no rule to fill it", "give a value")


@pytest.mark.parametrize("value", ["auto", -2])
def test_autotp_size_must_be_a_rank_count(value):
    one_problem(base(deepspeed={"tensor_parallel": {"autotp_size": value}}),
                "deepspeed.tensor_parallel.autotp_size", "whole number of ranks")


# --- all problems of one config together --------------------------------------------------------

def test_all_load_problems_reported_together(tmp_path):
    path = tmp_path / "many.yaml"
    path.write_text("model: {num_layers: 2.5, hiden_size: 64}\ntrain: {lr: fast}\nlogging: {log_evry: 1}\n")
    with pytest.raises(ConfigError) as err:
        load_preset(str(path))
    problems = err.value.problems
    assert len(problems) == 4
    assert {"model.num_layers", "model.hiden_size", "train.lr", "logging.log_evry"} == {
        key for key in ("model.num_layers", "model.hiden_size", "train.lr", "logging.log_evry")
        if any(key in p for p in problems)}
    assert str(err.value).startswith(f"4 problem(s) in {path}")


def test_all_resolve_problems_reported_together():
    raw = base(train={"lr": 0.0, "min_lr": 0.0}, data={"seq_len": 1024},
               deepspeed={"zero_optimization": {"overlap_com": True}, "nebula": {"enabled": True}})
    problems = problems_of(raw)
    for fragment in ("train.lr=0.0", "data.seq_len=1024", "overlap_com", "deepspeed.nebula"):
        assert any(fragment in p for p in problems), (fragment, problems)


def test_all_rule_problems_reported_together():
    raw = base(deepspeed={"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"},
                                                "zero_quantized_gradients": True},
                          "activation_checkpointing": {"partition_activations": False}})
    problems = problems_of(raw)
    assert len(problems) == 3
    assert any("offload_param" in p for p in problems) and any("ZeRO++" in p for p in problems)
    assert any("activation_checkpointing" in p for p in problems)


# --- the CLI: message on stderr, non-zero exit, no traceback ---------------------------------------

@pytest.mark.parametrize("args,fragment", [
    (["show", "tiny_cpu", "--set", "train.lrr=1e-4", "--set", "deepspeed.zero_optimization.stage=5"],
     "did you mean 'lr'"),
    (["export", "tiny_cpu", "--set", "deepspeed.tensor_parallel.autotp_size=3", "-o", "-"],
     "must divide the world size 2"),
])
def test_cli_errors_exit_nonzero_without_traceback(args, fragment):
    result = subprocess.run([sys.executable, "-m", "trainer", *args], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode != 0
    assert fragment in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert "{" not in result.stdout  # nothing half-written to stdout


@pytest.mark.parametrize("args,fragment", [
    (["show", "tiny_cpux"], "unknown preset 'tiny_cpux' (did you mean 'tiny_cpu'?)"),
    (["show", "tiny_cpu", "--set", "train.lr"], "expected section.key=value"),
    (["show", "tiny_cpu", "--set", "train.lr.x=1"], "'lr' holds a value, not a section"),
    (["show", "tiny_cpu", "--set", "train.lr=[1"], "not valid YAML"),
    (["show", "tiny_cpu", "--set", "deepspeed_template=zero9.json"], "zero9.json' not found"),
    (["export", "tiny_cpu", "-o", "/no/such/dir/ds.json"], "directory /no/such/dir does not exist"),
    (["show", "tiny_cpu", "--set", "train.lr=fast"], "train.lr: expected a number"),
])
def test_cli_user_errors_return_2_with_the_message(args, fragment, capsys):
    """A config problem is one `error:` line; a flag's own value (a path that cannot be written) is argparse's usage
    and `error: argument -o/--output: ...` line, checked before anything runs (trainer/paths.py)."""
    assert main(args) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert fragment in captured.err
    assert captured.err.startswith("error: ") or (lines[0].startswith("usage: python -m trainer ")
                                                   and "error: argument -o/--output: " in captured.err)
    assert captured.out == ""


def test_user_errors_are_user_errors():
    with pytest.raises(UserError):
        load_preset("no_such_preset")
