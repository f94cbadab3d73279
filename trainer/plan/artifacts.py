"""What a plan turns into: the DeepSpeed config, the nearest shipped preset with its `--set` changes, the
launch line."""
from __future__ import annotations

import dataclasses
import functools
import json
import shlex
from typing import Any, Optional

from .. import ds as dsc
from ..config import Config, DataConfig, GrpoConfig, HardwareConfig, PreferenceConfig, TrainConfig
from ..presets import PRESET_DIR, load_preset, parse_yaml, with_overrides
from . import memory as mem
from .estimate import Candidate, Plan
from .inputs import PlanInputs
from .preset_file import written_by_plan


DEFAULT_LR = {"pretrain": 3e-4, "full": 2e-5, "lora": 2e-4, "dpo": 5e-7, "dpo-lora": 5e-6,
              "grpo": 1e-6}  # GRPO: DeepSeekMath's and TRL's GSM8K recipes  # DPO: the paper's 5e-7


def planned_deepspeed_config(plan: Plan) -> dict:
    """The chosen candidate as a complete DeepSpeed config (no "auto" left), built by trainer.ds."""
    c, inputs = plan.choice, plan.inputs
    ds = dsc.base_config(c.candidate.stage, c.candidate.offload_optimizer, c.candidate.offload_param,
                         inputs.nvme_path, inputs.precision, c.checkpointing or c.checkpoint_offload,
                         c.checkpoint_offload)
    if c.hpz_partition_size > 1:
        ds = dsc.with_zeropp(ds, c.hpz_partition_size)
    ds = dsc.with_sequence_parallel(ds, inputs.sp)
    ds = dsc.with_expert_parallel(ds, inputs.expert_parallel)
    ds = dsc.with_bucket_floor(ds, inputs.model.config.hidden_size)
    config = planned_trainer_config(plan, ds)
    problems: list[str] = []
    dp = inputs.data_parallel_size  # DeepSpeed's triad under SP counts world / sequence_parallel_size ranks
    batch = dsc.Batch(c.micro_batch, plan.grad_accum, plan.global_batch, dp, dp)
    filled = dsc.fill_auto(config, batch, problems)
    if problems:  # a planner bug, not a user error
        raise RuntimeError(f"planned DeepSpeed config does not fill: {problems}")
    return filled


def planned_trainer_config(plan: Plan, ds: dict) -> Config:
    c, inputs = plan.choice, plan.inputs
    model = dataclasses.replace(inputs.model.config, gradient_checkpointing=c.checkpointing,
                                lora=dataclasses.replace(inputs.lora, enabled=inputs.lora_enabled),
                                tiled_mlp=c.mlp_tiles)  # tiled_logits stays "auto": it decides as the plan counted
    train = TrainConfig(micro_batch_size=c.micro_batch, grad_accum=plan.grad_accum,
                        global_batch_size=plan.global_batch, precision=inputs.precision, lr=DEFAULT_LR[inputs.task])
    hardware = HardwareConfig(gpu=inputs.gpu.name, gpus_per_node=inputs.gpus_per_node, nodes=inputs.nodes,
                              cpu_ram_gb=inputs.cpu_ram_gb, nvme_gb=inputs.nvme_gb)
    task = "preference" if inputs.preference else "pretrain" if inputs.task == "pretrain" else "sft"
    grpo = GrpoConfig()
    if inputs.grpo:  # whole groups per micro-batch (rules.grpo_settings): the largest of 16, 8, 4, 2 dividing it
        task = "grpo"
        group = next((g for g in (16, 8, 4, 2) if c.micro_batch % g == 0), 2)
        grpo = GrpoConfig(num_generations=group, max_new_tokens=max(1, inputs.seq_len // 2),
                          beta=0.0 if inputs.reference == "none" else 0.04)
    preference = PreferenceConfig()
    if inputs.preference:
        preference = PreferenceConfig(reference=inputs.reference, reference_offload=(
            c.candidate.stage == 3 and c.candidate.offload_param != "none"))
    return Config(name="plan", hardware=hardware, model=model, data=DataConfig(task=task, seq_len=inputs.seq_len),
                  train=train, deepspeed=ds, preference=preference, grpo=grpo)


ARCHITECTURE_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size",
                       "max_position_embeddings", "tie_word_embeddings")


PARAMS_MATCH = 0.05  # a preset is "the same model" within 5% of the parameters


def nearest_preset(plan: Plan) -> tuple[Optional[str], list[str], list[str]]:
    """(name, differences, --set overrides) of the closest shipped preset for the same model; when none ships this
    model, the nearest for the hardware and the task with the items that make it this model (`nearest_for_model`);
    (None, [], []) only when no GPU preset ships at all."""
    inputs = plan.inputs
    shipped = [(path.stem, _shipped(path.stem, path.stat().st_mtime_ns)) for path in sorted(PRESET_DIR.glob("*.yaml"))
               if not written_by_plan(path)]  # a preset `plan --write-preset` wrote is no source for another
    shipped = [(name, config) for name, config in shipped if config.hardware.gpu != "cpu"]
    scored = [(-_similarity(plan, config), name, config) for name, config in shipped if _same_model(inputs, config)]
    if not scored:
        return nearest_for_model(plan, shipped)
    _, name, config = min(scored, key=lambda item: (item[0], item[1]))
    differences, overrides = preset_overrides(plan, config, name)
    return name, differences, overrides


@functools.lru_cache(maxsize=64)
def _shipped(name: str, mtime_ns: int) -> Config:
    """A shipped preset, read once per process while its file is unchanged (every plan compares them all)."""
    return load_preset(name)


def shipped_config(name: str) -> Config:
    """A shipped preset by name, read once per process while its file is unchanged."""
    return _shipped(name, (PRESET_DIR / f"{name}.yaml").stat().st_mtime_ns)


MODEL_KEYS = ("family", "head_dim", "num_experts", "num_experts_per_tok", "rope_theta")  # beside ARCHITECTURE_FIELDS


def nearest_for_model(plan: Plan, shipped: list[tuple[str, Config]]) -> tuple[Optional[str], list[str], list[str]]:
    """No shipped preset trains this model: the preset of the same kind of training (pretrain, SFT or preference;
    LoRA or not; dense or MoE; as many of these as one ships) that needs the fewest `--set` items to become the plan,
    and those items: first the model's (its weights, family and architecture), then the plan's (hardware, ZeRO,
    offload, batch)."""
    best = None
    for name, config in shipped:
        model_differences, model_items = model_overrides(plan, config)
        differences, overrides = preset_overrides(plan, config, name)
        items = with_overrides(model_items, overrides)  # a key both set (a bucket size) once
        key = (_kind_mismatches(plan, config), len(items), name)
        if best is None or key < best[0]:
            best = (key, name, model_differences + differences, items)
    if best is None:
        return None, [], []
    _, name, differences, overrides = best
    return name, differences, overrides


def _kind_mismatches(plan: Plan, config: Config) -> int:
    inputs = plan.inputs
    return ((config.data.task == "preference") != inputs.preference) + (
        (config.data.task == "grpo") != inputs.grpo) + (
        (config.data.task == "pretrain") != (inputs.task == "pretrain")) + (
        config.model.lora.enabled != inputs.lora_enabled) + (
        (config.model.num_experts is None) != (inputs.model.config.num_experts is None))


def model_overrides(plan: Plan, config: Config) -> tuple[list[str], list[str]]:
    """What makes a preset of another model train the plan's: its weights (a config.json's directory, a named
    model's hub id; none to pretrain), family and the keys ARCHITECTURE_FIELDS leaves out, the tokenizer of its
    weights, ZeRO-3 leaf modules found anew for another family, LoRA on or off. (differences, --set items)."""
    inputs, have, want = plan.inputs, config.model, plan.inputs.model.config
    weights = None if inputs.task == "pretrain" else want.name_or_path
    changes = [(f"model.{key}", getattr(have, key), getattr(want, key)) for key in MODEL_KEYS]
    if weights is not None or inputs.task == "pretrain":
        changes.insert(0, ("model.name_or_path", have.name_or_path, weights))
    if weights is not None and have.tokenizer is not None:
        changes.append(("model.tokenizer", have.tokenizer, None))  # the tokenizer of the weights
    if have.zero3_leaf_modules is not None and have.family != want.family:
        changes.append(("model.zero3_leaf_modules", have.zero3_leaf_modules, None))  # found in the model
    changes.append(("model.lora.enabled", have.lora.enabled, inputs.lora_enabled))
    changes = [(key, old, new) for key, old, new in changes if old != new]
    differences = [f"model: {config.name} trains {have.name_or_path or 'an inline model'}; the --set items below make "
                   f"it {inputs.model.label}"]
    differences += [f"{key}: preset {old}, plan {new}" for key, old, new in changes]
    buckets = dsc.bucket_overrides(config.deepspeed, plan.deepspeed)  # sized for the preset's model
    differences += [f"{item.split('=')[0]}: sized for this model's hidden size" for item in buckets]
    if weights is None and inputs.task != "pretrain":
        differences.append(f"{inputs.model.label} names no weights: add --set model.name_or_path=YOUR_WEIGHTS")
    return differences, [f"{key}={_yaml_value(new)}" for key, _, new in changes] + buckets


def _same_model(inputs: PlanInputs, config: Config) -> bool:
    params = mem.count_params(config.model)
    return (abs(params - inputs.params) <= PARAMS_MATCH * inputs.params
            and config.model.lora.enabled == inputs.lora_enabled)


def _similarity(plan: Plan, config: Config) -> int:
    c, hw, ds = plan.choice.candidate, config.hardware, config.deepspeed
    return (4 * ((config.data.task == "preference") == plan.inputs.preference)
            + 4 * ((config.data.task == "grpo") == plan.inputs.grpo)
            + 2 * (hw.gpu == plan.inputs.gpu.name) + 2 * (hw.nodes * hw.gpus_per_node == plan.inputs.world_size)
            + (dsc.zero_stage(ds) == c.stage)
            + (dsc.offload_optimizer_device(ds) == c.offload_optimizer)
            + (dsc.offload_param_device(ds) == c.offload_param))


def preset_overrides(plan: Plan, config: Config, preset: str = "the preset") -> tuple[list[str], list[str]]:
    """What differs between the preset and the plan, and the `--set` strings that make the preset the plan."""
    inputs, c = plan.inputs, plan.choice
    differences, overrides = [], []

    def setting(key: str, have: Any, want: Any) -> None:
        if have != want:
            differences.append(f"{key}: preset {have}, plan {want}")
            overrides.append(f"{key}={_yaml_value(want)}")

    hw = config.hardware
    for name in ARCHITECTURE_FIELDS:  # e.g. longer positions for a longer sequence
        setting(f"model.{name}", getattr(config.model, name), getattr(inputs.model.config, name))
    setting("hardware.gpu", hw.gpu, inputs.gpu.name)
    setting("hardware.gpus_per_node", hw.gpus_per_node, inputs.gpus_per_node)
    setting("hardware.nodes", hw.nodes, inputs.nodes)
    # the plan's host RAM (none given: not checked), not the preset's machine's, which the plan never priced
    setting("hardware.cpu_ram_gb", hw.cpu_ram_gb, inputs.cpu_ram_gb)
    setting("data.seq_len", config.data.seq_len, inputs.seq_len)
    setting("train.precision", config.train.precision, inputs.precision)
    setting("train.micro_batch_size", config.train.micro_batch_size, c.micro_batch)
    accum, said = (plan.grad_accum, None) if inputs.global_batch else accumulation_keeping(plan, config, preset)
    setting("train.grad_accum", config.train.grad_accum, accum)
    if said:
        differences.append(said)
    if config.train.global_batch_size is not None:
        setting("train.global_batch_size", config.train.global_batch_size,
                c.micro_batch * accum * inputs.data_parallel_size)
    setting("model.gradient_checkpointing", config.model.gradient_checkpointing, c.checkpointing)
    if inputs.preference and config.data.task == "preference":  # the reference the plan priced, not the preset's
        setting("preference.reference", config.preference.reference, inputs.reference)
    if c.mlp_tiles:  # the plan needs them; a preset's own tiles where the plan does not are left alone
        setting("model.tiled_mlp", config.model.tiled_mlp, c.mlp_tiles)
    fixed_logits_tiles = config.model.tiled_logits
    if c.logits_tiles and fixed_logits_tiles is not None and fixed_logits_tiles != c.logits_tiles:
        differences.append(f"model.tiled_logits: preset {fixed_logits_tiles}, plan auto ({c.logits_tiles} tiles)")
        overrides.append("model.tiled_logits=null")  # the plan counted what "auto" runs
    if dsc.sequence_parallel_size(config.deepspeed) != inputs.sp:
        differences.append(f"sequence parallel: preset {dsc.sequence_parallel_size(config.deepspeed)}, plan {inputs.sp}")
        overrides.append(f"deepspeed.sequence_parallel_size={inputs.sp}")
    if dsc.autoep_size(config.deepspeed) != inputs.expert_parallel:  # a preset's groups may not divide these GPUs
        differences.append(f"expert parallel: preset {dsc.autoep_size(config.deepspeed)}, plan {inputs.expert_parallel}")
        overrides.append(dsc.set_override("expert_parallel", plan.deepspeed.get("expert_parallel")))
    ds_changes = (_zero_changes(config, plan)
                  + dsc.bucket_floor_overrides(config.deepspeed, inputs.model.config.hidden_size)
                  + dsc.precision_overrides(config.deepspeed, inputs.precision)
                  + dsc.activation_checkpointing_overrides(config.deepspeed, c.checkpointing, c.checkpoint_offload))
    if ds_changes:
        differences.append(f"DeepSpeed: preset {_describe(config.deepspeed)}, plan {c.candidate.label}"
                           + (f" + hpZ {c.hpz_partition_size}" if c.hpz_partition_size > 1 else ""))
    if inputs.task == "pretrain" and config.model.name_or_path:
        differences.append(f"the preset fine-tunes {config.model.name_or_path}; for pretraining from scratch "
                           f"copy it and set model.name_or_path: null with a tokenizer")
    if inputs.task != "pretrain" and config.model.name_or_path is None:
        differences.append("the preset trains from scratch; set model.name_or_path to the weights to fine-tune")
    return differences, overrides + ds_changes


def accumulation_keeping(plan: Plan, config: Config, preset: str) -> tuple[int, Optional[str]]:
    """Without --global-batch the plan has no global batch of its own, so the launch line keeps the preset's
    (its micro x accumulation x data-parallel ranks) at the plan's micro-batch where that divides it, and says so
    either way: a launch line that silently trained 32 sequences a step instead of the preset's 256 would change
    the optimisation, not only the memory."""
    train, hw = config.train, config.hardware
    micro, world = plan.choice.micro_batch, plan.inputs.data_parallel_size
    ranks = (hw.nodes * hw.gpus_per_node // max(dsc.autotp_size(config.deepspeed), 1)
             // dsc.sequence_parallel_size(config.deepspeed))
    kept = train.global_batch_size
    if not isinstance(kept, int) and isinstance(train.micro_batch_size, int) and isinstance(train.grad_accum, int):
        kept = train.micro_batch_size * train.grad_accum * ranks
    if not isinstance(kept, int):
        return plan.grad_accum, None
    if kept % (micro * world) == 0:
        accum = kept // (micro * world)
        return accum, (f"global batch: the launch line keeps {preset}'s {kept} sequences per step ({micro} x {accum} "
                       f"x {world} ranks); --global-batch N plans for another")
    planned = micro * plan.grad_accum * world
    return plan.grad_accum, (f"global batch: the launch line trains {planned} sequences per step, {preset} {kept} "
                             f"({kept} is not a multiple of micro-batch {micro} x {world} ranks); --global-batch N "
                             f"chooses it")


def _zero_changes(config: Config, plan: Plan) -> list[str]:
    """The preset's ZeRO settings moved to the plan's; on one GPU stages 0-2 hold the same memory, so a
    preset's stage 2 there is left alone rather than churned to the tree's stage 0."""
    c, ds = plan.choice.candidate, config.deepspeed
    same_offload = (dsc.offload_optimizer_device(ds), dsc.offload_param_device(ds)) == (c.offload_optimizer,
                                                                                        c.offload_param)
    if plan.inputs.world_size == 1 and dsc.zero_stage(ds) <= 2 and c.stage <= 2 and same_offload:
        if dsc.zero_stage(ds) != c.stage:
            plan.notes.append(f"one GPU: the preset's ZeRO-{dsc.zero_stage(ds)} holds the same memory as the "
                              f"tree's ZeRO-{c.stage} (nothing to shard), so the launch line keeps it")
        return []
    return dsc.zero_overrides(ds, plan.deepspeed)


def _yaml_value(value: Any) -> str:
    """A `--set` value that YAML reads back as `value` (plain strings stay unquoted)."""
    if isinstance(value, str) and parse_yaml(value) == value:
        return value
    return json.dumps(value)


def _describe(ds: dict) -> str:
    c = Candidate("", dsc.zero_stage(ds), dsc.offload_optimizer_device(ds), dsc.offload_param_device(ds))
    hpz = dsc.hpz_partition_size(ds)
    return c.label + (f" + hpZ {hpz}" if hpz > 1 else "")


def launch_line(plan: Plan, overrides: list[str], output: Optional[str]) -> str:
    """The exact command: deepspeed's launcher (hostfile for several nodes), train.py with the preset, or,
    when no shipped preset has this model, any DeepSpeed script with the exported config."""
    from ..launch.command import train_command
    inputs, c = plan.inputs, plan.choice.candidate
    cpu_offload = "cpu" in (c.offload_optimizer, c.offload_param)  # seed step 6 #7: --bind_cores_to_rank
    line = train_command(plan.preset or "PRESET", overrides, inputs.nodes, inputs.gpus_per_node, cpu_offload)
    if plan.preset:
        return line
    runner = line[:line.index(" train.py ")]
    return " ".join([runner, "your_train.py", "--deepspeed", "--deepspeed_config", shlex.quote(output or "ds_config.json")])
