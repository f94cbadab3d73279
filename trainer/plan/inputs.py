"""The planner's inputs (the seed's step 1.1): flags or a scenario file, checked with every problem at once."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from ..config import LoraConfig
from ..errors import UserError, closest
from ..hardware import GPUS, Gpu, gpu_named
from ..presets import config_from_dict, parse_yaml
from . import memory as mem
from .models import ModelSpec, model_from_spec, positive_int


TASKS = ("pretrain", "full", "lora")


@dataclass(frozen=True)
class PlanInputs:
    model: ModelSpec
    gpu: Gpu
    gpus_per_node: int = 1
    nodes: int = 1
    cpu_ram_gb: Optional[float] = None
    nvme_gb: Optional[float] = None
    task: str = "full"
    seq_len: int = 2048
    micro_batch: Optional[int] = None
    global_batch: Optional[int] = None
    allow_checkpointing: bool = True
    lora: LoraConfig = field(default_factory=LoraConfig)
    nvme_path: str = "/local_nvme"

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def precision(self) -> str:
        return "bf16" if self.gpu.bf16 else "fp16"  # V100: fp16 with loss scaling (seed step 3.2)

    @property
    def params(self) -> int:
        return self.model.params_override or mem.count_params(self.model.config)

    @property
    def largest_layer(self) -> int:
        return mem.largest_layer_params(self.model.config)

    @property
    def lora_params(self) -> int:
        return mem.lora_params(self.model.config, self.lora) if self.task == "lora" else 0


SCENARIO_KEYS = {"description", "model", "hidden_size", "num_layers", "gpu", "gpus_per_node", "nodes", "cpu_ram_gb",
                 "nvme_gb", "nvme_path", "task", "seq_len", "micro_batch", "global_batch",
                 "activation_checkpointing", "lora", "expect", "seed"}


EXPECT_KEYS = {"candidate", "stage", "offload_optimizer", "offload_param", "micro_batch", "activation_checkpointing",
               "preset", "fits", "suggestions_mention", "hpz_partition_size"}


def read_scenario(path: str) -> dict:
    """A scenario file: the seed's step-1.1 inputs plus `expect` (the recommendation) and `seed` (its numbers)."""
    file = Path(path)
    if not file.is_file():
        raise UserError(f"scenario file {path!r} not found; the shipped ones are in scenarios/ "
                        f"(e.g. `python -m trainer plan scenarios/7b_8xa100.yaml`)")
    raw = parse_yaml(file.read_text(), str(file)) or {}
    if not isinstance(raw, dict):
        raise UserError(f"{file}: a scenario is a mapping of inputs (model, gpu, gpus_per_node, ...)")
    problems = [f"unknown key '{k}'{closest(str(k), SCENARIO_KEYS)}" for k in raw if k not in SCENARIO_KEYS]
    expect = raw.get("expect") or {}
    if not isinstance(expect, dict):
        problems.append("expect: must be a mapping (candidate, stage, micro_batch, preset, ...)")
    else:
        problems += [f"unknown key 'expect.{k}'{closest(str(k), EXPECT_KEYS)}" for k in expect if k not in EXPECT_KEYS]
    if problems:
        raise UserError(f"{file}: " + "; ".join(problems) + f". Valid keys: {', '.join(sorted(SCENARIO_KEYS))}")
    return raw


FLAG_TO_KEY = {"model": "model", "hidden_size": "hidden_size", "num_layers": "num_layers", "gpu": "gpu",
               "gpus_per_node": "gpus_per_node", "nodes": "nodes", "cpu_ram_gb": "cpu_ram_gb", "nvme_gb": "nvme_gb",
               "nvme_path": "nvme_path", "task": "task", "seq_len": "seq_len", "micro_batch": "micro_batch",
               "global_batch": "global_batch"}


def inputs_from_args(args) -> PlanInputs:
    """Scenario file values, overridden by any flag given on the command line."""
    values: dict[str, Any] = read_scenario(args.scenario) if args.scenario else {}
    source = args.scenario or "flags"
    for flag, key in FLAG_TO_KEY.items():
        if getattr(args, flag, None) is not None:
            values[key] = getattr(args, flag)
    if args.no_activation_checkpointing:
        values["activation_checkpointing"] = False
    return build_inputs(values, source)


def build_inputs(values: dict, source: str = "flags") -> PlanInputs:
    """Validated PlanInputs from a dict of scenario keys; every problem names the flag or key and a fix."""
    def flag(key: str) -> str:
        return f"--{key.replace('_', '-')}" if source == "flags" else f"{source}: {key}"

    if values.get("gpu") is None:
        raise UserError(f"{flag('gpu')} is required: one of {', '.join(g for g in GPUS if g != 'cpu')}")
    gpu = gpu_named(str(values["gpu"]), flag("gpu"))
    task = str(values.get("task", "full"))
    if task not in TASKS:
        raise UserError(f"{flag('task')}: {task!r} is not one of {', '.join(TASKS)}{closest(task, TASKS)}")
    ints = {key: positive_int(values.get(key, default), flag(key), optional=default is None)
            for key, default in (("gpus_per_node", 1), ("nodes", 1), ("seq_len", 2048), ("micro_batch", None),
                                 ("global_batch", None))}
    sizes = {key: _size_gb(values.get(key), flag(key), allow_zero=key == "nvme_gb") for key in ("cpu_ram_gb", "nvme_gb")}
    model = model_from_spec(values.get("model"), values.get("hidden_size"), values.get("num_layers"), flag)
    lora = _lora_config(values.get("lora"), flag("lora"))
    if ints["seq_len"] > model.config.max_position_embeddings:
        raise UserError(f"{flag('seq_len')} {ints['seq_len']} is beyond {model.label}'s "
                        f"{model.config.max_position_embeddings} positions (max_position_embeddings): use a "
                        f"shorter sequence, or a model (inline architecture or config.json) with longer positions")
    inputs = PlanInputs(model=model, gpu=gpu, gpus_per_node=ints["gpus_per_node"], nodes=ints["nodes"],
                        cpu_ram_gb=sizes["cpu_ram_gb"], nvme_gb=sizes["nvme_gb"], task=task,
                        seq_len=ints["seq_len"], micro_batch=ints["micro_batch"], global_batch=ints["global_batch"],
                        allow_checkpointing=bool(values.get("activation_checkpointing", True)), lora=lora,
                        nvme_path=str(values.get("nvme_path") or "/local_nvme"))
    check_batch_inputs(inputs, flag)
    return inputs


def check_batch_inputs(inputs: PlanInputs, flag) -> None:
    world, micro, total = inputs.world_size, inputs.micro_batch, inputs.global_batch
    if total is not None and total % world:
        raise UserError(f"{flag('global_batch')} {total} is not a multiple of the {world} data-parallel ranks "
                        f"({inputs.nodes} node(s) x {inputs.gpus_per_node} GPUs): use e.g. {world * max(1, total // world)}")
    if total is not None and micro is not None and (total // world) % micro:
        raise UserError(f"{flag('micro_batch')} {micro} does not divide the {total // world} sequences each rank gets "
                        f"per step ({flag('global_batch')} {total} / {world} ranks): pick a divisor, or drop one of them")


def _size_gb(value: Any, where: str, allow_zero: bool) -> Optional[float]:
    """A size in GB: positive (NVMe may be 0 = none); absent = unknown."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (value == 0 and not allow_zero):
        raise UserError(f"{where}: {value!r} must be a size in GB " + (">= 0 (0 = none)" if allow_zero else "> 0")
                        + "; leave it out when unknown")
    return float(value)


def _lora_config(value: Any, where: str) -> LoraConfig:
    if value is None:
        return LoraConfig()
    if not isinstance(value, dict):
        raise UserError(f"{where}: expected a mapping of model.lora settings (r, alpha, target_modules)")
    return config_from_dict({"model": {"lora": value}}, source=where).model.lora
