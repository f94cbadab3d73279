"""The planner's inputs (the seed's step 1.1): flags or a scenario file, checked with every problem at once."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .. import ds as dsc
from .. import numbers
from ..config import LORA_TARGETS, LoraConfig
from ..errors import ConfigError, UserError, closest, short
from ..hardware import GPUS, Gpu, gpu_named
from ..presets import config_from_dict
from . import memory as mem
from .models import ModelSpec, model_from_spec, positive_int
from .scenario import read_scenario


LORA_PROJECTIONS = LORA_TARGETS[:7]  # what plan.memory.lora_params can count (not lm_head, embeddings, all-linear)


TASKS = ("pretrain", "full", "lora", "dpo", "dpo-lora", "grpo")  # dpo: full preference tuning; dpo-lora: with LoRA;
#                                                                   grpo: RL with rollouts on the trained model
REFERENCES = ("auto", "adapter", "engine", "precomputed", "none")  # preference.reference's values; none: grpo.beta=0


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
    padding_mask: bool = False  # batches carry an attention mask (SFT): sdpa then expands k/v (plan.memory);
    #                             none under sequence parallelism (`masked`)
    sequence_parallel: Optional[int] = None  # Ulysses SP size; None: the planner picks the smallest that fits
    expert_parallel: int = 1  # AutoEP group size: each GPU holds num_experts / expert_parallel experts
    reference: str = "auto"  # dpo tasks: how the reference model runs (REFERENCES); auto: adapter with LoRA, else the
    #                          planner's choice between engine and precomputed (plan.decide)
    reference_offload: Optional[bool] = None  # engine under ZeRO-3: its weights on the CPU; None: as the policy's
    checkpoint_offload: Optional[bool] = None  # checkpointed layer inputs in host memory (DeepSpeed cpu_checkpointing);
    #                                            None: the planner's last resort, when nothing fits without it

    @property
    def lora_enabled(self) -> bool:
        return self.task in ("lora", "dpo-lora")

    @property
    def preference(self) -> bool:
        return self.task in ("dpo", "dpo-lora")

    @property
    def grpo(self) -> bool:
        return self.task == "grpo"

    @property
    def has_reference(self) -> bool:
        """A reference model is priced: preference tuning's, or GRPO's KL reference (a frozen engine) unless none."""
        return self.preference or (self.grpo and self.reference != "none")

    @property
    def sequences_per_sample(self) -> int:
        """A preference sample is a pair: chosen and rejected both go through the model."""
        return 2 if self.preference else 1

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def sp(self) -> int:
        return self.sequence_parallel or 1

    @property
    def masked(self) -> bool:
        """The model gets an attention mask: padded batches, and no sequence parallelism (Ulysses attends causally
        by position: train/sequence_parallel.py model_inputs)."""
        return self.padding_mask and self.sp == 1

    @property
    def data_parallel_size(self) -> int:
        """Ranks that consume different samples: an SP group of sp ranks trains one sample together."""
        return self.world_size // self.sp

    @property
    def precision(self) -> str:
        return "bf16" if self.gpu.bf16 else "fp16"  # V100: fp16 with loss scaling (seed step 3.2)

    @property
    def params(self) -> int:
        return self.model.params_override or mem.count_params(self.model.config)

    @property
    def active_params(self) -> int:
        """Parameters one token passes through (MoE: its top-k experts); what FLOPs per token count."""
        return self.params if self.model.params_override else mem.active_params(self.model.config)

    @property
    def largest_layer(self) -> int:
        return mem.largest_layer_params(self.model.config, self.expert_parallel)

    @property
    def lora_params(self) -> int:
        return mem.lora_params(self.model.config, self.lora) if self.lora_enabled else 0


FLAG_TO_KEY = {"model": "model", "hidden_size": "hidden_size", "num_layers": "num_layers", "gpu": "gpu",
               "gpus_per_node": "gpus_per_node", "nodes": "nodes", "cpu_ram_gb": "cpu_ram_gb", "nvme_gb": "nvme_gb",
               "nvme_path": "nvme_path", "task": "task", "seq_len": "seq_len", "micro_batch": "micro_batch",
               "global_batch": "global_batch", "sequence_parallel": "sequence_parallel", "reference": "reference",
               "expert_parallel": "expert_parallel"}


def inputs_from_args(args) -> PlanInputs:
    """Scenario file values, overridden by any flag given on the command line."""
    values: dict[str, Any] = read_scenario(args.scenario) if args.scenario else {}
    source = args.scenario or "flags"
    for flag, key in FLAG_TO_KEY.items():
        if getattr(args, flag, None) is not None:
            values[key] = getattr(args, flag)
    if args.no_activation_checkpointing:
        values["activation_checkpointing"] = False
    if getattr(args, "checkpoint_offload", "auto") != "auto":
        values["checkpoint_offload"] = args.checkpoint_offload == "on"
    return build_inputs(values, source)


def collecting(problems: list[str]):
    """check(make, *args) -> make(*args), or None with its UserError's message added to `problems`: every
    problem of the inputs is reported together."""
    def check(make, *args, **kwargs):
        try:
            return make(*args, **kwargs)
        except UserError as err:
            problems.append(str(err))
            return None
    return check


def build_inputs(values: dict, source: str = "flags") -> PlanInputs:
    """Validated PlanInputs from a dict of scenario keys. Every problem names the flag (or the key, in a
    file) and a fix, and all of them are reported together in one ConfigError."""
    def flag(key: str) -> str:
        return f"--{key.replace('_', '-')}" if source == "flags" else key

    problems: list[str] = []

    check = collecting(problems)

    known = ", ".join(g for g in GPUS if g != "cpu")
    if values.get("gpu") is None:
        problems.append(f"{flag('gpu')} is required: one of {known}")
    gpu = check(gpu_named, str(values["gpu"]), flag("gpu")) if values.get("gpu") is not None else None
    task = str(values.get("task", "full"))
    if task not in TASKS:
        problems.append(f"{flag('task')}: {task!r} is not one of {', '.join(TASKS)}{closest(task, TASKS)}")
    reference = str(values.get("reference", "auto"))
    problems += reference_problems(task, reference, flag)
    kinds = {"gpus_per_node": numbers.RANKS_PER_NODE, "seq_len": numbers.SEQUENCE_TOKENS}  # the flags' kinds
    ints = {key: check(positive_int, values.get(key, default), flag(key), optional=default is None,
                       kind=kinds.get(key, numbers.COUNT))
            for key, default in (("gpus_per_node", 1), ("nodes", 1), ("seq_len", 2048), ("micro_batch", None),
                                 ("global_batch", None), ("sequence_parallel", None), ("expert_parallel", 1))}
    sizes = {key: check(_size_gb, values.get(key), flag(key), allow_zero=key == "nvme_gb")
             for key in ("cpu_ram_gb", "nvme_gb")}
    model = check(model_from_spec, values.get("model"), values.get("hidden_size"), values.get("num_layers"), flag)
    lora = check(_lora_config, values.get("lora"), flag("lora"))
    seq_len = ints["seq_len"]
    if model and seq_len and seq_len > model.config.max_position_embeddings:
        problems.append(f"{flag('seq_len')} {seq_len} is beyond {model.label}'s "
                        f"{model.config.max_position_embeddings} positions (max_position_embeddings): use a "
                        f"shorter sequence, or a model (inline architecture or config.json) with longer positions")
    checkpointing = bool(values.get("activation_checkpointing", True))
    offload = values.get("checkpoint_offload")
    if offload and not checkpointing:
        problems.append(f"{flag('checkpoint_offload')} moves activation checkpoints to host memory, and "
                        f"{'--no-activation-checkpointing' if source == 'flags' else 'activation_checkpointing: false'} "
                        f"plans none: drop one of them")
    if problems:
        raise ConfigError(problems, "the command line" if source == "flags" else source)
    inputs = PlanInputs(model=model, gpu=gpu, gpus_per_node=ints["gpus_per_node"], nodes=ints["nodes"],
                        cpu_ram_gb=sizes["cpu_ram_gb"], nvme_gb=sizes["nvme_gb"], task=task,
                        seq_len=seq_len, micro_batch=ints["micro_batch"], global_batch=ints["global_batch"],
                        allow_checkpointing=checkpointing, checkpoint_offload=offload, lora=lora,
                        nvme_path=str(values.get("nvme_path") or "/local_nvme"),
                        sequence_parallel=ints["sequence_parallel"], padding_mask=task != "pretrain",  # the launch line's
                        # preset for a fine-tune (SFT, DPO, GRPO) pads its batches and passes the mask (as
                        # estimate.inputs_for_resolved reads a preset), so the plan prices the expanded k/v too
                        reference="adapter" if reference == "auto" and task == "dpo-lora"
                        else "engine" if reference == "auto" and task == "grpo" else reference,
                        expert_parallel=ints["expert_parallel"])
    problems += sequence_parallel_problems(inputs, flag) + batch_problems(inputs, flag)
    problems += expert_parallel_problems(inputs, flag)
    if problems:
        raise ConfigError(problems, "the command line" if source == "flags" else source)
    return inputs


def reference_problems(task: str, reference: str, flag) -> list[str]:
    if reference not in REFERENCES:
        return [f"{flag('reference')}: {reference!r} is not one of {', '.join(REFERENCES)}"
                f"{closest(reference, REFERENCES)}"]
    if task == "grpo":
        if reference not in ("auto", "engine", "none"):
            return [f"{flag('reference')} {reference}: GRPO's KL reference is a frozen engine (engine, the default) or "
                    f"none (grpo.beta=0)"]
        return []
    if reference == "none":
        return [f"{flag('reference')} none: only GRPO runs without a reference (grpo.beta=0); use {flag('task')} grpo"]
    if reference != "auto" and task not in ("dpo", "dpo-lora"):
        return [f"{flag('reference')} {reference}: the reference model belongs to preference tuning; use "
                f"{flag('task')} dpo or dpo-lora, or drop {flag('reference')}"]
    if reference == "adapter" and task == "dpo":
        return [f"{flag('reference')} adapter: the reference is the LoRA base with the adapter disabled, so it needs "
                f"LoRA: use {flag('task')} dpo-lora, or {flag('reference')} engine or precomputed"]
    return []


def sequence_parallel_blocked(inputs: PlanInputs) -> str:
    """Why the trainer would refuse any sequence parallelism for this plan ('' when it would not): the runs the
    trainer's rules refuse (rules.sequence_parallel_supported, moe.expert_parallel_problems) are not planned."""
    if inputs.preference:
        return ("the DPO loss sums each response's log-probs over the whole sequence and is not sharded yet (the "
                "trainer refuses deepspeed.sequence_parallel_size with data.task=preference)")
    if inputs.expert_parallel > 1:
        return ("the trainer wires AutoEP on data-parallel ranks only (it refuses deepspeed.expert_parallel with "
                "sequence_parallel_size); keep one of --expert-parallel and --sequence-parallel")
    return ""


def sequence_parallel_sizes(inputs: PlanInputs) -> list[int]:
    """Ulysses sizes that can work: each divides the world (whole SP groups), the query heads (the all-to-all hands
    each rank whole heads) and the sequence (equal shards), and divides the key/value heads or is a multiple of
    them (DeepSpeed then replicates a kv head on several ranks: ulysses_sp.py); only 1 where the trainer refuses
    sequence parallelism for the run (sequence_parallel_blocked)."""
    if sequence_parallel_blocked(inputs):
        return [1]
    m = inputs.model.config
    kv_heads = m.num_kv_heads or m.num_heads
    return [n for n in range(1, inputs.world_size + 1)
            if inputs.world_size % n == 0 and m.num_heads % n == 0 and (kv_heads % n == 0 or n % kv_heads == 0)
            and inputs.seq_len % n == 0]


def sequence_parallel_problems(inputs: PlanInputs, flag) -> list[str]:
    sp = inputs.sequence_parallel
    if sp is None or sp in sequence_parallel_sizes(inputs):
        return []
    if sequence_parallel_blocked(inputs):
        return [f"{flag('sequence_parallel')} {sp}: {sequence_parallel_blocked(inputs)}"]
    m = inputs.model.config
    return [f"{flag('sequence_parallel')} {sp} must divide the {inputs.world_size} GPUs, the {m.num_heads} attention "
            f"heads and --seq-len {inputs.seq_len}, and divide the {m.num_kv_heads or m.num_heads} key/value heads or be "
            f"a multiple of them: sizes that work here: "
            f"{', '.join(map(str, sequence_parallel_sizes(inputs)))}"]


def expert_parallel_problems(inputs: PlanInputs, flag) -> list[str]:
    """AutoEP splits each layer's experts evenly over groups of ep GPUs: ep divides both (DeepSpeed's own rule)."""
    ep, m = inputs.expert_parallel, inputs.model.config
    if ep == 1:
        return []
    if not m.num_experts:
        return [f"{flag('expert_parallel')} {ep}: {inputs.model.label} has no experts; remove it"]
    fits = [n for n in range(1, inputs.world_size + 1) if inputs.world_size % n == 0 and m.num_experts % n == 0]
    if ep not in fits:
        return [f"{flag('expert_parallel')} {ep} must divide the {inputs.world_size} GPUs and the {m.num_experts} "
                f"experts per layer: sizes that work here: {', '.join(map(str, fits))}"]
    if inputs.lora_enabled:  # as the trainer refuses deepspeed.expert_parallel with model.lora.enabled
        return [f"{flag('expert_parallel')} {ep} with --task {inputs.task}: AutoEP replaces the expert modules LoRA "
                f"adapts, and the trainer refuses the two together; plan LoRA without it, or --task full with it"]
    return []


def batch_problems(inputs: PlanInputs, flag) -> list[str]:
    """The target global batch must split into whole micro-batches on every data-parallel rank."""
    world, micro, total = inputs.data_parallel_size, inputs.micro_batch, inputs.global_batch
    if total is not None and total % world:
        sp = f" / sequence parallel {inputs.sp}" if inputs.sp > 1 else ""
        return [f"{flag('global_batch')} {total} is not a multiple of the {world} data-parallel ranks "
                f"({inputs.nodes} node(s) x {inputs.gpus_per_node} GPUs{sp}): use e.g. {world * max(1, total // world)}"]
    if total is not None and micro is not None and dsc.accumulation(total, micro, world) is None:
        return [f"{flag('micro_batch')} {micro} does not divide the {total // world} sequences each rank gets "
                f"per step ({flag('global_batch')} {total} / {world} ranks): pick a divisor, or drop one of them"]
    return []

def _size_gb(value: Any, where: str, allow_zero: bool) -> Optional[float]:
    """A size in GB: positive (NVMe may be 0 = none); absent = unknown."""
    if value is None:
        return None
    if numbers.GIGABYTES.problem(value) or (value == 0 and not allow_zero):  # nan, inf and -1 too
        raise UserError(f"{where}: {value!r} must be a size in GB " + (">= 0 (0 = none)" if allow_zero else "> 0")
                        + "; leave it out when unknown")
    return float(value)


def _lora_config(value: Any, where: str) -> LoraConfig:
    if value is None:
        return LoraConfig()
    if not isinstance(value, dict):
        raise UserError(f"{where}: expected a mapping of model.lora settings (r, alpha, target_modules)")
    lora = config_from_dict({"model": {"lora": value}}, source=where).model.lora
    unknown = [name for name in lora.target_modules if name not in LORA_PROJECTIONS]
    if unknown or not lora.target_modules:
        raise UserError(f"{where}.target_modules: {short(unknown or lora.target_modules)} name no module the planner "
                        f"counts adapters on{closest(str(unknown[0]), LORA_PROJECTIONS) if unknown else ''}: the "
                        f"projections of a Llama-style layer, {', '.join(LORA_PROJECTIONS)}")
    return lora
