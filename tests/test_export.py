"""`python -m trainer export`: every exported DeepSpeed JSON is accepted by DeepSpeed's own parser.

The JSON is fed to `deepspeed.runtime.config.DeepSpeedConfig` (the class `deepspeed.initialize` builds)
at the preset's world size. DeepSpeedConfig takes the world size from `deepspeed.comm`, falling back to 1
when no process group exists, or from the `mpu` argument's `get_data_parallel_world_size()` - so a
single-process gloo group is started once for this module and an `mpu` reports the ranks DeepSpeed
divides the batch by. One process, one rank: no launcher, nothing trains.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

from distributed import one_rank_process_group
from trainer import ds as dsc
from trainer.__main__ import main
from trainer.presets import PRESET_DIR, load_preset
from trainer.resolve import resolve

PRESETS = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


class Mpu:
    """DeepSpeed's documented `mpu` hook; DeepSpeedConfig only asks it for the data-parallel world size."""

    def __init__(self, data_parallel_size: int):
        self.data_parallel_size = data_parallel_size

    def get_data_parallel_world_size(self) -> int:
        return self.data_parallel_size


def deepspeed_world(resolved) -> int:
    """The rank count DeepSpeed checks its triad against: the data-parallel size, except that DeepSpeed
    0.19.8 counts the global world size under AutoTP (trainer.ds.Batch.deepspeed_train_batch_size)."""
    return resolved.world_size if dsc.autotp_size(resolved.ds) > 1 else resolved.batch.data_parallel_size


@pytest.fixture(scope="module")
def DeepSpeedConfig():
    from deepspeed.runtime.config import DeepSpeedConfig as parser
    with one_rank_process_group():
        yield parser


def parse(DeepSpeedConfig, ds: dict, world: int):
    config = DeepSpeedConfig(json.loads(json.dumps(ds)), mpu=Mpu(world))
    assert config.world_size == world, "DeepSpeedConfig did not use the mpu: the triad was not checked"
    return config


def assert_parsed_as_resolved(config, resolved):
    ds, batch = resolved.ds, resolved.batch
    assert config.train_micro_batch_size_per_gpu == batch.micro_batch_size
    assert config.gradient_accumulation_steps == batch.grad_accum
    assert config.train_batch_size == batch.deepspeed_train_batch_size
    assert config.zero_optimization_stage == dsc.zero_stage(ds)
    assert config.bfloat16_config.enabled == dsc.bf16_enabled(ds)
    assert config.float16_config.enabled == dsc.fp16_enabled(ds)
    train = resolved.config.train
    assert config.gradient_clipping == train.grad_clip
    if config.optimizer_params is not None:
        assert config.optimizer_params["lr"] == train.lr
        assert list(config.optimizer_params["betas"]) == list(train.betas)
    if config.scheduler_params is not None:
        assert config.scheduler_params["warmup_num_steps"] == train.warmup_steps
        assert config.scheduler_params["total_num_steps"] == train.max_steps
    for which, device in (("offload_optimizer", dsc.offload_optimizer_device(ds)),
                          ("offload_param", dsc.offload_param_device(ds))):
        block = getattr(config.zero_config, which)
        assert (str(getattr(block.device, "value", block.device)) if block is not None else "none") == device


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny_cpu", "70b_32xa100"])
def test_export_command_writes_json_deepspeed_accepts(name, tmp_path, DeepSpeedConfig):
    out = tmp_path / "ds.json"
    result = subprocess.run([sys.executable, "-m", "trainer", "export", name, "-o", str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    ds = json.loads(out.read_text())
    resolved = resolve(load_preset(name))
    assert ds == resolved.ds
    assert_parsed_as_resolved(parse(DeepSpeedConfig, ds, deepspeed_world(resolved)), resolved)


def test_export_to_stdout_is_pure_json():
    # DeepSpeed logs to stdout; `export -o - > ds.json` must still give a JSON file
    result = subprocess.run([sys.executable, "-m", "trainer", "export", "tiny_cpu", "-o", "-"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["train_batch_size"] == 16


@pytest.mark.slow
@pytest.mark.parametrize("name", PRESETS)
def test_every_exported_preset_is_accepted_by_deepspeed(name, tmp_path, DeepSpeedConfig):
    out = tmp_path / f"{name}.json"
    assert main(["export", name, "-o", str(out)]) == 0
    ds = json.loads(out.read_text())
    assert dsc.find_auto(ds) == []
    resolved = resolve(load_preset(name))
    assert resolved.world_size == resolved.config.hardware.nodes * resolved.config.hardware.gpus_per_node
    assert_parsed_as_resolved(parse(DeepSpeedConfig, ds, deepspeed_world(resolved)), resolved)


@pytest.mark.slow
def test_deepspeed_rejects_the_export_at_another_world_size(DeepSpeedConfig):
    # proves the check above has teeth: the triad is checked against the mpu's size
    resolved = resolve(load_preset("7b_8xa100"))
    with pytest.raises(AssertionError, match="Check batch related parameters"):
        DeepSpeedConfig(json.loads(json.dumps(resolved.ds)), mpu=Mpu(4))
    # re-exported for 4 ranks it is accepted again
    resolved4 = resolve(load_preset("7b_8xa100"), 4)
    assert_parsed_as_resolved(parse(DeepSpeedConfig, resolved4.ds, 4), resolved4)


@pytest.mark.slow
def test_export_with_world_size_and_overrides(tmp_path, DeepSpeedConfig):
    out = tmp_path / "ds.json"
    assert main(["export", "7b_8xa100", "--world-size", "16", "--set", "deepspeed.zero_optimization.stage=3",
                 "--set", "train.grad_accum=null", "--set", "train.global_batch_size=512", "-o", str(out)]) == 0
    ds = json.loads(out.read_text())
    assert dsc.zero_stage(ds) == 3 and ds["gradient_accumulation_steps"] == 4  # 512 / (8 x 16)
    config = DeepSpeedConfig(ds, mpu=Mpu(16))
    assert config.zero_optimization_stage == 3 and config.train_batch_size == 512


def write_preset(tmp_path: Path, template: str, world: int, gpu: str = "a100-80g", extra: str = "") -> Path:
    path = tmp_path / f"t_{template.removesuffix('.json')}.yaml"
    path.write_text(f"""\
description: template check
deepspeed_template: {template}
hardware: {{gpu: {gpu}, gpus_per_node: {world}, nodes: 1}}
model: {{hidden_size: 512, num_layers: 2, num_heads: 8, intermediate_size: 1024, vocab_size: 1000,
        max_position_embeddings: 512}}
data: {{source: data/tiny/pretrain.jsonl, seq_len: 256}}
train: {{micro_batch_size: 2, grad_accum: 4, lr: 1.0e-4, warmup_steps: 10, max_steps: 100}}
{extra}""")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("template", ["zero2.json", "zero2_offload.json", "zero3.json", "zero3_offload.json",
                                      "zero3_nvme.json", "zeropp.json"])
def test_each_template_filled_for_a_world_size_is_accepted(template, tmp_path, DeepSpeedConfig):
    extra = ""
    if template == "zero3_nvme.json":
        nvme = tmp_path / "nvme"
        nvme.mkdir()
        extra = (f"deepspeed:\n  zero_optimization:\n    offload_optimizer: {{nvme_path: {nvme}}}\n"
                 f"    offload_param: {{nvme_path: {nvme}}}\n")
    path = write_preset(tmp_path, template, world=8, extra=extra)
    resolved = resolve(load_preset(str(path)))
    assert dsc.find_auto(resolved.ds) == []
    config = parse(DeepSpeedConfig, resolved.ds, 8)
    assert_parsed_as_resolved(config, resolved)
    assert config.train_batch_size == 2 * 4 * 8
    assert config.optimizer_params == {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
    assert config.scheduler_params == {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-4, "warmup_num_steps": 10,
                                       "total_num_steps": 100, "warmup_type": "linear"}
    assert config.bfloat16_config.enabled is True
    # the template's explicit values reach DeepSpeed untouched
    raw = json.loads((PRESET_DIR / "deepspeed" / template).read_text())["zero_optimization"]
    assert config.zero_config.reduce_bucket_size == raw["reduce_bucket_size"]
    if template == "zeropp.json":
        assert config.zero_config.zero_hpz_partition_size == 8
        assert config.zero_config.zero_quantized_weights and config.zero_config.zero_quantized_gradients
    if template == "zero3_nvme.json":
        assert config.zero_config.offload_param.nvme_path == tmp_path / "nvme"
        assert config.aio_config["intra_op_parallelism"] == 1


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_autotp_export_is_accepted_with_the_global_world_size(world, tmp_path, DeepSpeedConfig):
    path = write_preset(tmp_path, "zero2.json", world=world,
                        extra="deepspeed:\n  tensor_parallel: {autotp_size: 2}\n")
    resolved = resolve(load_preset(str(path)))
    assert resolved.batch.data_parallel_size == world // 2
    assert resolved.batch.global_batch_size == 2 * 4 * (world // 2)  # distinct samples per step
    out = tmp_path / "tp.json"
    assert main(["export", str(path), "-o", str(out)]) == 0
    ds = json.loads(out.read_text())
    config = parse(DeepSpeedConfig, ds, world)  # DeepSpeed counts every rank of a TP group
    assert config.tensor_parallel_config.autotp_size == 2
    assert config.train_batch_size == 2 * 4 * world
    with pytest.raises(AssertionError, match="Check batch related parameters"):
        DeepSpeedConfig(ds, mpu=Mpu(world // 2))


@pytest.mark.slow
@pytest.mark.parametrize("world,sp", [(2, 2), (8, 4)])
def test_sequence_parallel_export_is_accepted_with_world_over_sp(world, sp, tmp_path, DeepSpeedConfig):
    """An SP group consumes one sample: the data-parallel size, the global batch and tokens/step count groups, and
    DeepSpeed (whose mpu reports world / sequence_parallel_size) accepts the exported triad."""
    path = write_preset(tmp_path, "zero2.json", world=world, extra=f"deepspeed:\n  sequence_parallel_size: {sp}\n")
    resolved = resolve(load_preset(str(path)))
    dp = world // sp
    assert resolved.batch.data_parallel_size == dp
    assert resolved.batch.global_batch_size == 2 * 4 * dp
    assert resolved.tokens_per_step == 2 * 4 * dp * 256
    assert resolved.summary()["sequence_parallel_size"] == sp
    out = tmp_path / "sp.json"
    assert main(["export", str(path), "-o", str(out)]) == 0
    ds = json.loads(out.read_text())
    assert ds["sequence_parallel_size"] == sp and ds["train_batch_size"] == 2 * 4 * dp
    assert parse(DeepSpeedConfig, ds, dp).train_batch_size == 2 * 4 * dp
    with pytest.raises(AssertionError, match="Check batch related parameters"):
        DeepSpeedConfig(ds, mpu=Mpu(world))
