"""`python -m trainer plan`: which ZeRO stage, which offload, which micro-batch, will it fit, how to launch.

Inputs are the seed's step 1.1 (model, GPU type and count, nodes, host RAM, NVMe, training type,
sequence length, batch) as flags or a scenario file (scenarios/*.yaml). The planner prices every
candidate (stage 0, 1, 2, 2 + CPU optimizer offload, 3, 3 + CPU optimizer offload, 3 + CPU optimizer
and param offload, 3 + NVMe) with `trainer.memory`, then walks the seed's decision tree:

1. the lowest stage that fits, offloading only when nothing without offload fits; stage 1 is never
   chosen (stage 2 costs the same communication and needs less memory);
2. activation checkpointing only when activations are what does not fit;
3. on several nodes at stage 3, ZeRO++ hpZ when its node-local parameter copy still fits;
4. the largest micro-batch that fits (and divides the target global batch), then gradient
   accumulation to reach the global batch.

It prints the table, the walk, the DeepSpeed config (`-o` writes it), the nearest shipped preset and
the launch line. `--json` prints one JSON object on stdout and nothing else.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from . import ds_config as dsc
from . import memory as mem
from .config import Config, DataConfig, HardwareConfig, LoraConfig, ModelConfig, TrainConfig
from .errors import UserError, closest
from .hardware import GPUS, Gpu
from .presets import PRESET_DIR, config_from_dict, list_presets, load_preset, parse_yaml

GPU_HEADROOM = 0.10     # of device memory kept free: CUDA context, NCCL buffers, allocator fragmentation
HOST_HEADROOM = 0.10    # of host RAM and NVMe kept free: OS, dataloader workers, page cache
MAX_MICRO_BATCH = 64
TASKS = ("pretrain", "full", "lora")
DEFAULT_LR = {"pretrain": 3e-4, "full": 2e-5, "lora": 2e-4}

# Named sizes: public Llama architectures (config.json of the meta-llama / huggyllama repos).
NAMED_MODELS: dict[str, tuple[str, ModelConfig]] = {
    "1b": ("Llama-3.2-1B", ModelConfig(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                                        intermediate_size=8192, vocab_size=128256, max_position_embeddings=131072,
                                        tie_word_embeddings=True, rope_theta=500000.0)),
    "7b": ("Llama-2-7B", ModelConfig(name_or_path="meta-llama/Llama-2-7b-hf", hidden_size=4096, num_layers=32,
                                     num_heads=32, num_kv_heads=32, intermediate_size=11008, vocab_size=32000,
                                     max_position_embeddings=4096)),
    "8b": ("Llama-3.1-8B", ModelConfig(name_or_path="meta-llama/Llama-3.1-8B", hidden_size=4096, num_layers=32,
                                       num_heads=32, num_kv_heads=8, intermediate_size=14336, vocab_size=128256,
                                       max_position_embeddings=131072, rope_theta=500000.0)),
    "13b": ("Llama-2-13B", ModelConfig(name_or_path="meta-llama/Llama-2-13b-hf", hidden_size=5120, num_layers=40,
                                       num_heads=40, num_kv_heads=40, intermediate_size=13824, vocab_size=32000,
                                       max_position_embeddings=4096)),
    "30b": ("LLaMA-30B (32.5B params)", ModelConfig(name_or_path="huggyllama/llama-30b", hidden_size=6656,
                                                    num_layers=60, num_heads=52, num_kv_heads=52,
                                                    intermediate_size=17920, vocab_size=32000,
                                                    max_position_embeddings=2048)),
    "70b": ("Llama-2-70B", ModelConfig(name_or_path="meta-llama/Llama-2-70b-hf", hidden_size=8192, num_layers=80,
                                       num_heads=64, num_kv_heads=8, intermediate_size=28672, vocab_size=32000,
                                       max_position_embeddings=4096)),
}


# --- inputs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    config: ModelConfig
    label: str
    params_override: Optional[int] = None   # a raw parameter count the user gave (exact), else counted


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
    gpu = gpu_from_name(str(values["gpu"]), flag("gpu"))
    task = str(values.get("task", "full"))
    if task not in TASKS:
        raise UserError(f"{flag('task')}: {task!r} is not one of {', '.join(TASKS)}{closest(task, TASKS)}")
    ints = {key: _positive_int(values.get(key, default), flag(key), optional=default is None)
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


def gpu_from_name(name: str, where: str) -> Gpu:
    if name.lower() == "cpu":
        raise UserError(f"{where}: 'cpu' ranks have no GPU memory to plan; give a GPU type "
                        f"({', '.join(g for g in GPUS if g != 'cpu')})")
    if name.lower() not in GPUS:
        raise UserError(f"{where}: unknown GPU type {name!r}{_gpu_hint(name.lower())}; known: "
                        f"{', '.join(g for g in GPUS if g != 'cpu')} (add a row to trainer/hardware.py for another)")
    return GPUS[name.lower()]


def _gpu_hint(name: str) -> str:
    """' (did you mean ...)': GPU rows that start with what was typed (h100 -> h100-80g), else the closest."""
    prefixed = [g for g in GPUS if g.startswith(name) and g != "cpu"]
    if prefixed:
        return f" (did you mean {' or '.join(repr(g) for g in prefixed)}?)"
    return closest(name, [g for g in GPUS if g != "cpu"])


def _positive_int(value: Any, where: str, optional: bool) -> Optional[int]:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
        raise UserError(f"{where}: {value!r} must be a positive whole number")
    return int(value)


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


# --- models ------------------------------------------------------------------------------------


def model_from_spec(spec: Any, hidden_size: Any, num_layers: Any, flag) -> ModelSpec:
    """A named size, a preset, a config.json, an inline architecture mapping, or a raw parameter count."""
    where = flag("model")
    if spec is None:
        raise UserError(f"{where} is required: a named size ({', '.join(NAMED_MODELS)}), a preset name, a path to "
                        f"an HF config.json, or a parameter count with --hidden-size and --num-layers")
    if isinstance(spec, dict):
        return ModelSpec(_checked_model(config_from_dict({"model": spec}, source=where).model, where), "inline model")
    text = str(spec).strip()
    if text.lower() in NAMED_MODELS:
        label, config = NAMED_MODELS[text.lower()]
        return ModelSpec(config, label)
    path = Path(text)
    if path.suffix == ".json" or (path.is_dir() and (path / "config.json").exists()):
        return ModelSpec(model_from_hf_config(path if path.suffix == ".json" else path / "config.json", where),
                         str(path))
    if (PRESET_DIR / f"{text}.yaml").exists() or (path.suffix in (".yaml", ".yml") and path.exists()):
        preset = load_preset(text)
        return ModelSpec(_checked_model(preset.model, where), f"preset {preset.name}")
    count = _parse_count(text)
    if count is not None:
        return raw_count_model(count, hidden_size, num_layers, flag)
    presets = [name for name, _ in list_presets()]
    raise UserError(f"{where}: {text!r} is not a named size ({', '.join(NAMED_MODELS)}), a preset"
                    f"{closest(text, list(NAMED_MODELS) + presets)}, an existing config.json, or a parameter count")


def _parse_count(text: str) -> Optional[float]:
    """'6738415616', '6.7e9' or '-5' as a number; None for anything else."""
    try:
        return float(text.replace("_", "").replace(",", ""))
    except ValueError:
        return None


def _checked_model(m: ModelConfig, where: str) -> ModelConfig:
    if min(m.hidden_size, m.num_layers, m.num_heads, m.intermediate_size, m.vocab_size) <= 0:
        raise UserError(f"{where}: hidden_size, num_layers, num_heads, intermediate_size and vocab_size must be > 0")
    if m.hidden_size % m.num_heads or (m.num_kv_heads and m.num_heads % m.num_kv_heads):
        raise UserError(f"{where}: hidden_size must divide by num_heads and num_heads by num_kv_heads")
    return m


HF_FIELDS = {"hidden_size": "hidden_size", "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
             "num_key_value_heads": "num_kv_heads", "intermediate_size": "intermediate_size",
             "vocab_size": "vocab_size", "max_position_embeddings": "max_position_embeddings",
             "tie_word_embeddings": "tie_word_embeddings", "model_type": "family"}
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2")


def model_from_hf_config(path: Path, where: str) -> ModelConfig:
    """A transformers config.json of a Llama-style decoder (llama, mistral, qwen2)."""
    if not path.is_file():
        raise UserError(f"{where}: {path} does not exist")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise UserError(f"{where}: {path} is not valid JSON: {err}") from None
    family = raw.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise UserError(f"{where}: {path} has model_type {family!r}; the planner counts Llama-style decoders "
                        f"({', '.join(SUPPORTED_FAMILIES)}); give a parameter count with --hidden-size and --num-layers")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "vocab_size") if k not in raw]
    if missing:
        raise UserError(f"{where}: {path} lacks {', '.join(missing)}")
    fields = {ours: raw[theirs] for theirs, ours in HF_FIELDS.items() if raw.get(theirs) is not None}
    return _checked_model(ModelConfig(**fields), where)


def raw_count_model(count: float, hidden_size: Any, num_layers: Any, flag) -> ModelSpec:
    """A parameter count with hidden size and layers: a Llama-shaped stand-in (heads of 128, vocab 32000,
    MLP width solved so the count matches) for activations and the largest layer; params stay exact."""
    if count < 1 or count != int(count):
        raise UserError(f"{flag('model')}: parameter count {count!r} must be a positive whole number")
    hidden = _positive_int(hidden_size, flag("hidden_size") + " (needed with a raw parameter count)", False)
    layers = _positive_int(num_layers, flag("num_layers") + " (needed with a raw parameter count)", False)
    vocab, params = 32000, int(count)
    per_layer = (params - 2 * vocab * hidden - hidden) / layers
    intermediate = int(round((per_layer - 4 * hidden * hidden - 2 * hidden) / (3 * hidden) / 256)) * 256
    if intermediate <= 0:
        raise UserError(f"{flag('model')}: {params} parameters cannot fill {layers} layers of width {hidden} "
                        f"(embeddings alone are {2 * vocab * hidden}); check the count, --hidden-size and --num-layers")
    heads = max(1, hidden // 128)
    config = ModelConfig(hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=heads,
                         intermediate_size=intermediate, vocab_size=vocab, max_position_embeddings=1 << 20)
    return ModelSpec(_checked_model(config, flag("model")), f"{params / 1e9:.2f}B-parameter model", params)


# --- candidates and estimates ------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    name: str
    stage: int
    offload_optimizer: str = "none"
    offload_param: str = "none"

    @property
    def label(self) -> str:
        offload = [f"{what} {device}" for what, device in (("optimizer", self.offload_optimizer),
                                                            ("params", self.offload_param)) if device != "none"]
        return f"ZeRO-{self.stage}" + (f" + {' and '.join(offload)} offload" if offload else "")


CANDIDATES = (
    Candidate("zero0", 0), Candidate("zero1", 1), Candidate("zero2", 2),
    Candidate("zero2_cpu_offload", 2, "cpu"), Candidate("zero3", 3),
    Candidate("zero3_cpu_optimizer", 3, "cpu"), Candidate("zero3_cpu_offload", 3, "cpu", "cpu"),
    Candidate("zero3_nvme", 3, "nvme", "nvme"),
)
# The seed's tree without stage 1: stage 2 has the same communication volume and strictly less memory.
WALK = tuple(c for c in CANDIDATES if c.name != "zero1")


@dataclass(frozen=True)
class Estimate:
    candidate: Candidate
    micro_batch: int
    checkpointing: bool
    hpz_partition_size: int
    states: mem.ModelStates
    activations: mem.Activations
    buffers: int
    cpu_bytes_per_node: int
    nvme_bytes: int
    gpu_budget: int
    cpu_budget: Optional[int]
    nvme_budget: Optional[int]

    @property
    def gpu_total(self) -> int:
        s = self.states
        return s.params + s.gradients + s.optimizer + self.activations.total + self.buffers

    @property
    def fits_gpu(self) -> bool:
        return self.gpu_total <= self.gpu_budget

    @property
    def fits_cpu(self) -> bool:
        return self.cpu_budget is None or self.cpu_bytes_per_node <= self.cpu_budget

    @property
    def fits_nvme(self) -> bool:
        if self.nvme_bytes == 0:
            return True
        return bool(self.nvme_budget) and self.nvme_bytes <= self.nvme_budget

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_cpu and self.fits_nvme

    def gpu_bytes(self) -> dict[str, int]:
        s = self.states
        return {"params": s.params, "gradients": s.gradients, "optimizer": s.optimizer,
                "activations": self.activations.total, "buffers": self.buffers, "total": self.gpu_total}

    def why_not(self) -> str:
        reasons = []
        if not self.fits_gpu:
            reasons.append(f"{gb(self.gpu_total)} GB per GPU > {gb(self.gpu_budget)} GB")
        if not self.fits_cpu:
            reasons.append(f"{gb(self.cpu_bytes_per_node)} GB host RAM per node > {gb(self.cpu_budget)} GB")
        if not self.fits_nvme:
            have = f"{gb(self.nvme_budget)} GB" if self.nvme_budget else "no NVMe"
            reasons.append(f"{gb(self.nvme_bytes)} GB NVMe per node > {have}")
        return "; ".join(reasons) or "fits"


def gb(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / mem.GB:.1f}"


def budgets(inputs: PlanInputs) -> tuple[int, Optional[int], Optional[int]]:
    gpu = int(inputs.gpu.memory_bytes * (1 - GPU_HEADROOM))
    cpu = None if inputs.cpu_ram_gb is None else int(inputs.cpu_ram_gb * mem.GB * (1 - HOST_HEADROOM))
    nvme = None if not inputs.nvme_gb else int(inputs.nvme_gb * mem.GB * (1 - HOST_HEADROOM))
    return gpu, cpu, nvme


def estimate(inputs: PlanInputs, candidate: Candidate, micro_batch: int, checkpointing: bool,
             hpz_partition_size: int = 1, reduce_bucket_size: Optional[int] = None, precision: Optional[str] = None,
             attention: Optional[str] = None, overlap_comm: bool = True) -> Estimate:
    """Per-GPU, per-node host and NVMe bytes of one candidate at one micro-batch."""
    precision = precision or inputs.precision
    m, stage = inputs.model.config, candidate.stage
    on_nvme = candidate.stage == 3 and "nvme" in (candidate.offload_optimizer, candidate.offload_param)
    states = _model_states(inputs, candidate, precision)
    attention = attention or ("eager" if m.attn_implementation == "eager" else "sdpa")
    activations = mem.activation_bytes(m, inputs.seq_len, micro_batch, checkpointing, precision, attention)
    bucket = reduce_bucket_size if reduce_bucket_size is not None else m.hidden_size * m.hidden_size
    buffers = (states.working + mem.reduce_bucket_bytes(stage, bucket, precision, overlap_comm)
               + mem.hpz_secondary_bytes(inputs.params, hpz_partition_size if stage == 3 else 1, precision))
    cpu, nvme = states.cpu_bytes, 0
    if on_nvme:
        trained = inputs.lora_params or inputs.params
        offload_opt, offload_par = (candidate.offload_optimizer == "nvme"), (candidate.offload_param == "nvme")
        nvme = mem.nvme_offload_bytes(trained, inputs.nodes, offload_opt, offload_par)
        cpu = mem.nvme_host_buffer_bytes(trained, inputs.world_size, inputs.gpus_per_node)
        if inputs.lora_params:  # the frozen base is swapped like any 16-bit param
            nvme += mem.nvme_offload_bytes(inputs.params, inputs.nodes, optimizer=False, params=True)
    gpu_budget, cpu_budget, nvme_budget = budgets(inputs)
    return Estimate(candidate, micro_batch, checkpointing, hpz_partition_size if stage == 3 else 1, states,
                    activations, buffers, int(cpu), int(nvme), gpu_budget, cpu_budget, nvme_budget)


def _model_states(inputs: PlanInputs, candidate: Candidate, precision: str) -> mem.ModelStates:
    stage = candidate.stage
    offload_optimizer = candidate.offload_optimizer != "none"
    offload_param = candidate.offload_param != "none" and stage == 3  # DeepSpeed ignores it below stage 3
    if inputs.task == "lora":
        return mem.lora_model_states(inputs.params, inputs.lora_params, inputs.largest_layer, stage,
                                     inputs.gpus_per_node, inputs.nodes, offload_optimizer, offload_param, precision)
    # zero.Init: the trainer builds/loads the model sharded at stage 3, as DeepSpeed's zero_init=True case.
    return mem.model_states(inputs.params, inputs.largest_layer, stage, inputs.gpus_per_node, inputs.nodes,
                            offload_optimizer, offload_param, zero_init=True, precision=precision)


def best_shot(inputs: PlanInputs, candidate: Candidate, micro_batch: int) -> Estimate:
    """A candidate at a micro-batch: without checkpointing if that fits, else with it (when allowed and
    when GPU memory is what does not fit: checkpointing frees no host RAM or NVMe)."""
    plain = estimate(inputs, candidate, micro_batch, checkpointing=False)
    if plain.fits or plain.fits_gpu or not inputs.allow_checkpointing:
        return plain
    return estimate(inputs, candidate, micro_batch, checkpointing=True)


def micro_batch_options(inputs: PlanInputs) -> list[int]:
    """Micro-batches worth trying: divisors of the per-rank share of the global batch, else powers of two."""
    if inputs.global_batch:
        per_rank = inputs.global_batch // inputs.world_size
        return [d for d in range(1, min(per_rank, MAX_MICRO_BATCH) + 1) if per_rank % d == 0]
    return [2 ** i for i in range(int(math.log2(MAX_MICRO_BATCH)) + 1)]


# --- the decision --------------------------------------------------------------------------------


@dataclass
class Plan:
    inputs: PlanInputs
    rows: list[Estimate]
    walk: list[str]
    choice: Optional[Estimate] = None
    grad_accum: int = 1
    notes: list[str] = field(default_factory=list)
    suggestions: list[str] = field(default_factory=list)
    preset: Optional[str] = None
    preset_differences: list[str] = field(default_factory=list)
    deepspeed: Optional[dict] = None
    launch: Optional[str] = None

    @property
    def global_batch(self) -> Optional[int]:
        if not self.choice:
            return None
        return self.choice.micro_batch * self.grad_accum * self.inputs.world_size


def make_plan(inputs: PlanInputs, output: Optional[str] = None) -> Plan:
    required = inputs.micro_batch or 1
    rows = [best_shot(inputs, c, required) for c in CANDIDATES]
    plan = Plan(inputs, rows, [])
    chosen = walk_tree(plan, required)
    if chosen is None and inputs.micro_batch:
        plan.notes.append(f"micro-batch {inputs.micro_batch} fits nowhere; planning the largest micro-batch that fits")
        chosen = walk_tree(plan, 1, user_micro=False)
    if chosen is None:
        plan.suggestions = what_would_fit(inputs)
        return plan
    chosen = add_zeropp(plan, chosen)
    plan.choice = largest_micro_batch(plan, chosen)
    plan.grad_accum = (inputs.global_batch // (plan.choice.micro_batch * inputs.world_size)
                       if inputs.global_batch else 1)
    plan.deepspeed = planned_deepspeed_config(plan)
    plan.preset, plan.preset_differences, overrides = nearest_preset(plan)
    plan.launch = launch_line(plan, overrides, output)
    return plan


def walk_tree(plan: Plan, micro_batch: int, user_micro: bool = True) -> Optional[Estimate]:
    """Seed step 1.2: lowest stage first, offload last; checkpointing before a stage up (step 7.1's order)."""
    inputs = plan.inputs
    for candidate in WALK:
        shot = best_shot(inputs, candidate, micro_batch)
        if shot.fits:
            how = "with activation checkpointing" if shot.checkpointing else "without activation checkpointing"
            plan.walk.append(f"{candidate.name}: fits at micro-batch {micro_batch} {how} "
                             f"({gb(shot.gpu_total)} of {gb(shot.gpu_budget)} GB per GPU) -> chosen")
            return shot
        tried = " even with activation checkpointing" if shot.checkpointing else ""
        plan.walk.append(f"{candidate.name}: does not fit at micro-batch {micro_batch}{tried}: {shot.why_not()}")
    return None


def add_zeropp(plan: Plan, chosen: Estimate) -> Estimate:
    """Seed step 6 #9: across nodes at stage 3, hpZ keeps parameter all-gathers inside the node, for 2P/g more per GPU."""
    inputs, c = plan.inputs, chosen.candidate
    if inputs.nodes == 1 or c.stage != 3:
        return chosen
    if c.offload_optimizer != "none":
        plan.notes.append("ZeRO++ hpZ not added: with offload the CPU/NVMe optimizer step, not the network, sets the pace")
        return chosen
    with_hpz = estimate(inputs, c, chosen.micro_batch, chosen.checkpointing, hpz_partition_size=inputs.gpus_per_node)
    if with_hpz.fits:
        plan.notes.append(f"ZeRO++: hpZ {inputs.gpus_per_node} (node-local secondary partition, "
                          f"+{gb(with_hpz.buffers - chosen.buffers)} GB per GPU) with quantized weights and gradients")
        return with_hpz
    plan.notes.append(f"ZeRO++ hpZ would not fit (+{gb(with_hpz.buffers - chosen.buffers)} GB per GPU); "
                      f"quantized gradients alone cost no memory")
    return chosen


def largest_micro_batch(plan: Plan, chosen: Estimate) -> Estimate:
    """Seed step 6 #3: the largest micro-batch that fits (and divides the per-rank share of the global batch)."""
    inputs = plan.inputs
    if inputs.micro_batch and chosen.micro_batch == inputs.micro_batch:
        return chosen
    best = chosen
    for micro in micro_batch_options(inputs):
        shot = estimate(inputs, chosen.candidate, micro, chosen.checkpointing, chosen.hpz_partition_size)
        if shot.fits and micro > best.micro_batch:
            best = shot
    bigger = [m for m in micro_batch_options(inputs) if m > best.micro_batch]
    if bigger:
        shot = estimate(inputs, chosen.candidate, bigger[0], chosen.checkpointing, chosen.hpz_partition_size)
        plan.walk.append(f"micro-batch {best.micro_batch} is the largest that fits; {bigger[0]} would need "
                         f"{gb(shot.gpu_total)} GB per GPU")
    else:
        plan.walk.append(f"micro-batch {best.micro_batch}: the largest option"
                         + (f" (the {inputs.global_batch // inputs.world_size} sequences per rank)"
                            if inputs.global_batch else f" (cap {MAX_MICRO_BATCH})"))
    return best


def what_would_fit(inputs: PlanInputs) -> list[str]:
    """For a plan that fits nowhere: more GPUs, host RAM, NVMe, or LoRA, each checked by planning again."""
    out = []
    gpus = _gpus_that_fit(inputs)
    if gpus:
        out.append(f"more GPUs: {gpus[0]} node(s) x {inputs.gpus_per_node} {inputs.gpu.name} "
                   f"({gpus[0] * inputs.gpus_per_node} GPUs) fit with {gpus[1]}")
    for candidate in (c for c in WALK if c.offload_optimizer == "cpu"):
        shot = best_shot(dataclasses.replace(inputs, cpu_ram_gb=None), candidate, 1)
        if shot.fits:
            need = math.ceil(shot.cpu_bytes_per_node / (1 - HOST_HEADROOM) / mem.GB)
            out.append(f"more host RAM: {candidate.name} fits the GPUs with {need} GB of RAM per node")
            break
    nvme = best_shot(dataclasses.replace(inputs, nvme_gb=1e9), CANDIDATES[-1], 1)
    if nvme.fits_gpu and nvme.fits_cpu:
        need = math.ceil(nvme.nvme_bytes / (1 - HOST_HEADROOM) / mem.GB)
        out.append(f"NVMe: zero3_nvme (ZeRO-Infinity) fits with {need} GB of NVMe per node (--nvme-gb {need})")
    if inputs.task != "lora":
        lora = dataclasses.replace(inputs, task="lora")
        fitting = next((c for c in WALK if best_shot(lora, c, 1).fits), None)
        out.append(f"LoRA: fits with {fitting.name} (--task lora)" if fitting else "LoRA: does not fit either")
    if not out:
        out.append("nothing tried fits: a shorter --seq-len, a smaller model, or GPUs with more memory")
    return out


def _gpus_that_fit(inputs: PlanInputs) -> Optional[tuple[int, str]]:
    for nodes in (2 ** i for i in range(0, 11)):
        if nodes <= inputs.nodes:
            continue
        bigger = dataclasses.replace(inputs, nodes=nodes, global_batch=None, micro_batch=None)
        for candidate in WALK:
            if best_shot(bigger, candidate, 1).fits:
                return nodes, candidate.name
    return None


# --- the DeepSpeed config, the nearest preset, the launch line -----------------------------------


def planned_deepspeed_config(plan: Plan) -> dict:
    """The chosen candidate as a complete DeepSpeed config (no "auto" left), built by ds_config."""
    c, inputs = plan.choice, plan.inputs
    ds = dsc.base_config(c.candidate.stage, c.candidate.offload_optimizer, c.candidate.offload_param,
                         inputs.nvme_path, inputs.precision, c.checkpointing)
    if c.hpz_partition_size > 1:
        ds = dsc.with_zeropp(ds, c.hpz_partition_size)
    config = planned_trainer_config(plan, ds)
    problems: list[str] = []
    batch = dsc.Batch(c.micro_batch, plan.grad_accum, plan.global_batch, inputs.world_size, inputs.world_size)
    filled = dsc.fill_auto(config, batch, problems)
    if problems:  # a planner bug, not a user error
        raise RuntimeError(f"planned DeepSpeed config does not fill: {problems}")
    return filled


def planned_trainer_config(plan: Plan, ds: dict) -> Config:
    c, inputs = plan.choice, plan.inputs
    model = dataclasses.replace(inputs.model.config, gradient_checkpointing=c.checkpointing,
                                lora=dataclasses.replace(inputs.lora, enabled=inputs.task == "lora"))
    train = TrainConfig(micro_batch_size=c.micro_batch, grad_accum=plan.grad_accum,
                        global_batch_size=plan.global_batch, precision=inputs.precision, lr=DEFAULT_LR[inputs.task])
    hardware = HardwareConfig(gpu=inputs.gpu.name, gpus_per_node=inputs.gpus_per_node, nodes=inputs.nodes,
                              cpu_ram_gb=inputs.cpu_ram_gb, nvme_gb=inputs.nvme_gb)
    return Config(name="plan", hardware=hardware, model=model,
                  data=DataConfig(task="pretrain" if inputs.task == "pretrain" else "sft", seq_len=inputs.seq_len),
                  train=train, deepspeed=ds)


ARCHITECTURE_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size",
                       "max_position_embeddings", "tie_word_embeddings")
PARAMS_MATCH = 0.05  # a preset is "the same model" within 5% of the parameters


def nearest_preset(plan: Plan) -> tuple[Optional[str], list[str], list[str]]:
    """(name, differences, --set overrides) of the closest shipped preset for the same model, or (None, [], [])."""
    inputs, scored = plan.inputs, []
    for name, _ in list_presets():
        config = load_preset(name)
        if config.hardware.gpu == "cpu" or not _same_model(inputs, config):
            continue
        scored.append((-_similarity(plan, config), name, config))
    if not scored:
        return None, [], []
    _, name, config = min(scored, key=lambda item: (item[0], item[1]))
    differences, overrides = preset_overrides(plan, config)
    return name, differences, overrides


def _same_model(inputs: PlanInputs, config: Config) -> bool:
    params = mem.count_params(config.model)
    return (abs(params - inputs.params) <= PARAMS_MATCH * inputs.params
            and config.model.lora.enabled == (inputs.task == "lora"))


def _similarity(plan: Plan, config: Config) -> int:
    c, hw, ds = plan.choice.candidate, config.hardware, config.deepspeed
    return (2 * (hw.gpu == plan.inputs.gpu.name) + 2 * (hw.nodes * hw.gpus_per_node == plan.inputs.world_size)
            + (dsc.zero_stage(ds) == c.stage)
            + (dsc.offload_optimizer_device(ds) == c.offload_optimizer)
            + (dsc.offload_param_device(ds) == c.offload_param))


def preset_overrides(plan: Plan, config: Config) -> tuple[list[str], list[str]]:
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
    setting("data.seq_len", config.data.seq_len, inputs.seq_len)
    setting("train.precision", config.train.precision, inputs.precision)
    setting("train.micro_batch_size", config.train.micro_batch_size, c.micro_batch)
    setting("train.grad_accum", config.train.grad_accum, plan.grad_accum)
    if config.train.global_batch_size is not None:
        setting("train.global_batch_size", config.train.global_batch_size, plan.global_batch)
    setting("model.gradient_checkpointing", config.model.gradient_checkpointing, c.checkpointing)
    ds_changes = (_zero_changes(config, plan)
                  + dsc.precision_overrides(config.deepspeed, inputs.precision)
                  + dsc.activation_checkpointing_overrides(config.deepspeed, c.checkpointing))
    if ds_changes:
        differences.append(f"DeepSpeed: preset {_describe(config.deepspeed)}, plan {c.candidate.label}"
                           + (f" + hpZ {c.hpz_partition_size}" if c.hpz_partition_size > 1 else ""))
    if inputs.task == "pretrain" and config.model.name_or_path:
        differences.append(f"the preset fine-tunes {config.model.name_or_path}; for pretraining from scratch "
                           f"copy it and set model.name_or_path: null with a tokenizer")
    if inputs.task != "pretrain" and config.model.name_or_path is None:
        differences.append("the preset trains from scratch; set model.name_or_path to the weights to fine-tune")
    return differences, overrides + ds_changes


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
    from .launch import train_command
    inputs, c = plan.inputs, plan.choice.candidate
    cpu_offload = "cpu" in (c.offload_optimizer, c.offload_param)  # seed step 6 #7: --bind_cores_to_rank
    line = train_command(plan.preset or "PRESET", overrides, inputs.nodes, inputs.gpus_per_node, cpu_offload)
    if plan.preset:
        return line
    runner = line[:line.index(" train.py ")]
    return " ".join([runner, "your_train.py", "--deepspeed", "--deepspeed_config", shlex.quote(output or "ds_config.json")])


# --- output --------------------------------------------------------------------------------------


def plan_to_json(plan: Plan) -> dict:
    inputs = plan.inputs
    return {
        "model": {"label": inputs.model.label, "hidden_size": inputs.model.config.hidden_size,
                  "num_layers": inputs.model.config.num_layers, "vocab_size": inputs.model.config.vocab_size},
        "params": inputs.params,
        "largest_layer_params": inputs.largest_layer,
        "lora_params": inputs.lora_params or None,
        "hardware": {"gpu": inputs.gpu.name, "gpu_memory_bytes": inputs.gpu.memory_bytes,
                     "gpus_per_node": inputs.gpus_per_node, "nodes": inputs.nodes, "cpu_ram_gb": inputs.cpu_ram_gb,
                     "nvme_gb": inputs.nvme_gb},
        "task": inputs.task, "seq_len": inputs.seq_len, "precision": inputs.precision,
        "gpu_budget_bytes": budgets(inputs)[0],
        "candidates": [_estimate_json(e) for e in plan.rows],
        "walk": plan.walk,
        "choice": _choice_json(plan),
        "fits": plan.choice is not None,
        "suggestions": plan.suggestions,
        "notes": plan.notes,
        "preset": plan.preset,
        "preset_differences": plan.preset_differences,
        "deepspeed_config": plan.deepspeed,
        "launch": plan.launch,
    }


def _estimate_json(e: Estimate) -> dict:
    c = e.candidate
    return {"name": c.name, "stage": c.stage, "offload_optimizer": c.offload_optimizer,
            "offload_param": c.offload_param, "micro_batch": e.micro_batch,
            "activation_checkpointing": e.checkpointing, "gpu_bytes": e.gpu_bytes(),
            "model_states_gpu_bytes": e.states.gpu_bytes, "model_states_cpu_bytes": e.states.cpu_bytes,
            "cpu_bytes_per_node": e.cpu_bytes_per_node, "nvme_bytes": e.nvme_bytes,
            "fits": e.fits, "fits_gpu": e.fits_gpu, "fits_cpu": e.fits_cpu, "fits_nvme": e.fits_nvme}


def _choice_json(plan: Plan) -> Optional[dict]:
    if plan.choice is None:
        return None
    e = plan.choice
    return {**_estimate_json(e), "grad_accum": plan.grad_accum, "global_batch": plan.global_batch,
            "hpz_partition_size": e.hpz_partition_size}


def print_plan(plan: Plan) -> None:
    inputs = plan.inputs
    gpu_budget, cpu_budget, nvme_budget = budgets(inputs)
    lora = f", LoRA r={inputs.lora.r} ({inputs.lora_params / 1e6:.1f}M adapter params)" if inputs.lora_params else ""
    print(f"Plan: {inputs.model.label}: {inputs.params:,} params (largest layer {inputs.largest_layer:,}){lora}")
    print(f"      {inputs.nodes} node(s) x {inputs.gpus_per_node} {inputs.gpu.description}, {inputs.task}, "
          f"seq {inputs.seq_len}, {inputs.precision}")
    print(f"Budget per GPU {gb(gpu_budget)} GB ({int(GPU_HEADROOM * 100)}% of {gb(inputs.gpu.memory_bytes)} GB kept for "
          f"CUDA context, NCCL, fragmentation); host RAM per node "
          f"{gb(cpu_budget) + ' GB' if cpu_budget else 'unknown (not checked)'}; NVMe "
          f"{gb(nvme_budget) + ' GB' if nvme_budget else 'none'}. GB = 1e9 bytes.")
    print()
    print_table(plan.rows)
    print()
    print("Decision (seed step 1.2 tree; stage 1 skipped: stage 2 has the same communication and less memory):")
    for line in plan.walk:
        print(f"  - {line}")
    for line in plan.notes:
        print(f"  - {line}")
    print()
    if plan.choice is None:
        print("FITS NOWHERE. What would make it fit:")
        for line in plan.suggestions:
            print(f"  - {line}")
        return
    print_choice(plan)


def print_table(rows: list[Estimate]) -> None:
    header = ("candidate", "ckpt", "params", "grads", "optim", "activ", "buffers", "GPU total", "CPU/node",
              "NVMe", "fits")
    widths = (20, 4, 7, 7, 7, 7, 8, 10, 9, 7, 4)
    print("  ".join(f"{h:>{w}}" if i else f"{h:<{w}}" for i, (h, w) in enumerate(zip(header, widths))))
    for e in rows:
        b = e.gpu_bytes()
        cells = (e.candidate.name, "yes" if e.checkpointing else "no", gb(b["params"]), gb(b["gradients"]),
                 gb(b["optimizer"]), gb(b["activations"]), gb(b["buffers"]), gb(b["total"]),
                 gb(e.cpu_bytes_per_node), gb(e.nvme_bytes) if e.nvme_bytes else "-", "yes" if e.fits else "no")
        print("  ".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, (c, w) in enumerate(zip(cells, widths))))
    print(f"(GB per GPU at micro-batch {rows[0].micro_batch}; 'ckpt' = activation checkpointing needed to fit; "
          f"model states on DeepSpeed's accounting, host RAM with its 1.5x margin)")


def print_choice(plan: Plan) -> None:
    e, inputs = plan.choice, plan.inputs
    hpz = f" + ZeRO++ hpZ {e.hpz_partition_size}" if e.hpz_partition_size > 1 else ""
    print(f"Chosen: {e.candidate.name} ({e.candidate.label}{hpz}), micro-batch {e.micro_batch}, grad accumulation "
          f"{plan.grad_accum} -> {e.micro_batch} x {plan.grad_accum} x {inputs.world_size} = {plan.global_batch} "
          f"sequences ({plan.global_batch * inputs.seq_len:,} tokens) per step, activation checkpointing "
          f"{'on' if e.checkpointing else 'off'}, {inputs.precision}")
    b = e.gpu_bytes()
    print(f"  per GPU {gb(b['total'])} GB = params {gb(b['params'])} + grads {gb(b['gradients'])} + optimizer "
          f"{gb(b['optimizer'])} + activations {gb(b['activations'])} (logits {gb(e.activations.logits)}) + buffers "
          f"{gb(b['buffers'])}; host RAM {gb(e.cpu_bytes_per_node)} GB/node"
          + (f"; NVMe {gb(e.nvme_bytes)} GB/node" if e.nvme_bytes else ""))
    print()
    print("DeepSpeed config (-o FILE writes it):")
    print(json.dumps(plan.deepspeed, indent=2))
    print()
    if plan.preset:
        print(f"Nearest preset: {plan.preset}")
        for line in plan.preset_differences:
            print(f"  - {line}")
    else:
        print("Nearest preset: none ships this model; use the exported config with your script, or copy a preset")
    print()
    if inputs.nodes > 1:
        print(f"hostfile ({inputs.nodes} lines): node1 slots={inputs.gpus_per_node} ... "
              f"node{inputs.nodes} slots={inputs.gpus_per_node}")
    print(f"Launch: {plan.launch}")


# --- the command ----------------------------------------------------------------------------------


def plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenario", nargs="?", help="scenario file (scenarios/NAME.yaml); flags override its values")
    parser.add_argument("--model", help=f"named size ({', '.join(NAMED_MODELS)}), preset name, HF config.json, "
                                        f"or a parameter count (with --hidden-size and --num-layers)")
    parser.add_argument("--hidden-size", type=int, help="hidden size, with a raw parameter count")
    parser.add_argument("--num-layers", type=int, help="layers, with a raw parameter count")
    parser.add_argument("--gpu", help=f"GPU type: {', '.join(g for g in GPUS if g != 'cpu')}")
    parser.add_argument("--gpus-per-node", type=int)
    parser.add_argument("--nodes", type=int)
    parser.add_argument("--cpu-ram-gb", type=float, help="host RAM per node (GB); unknown = not checked")
    parser.add_argument("--nvme-gb", type=float, help="local NVMe per node (GB); 0 or absent = none")
    parser.add_argument("--nvme-path", help="NVMe mount for ZeRO-Infinity (default /local_nvme)")
    parser.add_argument("--task", help="pretrain, full (fine-tune) or lora (default full)")
    parser.add_argument("--seq-len", type=int, help="tokens per sequence (default 2048)")
    parser.add_argument("--micro-batch", type=int, help="required micro-batch per GPU (default: the largest that fits)")
    parser.add_argument("--global-batch", type=int, help="target sequences per optimizer step")
    parser.add_argument("--no-activation-checkpointing", action="store_true", help="never plan checkpointing")
    parser.add_argument("--json", action="store_true", help="print only the plan as one JSON object")
    parser.add_argument("-o", "--output", help="write the chosen DeepSpeed config (JSON) here")


def plan(args) -> int:
    # DeepSpeed logs to stdout on import (config validation below imports it): keep stdout for the plan.
    with contextlib.redirect_stdout(sys.stderr):
        inputs = inputs_from_args(args)
        result = make_plan(inputs, args.output)
        if args.output and result.deepspeed is not None:
            write_config(result.deepspeed, args.output)
    if args.json:
        print(json.dumps(plan_to_json(result), indent=2))
    else:
        print_plan(result)
    return 0 if result.choice is not None else 1


def write_config(ds: dict, output: str) -> None:
    problems = dsc.check_keys(ds)
    if problems:  # a planner bug: the builders produced something DeepSpeed would reject
        raise RuntimeError(f"planned DeepSpeed config has problems: {problems}")
    out = Path(output)
    if not out.parent.exists():
        raise UserError(f"-o {output}: directory {out.parent} does not exist")
    out.write_text(json.dumps(ds, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)


def inputs_for_resolved(resolved) -> PlanInputs:
    """Planner inputs describing a resolved preset (its model, hardware, sequence and LoRA settings)."""
    cfg, hw = resolved.config, resolved.config.hardware
    task = "lora" if cfg.model.lora.enabled else ("pretrain" if cfg.model.name_or_path is None else "full")
    return PlanInputs(model=ModelSpec(cfg.model, cfg.name), gpu=GPUS[hw.gpu], gpus_per_node=hw.gpus_per_node,
                      nodes=hw.nodes, cpu_ram_gb=hw.cpu_ram_gb, nvme_gb=hw.nvme_gb, task=task,
                      seq_len=cfg.data.seq_len, lora=cfg.model.lora)


def plan_for_resolved(resolved, micro_batch: Optional[int] = None, checkpointing: Optional[bool] = None,
                      candidate: Optional[Candidate] = None) -> Estimate:
    """The planner's estimate for a resolved preset as configured, or with one thing changed
    (micro-batch, checkpointing, stage/offload): used by lint, doctor and the preset memory report."""
    cfg, ds = resolved.config, resolved.ds
    candidate = candidate or Candidate(cfg.name, dsc.zero_stage(ds), dsc.offload_optimizer_device(ds),
                                       dsc.offload_param_device(ds))
    return estimate(inputs_for_resolved(resolved), candidate,
                    micro_batch or resolved.batch.micro_batch_size,
                    cfg.model.gradient_checkpointing if checkpointing is None else checkpointing,
                    hpz_partition_size=dsc.hpz_partition_size(ds),
                    reduce_bucket_size=int(dsc.zero_setting(ds, "reduce_bucket_size")),
                    precision=dsc.precision(ds), overlap_comm=dsc.overlap_comm(ds))
