"""`resolve(config, world_size)`: override precedence, "auto" filling and the batch triad.

Precedence is `--set` > preset file > template > schema default. "auto" is filled the way the HF
Trainer fills it, from the train/model sections; the triad micro x accum x data-parallel = global is
solved from any two. No DeepSpeed runtime, no ranks.
"""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

from trainer import ds as dsc
from trainer.config import TrainConfig
from trainer.errors import ConfigError, UserError
from trainer.presets import config_from_dict, deep_merge, load_preset, load_template
from trainer.resolve import resolve

HIDDEN = 64


def base(**changes) -> dict:
    """A small valid config on 4 CPU ranks, fp32, the zero2.json template's content inline."""
    raw = {
        "name": "t",
        "hardware": {"gpu": "cpu", "gpus_per_node": 4, "nodes": 1},
        "model": {"hidden_size": HIDDEN, "num_layers": 2, "num_heads": 4, "intermediate_size": 128,
                  "vocab_size": 256, "max_position_embeddings": 128},
        "data": {"source": "data/tiny/pretrain.jsonl", "seq_len": 64},
        "train": {"precision": "fp32", "warmup_steps": 5, "max_steps": 50},
        "deepspeed": load_template("zero2.json"),
    }
    return deep_merge(raw, changes)


def resolved(world: int | None = None, **changes):
    return resolve(config_from_dict(base(**changes)), world)


def problems(world: int | None = None, **changes) -> list[str]:
    with pytest.raises(ConfigError) as err:
        resolved(world, **changes)
    return err.value.problems


# --- precedence: --set > preset > template > schema default -----------------------------------

PRESET = """\
deepspeed_template: zero2.json
hardware: {gpu: cpu, gpus_per_node: 2, nodes: 1}
model: {hidden_size: 64, num_layers: 2, num_heads: 4, intermediate_size: 128, vocab_size: 256,
        max_position_embeddings: 128}
data: {source: data/tiny/pretrain.jsonl, seq_len: 64}
train: {micro_batch_size: 4, grad_accum: 2, precision: fp32, lr: 1.0e-3, warmup_steps: 5, max_steps: 50}
deepspeed:
  zero_optimization: {allgather_bucket_size: 2.0e6}
  scheduler:
    params: {warmup_min_lr: null}
"""


@pytest.fixture
def preset(tmp_path) -> str:
    path = tmp_path / "mine.yaml"
    path.write_text(PRESET)
    return str(path)


def test_preset_over_template_over_schema_default(preset):
    r = resolve(load_preset(preset))
    z = dsc.zero(r.ds)
    template = load_template("zero2.json")["zero_optimization"]
    assert z["allgather_bucket_size"] == 2e6 != template["allgather_bucket_size"]  # preset beats template
    assert z["reduce_bucket_size"] == template["reduce_bucket_size"]                # template kept under the merge
    assert z["reduce_scatter"] is True and z["stage"] == 2                          # template
    assert r.config.train.lr == 1e-3 and r.ds["optimizer"]["params"]["lr"] == 1e-3  # preset
    assert r.config.train.eps == TrainConfig().eps                                  # schema default ...
    assert r.ds["optimizer"]["params"]["eps"] == TrainConfig().eps                  # ... reaches DeepSpeed
    assert r.ds["optimizer"]["params"]["weight_decay"] == TrainConfig().weight_decay
    assert r.config.name == "mine"                                                  # the file stem
    assert "warmup_min_lr" not in r.ds["scheduler"]["params"]                       # null deleted a template key
    assert r.ds["scheduler"]["params"]["warmup_max_lr"] == 1e-3


def test_set_beats_preset_template_and_default(preset):
    r = resolve(load_preset(preset, [
        "train.lr=1e-4",                                            # preset value
        "deepspeed.zero_optimization.allgather_bucket_size=3e6",    # preset value over a template value
        "deepspeed.zero_optimization.stage=3",                      # template value, dotted into the DS dict
        "deepspeed.zero_optimization.contiguous_gradients=false",
        "train.eps=1e-6",                                           # schema default
        "model.init_std=0.01",
    ]))
    z = dsc.zero(r.ds)
    assert dsc.zero_stage(r.ds) == 3 and z["allgather_bucket_size"] == 3e6 and z["contiguous_gradients"] is False
    assert r.ds["optimizer"]["params"]["lr"] == 1e-4 and r.ds["scheduler"]["params"]["warmup_max_lr"] == 1e-4
    assert r.ds["optimizer"]["params"]["eps"] == 1e-6 and r.config.model.init_std == 0.01


def test_set_null_deletes_a_template_key(preset):
    r = resolve(load_preset(preset, ["deepspeed.zero_optimization.reduce_scatter=null",
                                     "deepspeed.gradient_clipping=null", "train.lr=2e-4"]))
    assert "reduce_scatter" not in dsc.zero(r.ds) and "gradient_clipping" not in r.ds
    assert r.config.train.lr == 2e-4  # (a key given twice is refused: tests/test_set_items.py)


def test_set_can_add_whole_blocks_and_switch_template(preset):
    r = resolve(load_preset(preset, ["deepspeed_template=zero3.json",
                                     "deepspeed.zero_optimization.stage3_prefetch_bucket_size=auto"]))
    assert dsc.zero_stage(r.ds) == 3
    assert dsc.zero(r.ds)["stage3_max_live_parameters"] == 1e9             # from zero3.json
    assert dsc.zero(r.ds)["allgather_bucket_size"] == 2e6                   # the preset still overrides it
    assert dsc.zero(r.ds)["stage3_prefetch_bucket_size"] == int(0.9 * HIDDEN * HIDDEN)


def test_set_parses_values_as_yaml(preset):
    r = resolve(load_preset(preset, ["train.betas=[0.8, 0.9]", "train.lr=5e-4", "model.lora.target_modules=[q_proj]",
                                     "deepspeed.zero_optimization.overlap_comm=false"]))
    assert r.ds["optimizer"]["params"]["betas"] == [0.8, 0.9] and r.config.train.betas == (0.8, 0.9)
    assert r.config.train.lr == 5e-4 and isinstance(r.config.train.lr, float)
    assert r.config.model.lora.target_modules == ["q_proj"]
    assert dsc.zero(r.ds)["overlap_comm"] is False


def test_set_into_a_value_is_an_error(preset):
    with pytest.raises(UserError, match="'lr' holds a value, not a section"):
        load_preset(preset, ["train.lr.peak=1"])


# --- "auto" filling (HF Trainer semantics) ---------------------------------------------------------

def test_every_auto_of_the_template_is_filled_from_train_and_model():
    r = resolved(train={"micro_batch_size": 2, "grad_accum": 3, "lr": 2e-4, "betas": [0.8, 0.99], "eps": 1e-7,
                        "weight_decay": 0.05, "grad_clip": 0.5, "warmup_steps": 7, "max_steps": 70})
    ds = r.ds
    assert dsc.find_auto(ds) == []
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) \
        == (2, 3, 24)
    assert ds["optimizer"]["params"] == {"lr": 2e-4, "betas": [0.8, 0.99], "eps": 1e-7, "weight_decay": 0.05}
    assert ds["gradient_clipping"] == 0.5
    assert ds["scheduler"]["params"] == {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-4, "warmup_num_steps": 7,
                                         "total_num_steps": 70, "warmup_type": "linear"}
    assert ds["bf16"] == {"enabled": False}  # train.precision fp32


def test_cosine_scheduler_ratios_are_filled():
    r = resolved(train={"lr": 3e-4, "min_lr": 3e-5},
                 deepspeed={"scheduler": {"type": "WarmupCosineLR", "params": {
                     "warmup_min_lr": None, "warmup_max_lr": None, "warmup_min_ratio": "auto",
                     "cos_min_ratio": "auto"}}})
    params = r.ds["scheduler"]["params"]
    assert params["cos_min_ratio"] == pytest.approx(0.1) and params["warmup_min_ratio"] == 0.0
    assert params["warmup_num_steps"] == 5 and params["total_num_steps"] == 50


@pytest.mark.parametrize("precision,bf16,fp16", [("bf16", True, False), ("fp16", False, True), ("fp32", False, False)])
def test_precision_fills_bf16_and_fp16_enabled(precision, bf16, fp16):
    r = resolved(hardware={"gpu": "a100-80g"}, train={"precision": precision},
                 deepspeed={"bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto", "loss_scale": 0}})
    assert r.ds["bf16"]["enabled"] is bf16 and r.ds["fp16"]["enabled"] is fp16
    assert dsc.precision(r.ds) == precision


def test_bucket_sizes_from_hidden_size():
    r = resolved(deepspeed={"zero_optimization": {
        "stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto"}})
    z = dsc.zero(r.ds)
    assert z["reduce_bucket_size"] == HIDDEN * HIDDEN
    assert z["stage3_prefetch_bucket_size"] == int(0.9 * HIDDEN * HIDDEN)
    assert z["stage3_param_persistence_threshold"] == 10 * HIDDEN


def test_explicit_values_without_a_trainer_counterpart_are_kept():
    r = resolved(deepspeed={"zero_optimization": {"reduce_bucket_size": 12345}})
    assert dsc.zero(r.ds)["reduce_bucket_size"] == 12345


def test_explicit_deepspeed_values_that_agree_are_accepted():
    r = resolved(train={"lr": 1e-3}, deepspeed={"optimizer": {"params": {"lr": 0.001}}, "gradient_clipping": 1.0})
    assert r.ds["optimizer"]["params"]["lr"] == 1e-3


@pytest.mark.parametrize("deepspeed,fragments", [
    ({"optimizer": {"params": {"lr": 0.1}}}, ["deepspeed.optimizer.params.lr=0.1", "0.0003", "'auto'"]),
    ({"optimizer": {"params": {"betas": [0.9, 0.999]}}}, ["deepspeed.optimizer.params.betas=[0.9, 0.999]", "0.95"]),
    ({"optimizer": {"params": {"weight_decay": 0.0}}}, ["deepspeed.optimizer.params.weight_decay=0.0", "0.1"]),
    ({"gradient_clipping": 0.5}, ["deepspeed.gradient_clipping=0.5", "1.0"]),
    ({"scheduler": {"params": {"total_num_steps": 99}}}, ["deepspeed.scheduler.params.total_num_steps=99", "50"]),
    ({"scheduler": {"params": {"warmup_max_lr": 1.0}}}, ["deepspeed.scheduler.params.warmup_max_lr=1.0"]),
    ({"bf16": {"enabled": True}}, ["deepspeed.bf16.enabled=True", "False"]),
])
def test_explicit_deepspeed_value_that_disagrees_with_train_is_an_error(deepspeed, fragments):
    found = problems(deepspeed=deepspeed)
    assert any(all(f in p for f in fragments) and "disagrees" in p for p in found), found


# --- the batch triad ------------------------------------------------------------------------------


def triad_train(given: str, dp: int) -> dict:
    values = {"micro_batch_size": 2, "grad_accum": 3, "global_batch_size": 2 * 3 * dp}
    keep = {"micro+accum": ("micro_batch_size", "grad_accum"), "micro+global": ("micro_batch_size", "global_batch_size"),
            "accum+global": ("grad_accum", "global_batch_size")}[given]
    return {k: (v if k in keep else "auto") for k, v in values.items()}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("given", ["micro+accum", "micro+global", "accum+global"])
def test_triad_solved_from_any_two(given, tp):
    world = 4
    dp = world // tp
    extra = {"tensor_parallel": {"autotp_size": tp}} if tp > 1 else {}
    r = resolved(world, train=triad_train(given, dp), deepspeed=extra)
    b = r.batch
    assert (b.micro_batch_size, b.grad_accum, b.global_batch_size) == (2, 3, 2 * 3 * dp)
    assert (b.world_size, b.data_parallel_size) == (world, dp)
    t = r.config.train
    assert (t.micro_batch_size, t.grad_accum, t.global_batch_size) == (2, 3, 2 * 3 * dp)
    assert r.ds["train_micro_batch_size_per_gpu"] == 2 and r.ds["gradient_accumulation_steps"] == 3
    # DeepSpeed 0.19.8 checks its triad against the global world size, even under AutoTP
    assert r.ds["train_batch_size"] == 2 * 3 * world
    assert r.summary()["global_batch_size"] == 2 * 3 * dp and r.summary()["data_parallel_size"] == dp


@pytest.mark.parametrize("tp", [1, 2])
def test_triad_from_deepspeed_keys(tp):
    # the DeepSpeed keys count as given too; under AutoTP DeepSpeed's train_batch_size counts every rank
    extra = {"tensor_parallel": {"autotp_size": tp}} if tp > 1 else {}
    r = resolved(4, train={"micro_batch_size": 2}, deepspeed={"train_batch_size": 24, **extra})
    assert r.batch.grad_accum == 3 and r.ds["train_batch_size"] == 24
    assert r.batch.global_batch_size == 24 // tp


def test_one_given_means_no_accumulation():
    assert (resolved(4, train={"micro_batch_size": 2}).batch.grad_accum) == 1
    b = resolved(4, train={"global_batch_size": 16}).batch
    assert (b.micro_batch_size, b.grad_accum) == (4, 1)
    b = resolved(4).batch  # nothing given: DeepSpeed's defaults
    assert (b.micro_batch_size, b.grad_accum, b.global_batch_size) == (1, 1, 4)


def test_world_size_argument_overrides_the_declared_one():
    r = resolved(8, train={"micro_batch_size": 2, "grad_accum": 3})
    assert r.world_size == 8 and r.batch.global_batch_size == 48 and r.ds["train_batch_size"] == 48
    assert resolved(train={"micro_batch_size": 2, "grad_accum": 3}).world_size == 4


@pytest.mark.parametrize("train", [
    {"micro_batch_size": 2, "grad_accum": 3, "global_batch_size": 25},   # all three given, inconsistent
    {"micro_batch_size": 2, "global_batch_size": 25},                     # 25 / (2 x 4) is not whole
    {"micro_batch_size": 8, "global_batch_size": 16},                     # accum would be 0
])
def test_inconsistent_triad_prints_all_numbers_and_world_size(train):
    found = problems(4, train=train)
    message = next(p for p in found if "batch triad" in p)
    micro = train["micro_batch_size"]
    assert f"global_batch_size {train['global_batch_size']}" in message
    assert f"micro_batch_size {micro}" in message and "grad_accum" in message
    assert "data-parallel size 4" in message and "world size 4" in message


def test_inconsistent_triad_under_autotp_names_the_data_parallel_size():
    message = problems(4, train={"micro_batch_size": 2, "grad_accum": 3, "global_batch_size": 24},
                       deepspeed={"tensor_parallel": {"autotp_size": 2}})[0]
    assert "global_batch_size 24 != micro_batch_size 2 x grad_accum 3 x data-parallel size 2" in message
    assert "world size 4, autotp_size 2" in message


def test_train_and_deepspeed_batch_keys_must_agree():
    found = problems(train={"micro_batch_size": 2}, deepspeed={"train_micro_batch_size_per_gpu": 4})
    assert any("train.micro_batch_size=2" in p and "deepspeed.train_micro_batch_size_per_gpu=4" in p
               and "disagree" in p for p in found), found


def test_autotp_train_batch_size_must_count_whole_tp_groups():
    found = problems(4, train={"micro_batch_size": 2}, deepspeed={"train_batch_size": 25,
                                                                 "tensor_parallel": {"autotp_size": 2}})
    assert any("deepspeed.train_batch_size=25" in p and "multiple of autotp_size 2" in p for p in found), found


def test_resolved_config_has_ints_and_keeps_the_input_untouched():
    cfg = config_from_dict(base(train={"micro_batch_size": "auto", "grad_accum": 2, "global_batch_size": 16}))
    r = resolve(cfg)
    assert (r.config.train.micro_batch_size, r.config.train.grad_accum) == (2, 2)
    assert cfg.train.micro_batch_size == "auto" and cfg.deepspeed["train_batch_size"] == "auto"
