"""The shipped presets (presets/*.yaml) and DeepSpeed templates (presets/deepspeed/*.json).

Every preset must load strictly, resolve at the world size it declares with no "auto" left, and
document itself in its header comment; the CLI must list and show them. Fast: no training, no ranks.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent

from trainer import ds as dsc
from trainer.__main__ import main
from trainer.config import AUTO
from trainer.presets import PRESET_DIR, TEMPLATE_DIR, list_presets, load_preset
from trainer.resolve import declared_world_size, resolve
from distributed import run_cli

PRESET_FILES = sorted(PRESET_DIR.glob("*.yaml"))
PRESETS = [p.stem for p in PRESET_FILES]
TEMPLATES = ["zero2.json", "zero2_offload.json", "zero3.json", "zero3_offload.json", "zero3_nvme.json", "zeropp.json"]



def header(path: Path) -> list[str]:
    """The leading comment block of a preset file, without the '# '."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return lines


def test_the_shipped_presets_are_all_there():
    # the presets: the embedded CPU default, the seed's four scenarios, LoRA, a pretrain
    assert {"tiny_cpu", "7b_8xa100", "70b_8xa100", "70b_32xa100", "7b_2xv100", "7b_lora_1x4090",
            "1b_pretrain_8xh100", "7b_dpo_8xa100", "7b_dpo_lora_1x4090"} <= set(PRESETS)
    assert [name for name, _ in list_presets()] == PRESETS


@pytest.mark.parametrize("name", PRESETS)
def test_preset_resolves_at_its_declared_world_size(name):
    config = load_preset(name)
    assert config.name == name
    world = declared_world_size(config)
    resolved = resolve(config)
    assert resolved.world_size == world == config.hardware.nodes * config.hardware.gpus_per_node
    assert dsc.find_auto(resolved.ds) == [], f"{name}: 'auto' left in the resolved DeepSpeed config"
    batch = resolved.batch
    sp = dsc.sequence_parallel_size(resolved.ds)  # a Ulysses group of sp ranks trains one sample together
    assert batch.data_parallel_size == world // dsc.autotp_size(resolved.ds) // sp
    assert batch.micro_batch_size * batch.grad_accum * batch.data_parallel_size == batch.global_batch_size
    train = resolved.config.train
    assert (train.micro_batch_size, train.grad_accum, train.global_batch_size) == (
        batch.micro_batch_size, batch.grad_accum, batch.global_batch_size)
    ds = resolved.ds
    assert ds["train_micro_batch_size_per_gpu"] == batch.micro_batch_size
    assert ds["gradient_accumulation_steps"] == batch.grad_accum
    assert ds["train_batch_size"] == batch.micro_batch_size * batch.grad_accum * world // sp
    assert dsc.precision(ds) == config.train.precision, "train.precision and the DeepSpeed blocks disagree"


@pytest.mark.parametrize("path", PRESET_FILES, ids=PRESETS)
def test_preset_header_documents_hardware_model_tradeoff_memory_and_launch(path):
    lines = header(path)
    assert lines and lines[0].startswith(path.stem), f"{path.name}: first line should name the preset"
    for label in ("Hardware:", "Model:", "Trade-off:", "Expected memory", "Launch:"):
        assert any(line.startswith(label) for line in lines), f"{path.name}: header has no '{label}' line"
    config = load_preset(path.stem)
    assert config.description, f"{path.name}: empty description"
    launch = next(line for line in lines if line.startswith("Launch:"))
    # the launch line must start what the preset describes
    assert f"--preset {path.stem}" in launch
    assert re.search(rf"--num_gpus[ =]{config.hardware.gpus_per_node}\b", launch), launch
    if config.hardware.nodes > 1:
        assert re.search(rf"--num_nodes[ =]{config.hardware.nodes}\b", launch) and "--hostfile" in launch, launch
    # the same line the planner and the doctor build (tiny_cpu's header also pins the README's port)
    from trainer.launch.command import command_for
    from trainer.resolve import resolve
    written = re.sub(r" --master_port \d+", "", launch[len("Launch: "):])
    assert written == command_for(resolve(config), path.stem, []), launch


def test_presets_command_lists_every_preset_with_its_description():
    result = run_cli("presets")
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    assert sorted(rows) == PRESETS
    for name, description in list_presets():
        assert description and description in rows[name]


def test_show_prints_the_resolved_config_as_yaml():
    result = run_cli("show", "tiny_cpu", "--set", "train.grad_accum=2")
    assert result.returncode == 0, result.stderr
    doc = yaml.safe_load(result.stdout)
    assert doc["name"] == "tiny_cpu"
    assert doc["train"]["micro_batch_size"] == 8 and doc["train"]["grad_accum"] == 2
    assert doc["train"]["global_batch_size"] == 8 * 2 * 2
    ds = doc["deepspeed"]
    assert dsc.find_auto(ds) == []
    assert ds["train_batch_size"] == 32 and ds["optimizer"]["params"]["lr"] == doc["train"]["lr"]
    assert doc["derived"]["world_size"] == 2 and doc["derived"]["zero_stage"] == 2
    assert doc["derived"]["tokens_per_step"] == 32 * doc["data"]["seq_len"]


def test_show_json_and_world_size_flag(capsys):
    assert main(["show", "7b_8xa100", "--json", "--world-size", "16"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["derived"]["world_size"] == 16
    assert doc["deepspeed"]["train_batch_size"] == 8 * 4 * 16  # micro 8 x accum 4 x 16 ranks


# --- the shared DeepSpeed templates (the seed's templates A-F) ----------------------------------

HF_AUTO = {  # where the seed's template A (and the HF Trainer) put "auto"
    ("train_batch_size",), ("train_micro_batch_size_per_gpu",), ("gradient_accumulation_steps",),
    ("gradient_clipping",), ("bf16", "enabled"),
    ("optimizer", "params", "lr"), ("optimizer", "params", "betas"), ("optimizer", "params", "eps"),
    ("optimizer", "params", "weight_decay"),
    ("scheduler", "params", "warmup_min_lr"), ("scheduler", "params", "warmup_max_lr"),
    ("scheduler", "params", "warmup_num_steps"), ("scheduler", "params", "total_num_steps"),
}


def test_exactly_the_six_templates_ship():
    assert sorted(p.name for p in TEMPLATE_DIR.glob("*.json")) == sorted(TEMPLATES)


@pytest.mark.parametrize("name", TEMPLATES)
def test_template_is_plain_deepspeed_json_with_hf_auto_values(name):
    ds = json.loads((TEMPLATE_DIR / name).read_text())
    assert dsc.check_keys(ds, typed=False) == [], "a template holds only keys the installed DeepSpeed reads"
    for path in HF_AUTO:
        node = ds
        for key in path:
            node = node[key]
        assert node == AUTO, f"{name}: {'.'.join(path)} should be 'auto'"
    autos = {tuple(p.split(".")) for p in dsc.find_auto(ds)}
    assert autos == HF_AUTO, f"{name}: 'auto' only where the HF Trainer fills it"


def test_templates_carry_the_seed_settings():
    t = {name: json.loads((TEMPLATE_DIR / name).read_text()) for name in TEMPLATES}
    assert dsc.zero_stage(t["zero2.json"]) == 2 and dsc.offload_optimizer_device(t["zero2.json"]) == "none"
    assert dsc.zero_stage(t["zero2_offload.json"]) == 2
    assert dsc.offload_optimizer_device(t["zero2_offload.json"]) == "cpu"
    assert dsc.zero(t["zero2_offload.json"])["round_robin_gradients"] is True
    assert dsc.zero_stage(t["zero3.json"]) == 3 and dsc.gather_16bit_on_save(t["zero3.json"])
    assert (dsc.offload_optimizer_device(t["zero3_offload.json"]), dsc.offload_param_device(t["zero3_offload.json"])) \
        == ("cpu", "cpu")
    nvme = t["zero3_nvme.json"]
    assert (dsc.offload_optimizer_device(nvme), dsc.offload_param_device(nvme)) == ("nvme", "nvme")
    assert dsc.offload_block(nvme, "offload_optimizer")["buffer_count"] >= 4
    assert "intra_op_parallelism" in dsc.aio_block(nvme) and "thread_count" not in dsc.aio_block(nvme)
    zpp = t["zeropp.json"]
    assert dsc.zero_stage(zpp) == 3, "ZeRO++ keys are read only at stage 3 in DeepSpeed 0.19.8"
    assert dsc.hpz_partition_size(zpp) == 8 and dsc.quantized_weights(zpp) and dsc.quantized_gradients(zpp)
    for ds in t.values():
        assert ds["optimizer"]["type"] == "AdamW"
        assert "fp16" not in ds, "precision comes from train.precision through bf16.enabled: auto"


SFT_ON_CHECKPOINTS = [c.name for c in map(load_preset, PRESETS) if c.data.task == "sft" and c.model.name_or_path]


@pytest.mark.parametrize("name", SFT_ON_CHECKPOINTS)
def test_sft_presets_on_base_checkpoints_name_a_chat_template(name):
    """Base checkpoints ship no chat template, so the preset must bring one for its chat messages."""
    config = load_preset(name)
    assert config.data.chat_template is not None
    if config.model.name_or_path.endswith("-hf") and "Llama-2" in config.model.name_or_path:
        assert config.data.chat_template == "llama-2"  # a Llama-2 base learns the Llama-2-chat format


def test_rehearsal_stops_where_the_real_run_would_without_a_chat_template(tmp_path):
    """--rehearse swaps in the tiny tokenizer, which has a template of its own; a preset that relies on a
    template it does not set must still fail at data preparation, with the real run's error."""
    from trainer.data import DataError, apply_chat_template, build_datasets, load_tokenizer
    from trainer.train.rehearse import rehearsal_config

    def prepare(overrides):
        cfg, _ = rehearsal_config(load_preset("7b_8xa100", [f"train.output_dir={tmp_path / 'run'}"] + overrides), 2)
        return cfg, build_datasets(cfg.data, apply_chat_template(load_tokenizer(cfg.model), cfg.data), cfg.train.seed)

    cfg, data = prepare([])
    assert cfg.data.source.endswith("chat.jsonl") and len(data.eval[0]) >= cfg.train.micro_batch_size * 2
    with pytest.raises(DataError, match="no chat_template .*set data.chat_template: chatml"):
        prepare(["data.chat_template=null"])
