"""Candidates (stage x offload) priced with `plan.memory`: what each needs per GPU, per node and on NVMe."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from .. import ds as dsc
from .. import hardware
from ..resolve import alst_mlp_tiles, auto_logits_tiles, even_tiles
from . import memory as mem
from .rollout import rollout_bytes
from .inputs import PlanInputs
from .models import ModelSpec


GPU_HEADROOM = 0.10     # of device memory kept free: CUDA context, NCCL buffers, allocator fragmentation


HOST_HEADROOM = 0.10    # of host RAM and NVMe kept free: OS, dataloader workers, page cache


TIGHT = 0.95            # of the usable budget: past it `lint` warns, and the planner takes it only when nothing
                        # roomier fits (a longer document, a fragmented allocator or NCCL's buffers then OOM)
MEMORY_HEADROOM = "memory headroom"  # lint's check for it; a header accepts it as `# Accepted warning [memory
                                     # headroom]: why` (presets.accepted_warnings)


MAX_MICRO_BATCH = 64


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


# What each step down the seed's tree costs in step time: the one table the plan's walk (why the chosen candidate
# beats the next one) and lint's notes (#2, #6, #7) read.
COSTS = {
    "stage 3": "ZeRO-3 costs ~1.5x ZeRO-2's communication (the parameters are all-gathered in forward and backward)",
    "checkpointing": "activation checkpointing recomputes the forward (~1/3 more compute)",
    "offload": "CPU offload moves the optimizer step to PCIe and CPU Adam (steps often 10-50x slower)",
}


def slower_because(chosen: "Estimate", other: "Estimate") -> list[str]:
    """The COSTS `other` pays that `chosen` does not: why the chosen candidate is the faster of the two."""
    offloaded = ("none", "none") != (other.candidate.offload_optimizer, other.candidate.offload_param)
    chosen_offloaded = ("none", "none") != (chosen.candidate.offload_optimizer, chosen.candidate.offload_param)
    return ([COSTS["stage 3"]] if other.candidate.stage == 3 > chosen.candidate.stage else []) + (
        [COSTS["checkpointing"]] if other.checkpointing and not chosen.checkpointing else []) + (
        [COSTS["offload"]] if offloaded and not chosen_offloaded else [])


def stage_below_two_wasted(stage: int, data_parallel_size: int) -> bool:
    """Stage 0 or 1 with more than one data-parallel rank: stage 2 moves the same bytes (a reduce-scatter and an
    all-gather are one all-reduce) and shards the gradients and optimizer states too. The one rule the planner's
    walk (which skips such a stage 0) and lint's #2 (which notes it) both read, so lint never objects to a plan."""
    return stage in (0, 1) and data_parallel_size > 1


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
    reference: int = 0       # preference tuning: the reference model's GPU bytes while training (weights + forward)
    precompute_pass: int = 0  # reference=precomputed: the GPU peak of the one-time pass before training
    rollout: int = 0         # grpo: the GPU peak while generating (states, the gathered model, KV cache, reference)
    mlp_tiles: int = 0       # model.tiled_mlp counted (0: the MLPs run whole)
    logits_tiles: int = 0    # model.tiled_logits counted, as the trainer's "auto" decides and runs it (0: off)
    checkpoint_offload: bool = False  # the checkpointed layer inputs in host memory (DeepSpeed's cpu_checkpointing)

    @property
    def gpu_total(self) -> int:
        s = self.states
        return s.params + s.gradients + s.optimizer + self.activations.total + self.buffers + self.reference

    @property
    def fits_gpu(self) -> bool:
        return self.peak <= self.gpu_budget

    @property
    def peak(self) -> int:
        """The GPU peak of the run: training, the rollout (GRPO) or the one-time reference pass, whichever is
        highest."""
        return max(self.gpu_total, self.precompute_pass, self.rollout)

    @property
    def tight(self) -> bool:
        """Fits, but past TIGHT of the usable budget: the one rule lint's warning and the planner's micro-batch read."""
        return self.fits_gpu and self.peak > TIGHT * self.gpu_budget

    @property
    def roomy(self) -> bool:
        return self.fits and not self.tight

    @property
    def rollout_sets_peak(self) -> bool:
        return self.rollout > self.gpu_total

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
                "activations": self.activations.total, "buffers": self.buffers, "reference": self.reference,
                "total": self.gpu_total}

    def why_not(self) -> str:
        reasons = []
        if self.gpu_total > self.gpu_budget:
            reasons.append(f"{gb(self.gpu_total)} GB per GPU > {gb(self.gpu_budget)} GB")
        if self.rollout > self.gpu_budget:
            reasons.append(f"the rollout needs {gb(self.rollout)} GB per GPU > {gb(self.gpu_budget)} GB")
        if self.precompute_pass > self.gpu_budget:
            reasons.append(f"the reference log-prob pass needs {gb(self.precompute_pass)} GB per GPU > "
                           f"{gb(self.gpu_budget)} GB")
        if not self.fits_cpu:
            reasons.append(f"{gb(self.cpu_bytes_per_node)} GB host RAM per node > {gb(self.cpu_budget)} GB")
        if not self.fits_nvme:
            have = f"{gb(self.nvme_budget)} GB" if self.nvme_budget else "no NVMe"
            reasons.append(f"{gb(self.nvme_bytes)} GB NVMe per node > {have}")
        return "; ".join(reasons) or "fits"


def gb(value: Optional[float]) -> str:
    return "-" if value is None else f"{value / mem.GB:.1f}"


def memory_report(est: Estimate) -> dict[str, float]:
    """An estimate's GPU and host numbers in GB, rounded as `gb` prints them: what `show` lists under `estimate`,
    `lint` prints on its planner line and `plan --write-preset` writes as a header's expected memory."""
    parts = {"per_gpu": est.gpu_total, "usable": est.gpu_budget, "params": est.states.params,
             "grads": est.states.gradients, "optimizer": est.states.optimizer, "activations": est.activations.total,
             "buffers": est.buffers, "reference_model": est.reference, "host_per_node": est.cpu_bytes_per_node,
             "reference_pass_peak": est.precompute_pass, "rollout_peak": est.rollout}
    optional = ("reference_model", "reference_pass_peak", "rollout_peak")
    return {name: float(gb(value)) for name, value in parts.items() if value or name not in optional}


def budgets(inputs: PlanInputs) -> tuple[int, Optional[int], Optional[int]]:
    gpu = int(inputs.gpu.memory_bytes * (1 - GPU_HEADROOM))
    cpu = None if inputs.cpu_ram_gb is None else int(inputs.cpu_ram_gb * mem.GB * (1 - HOST_HEADROOM))
    nvme = None if not inputs.nvme_gb else int(inputs.nvme_gb * mem.GB * (1 - HOST_HEADROOM))
    return gpu, cpu, nvme


def estimate(inputs: PlanInputs, candidate: Candidate, micro_batch: int, checkpointing: bool,
             hpz_partition_size: int = 1, reduce_bucket_size: Optional[int] = None, precision: Optional[str] = None,
             attention: Optional[str] = None, overlap_comm: bool = True, mlp_tiles: int = 0,
             logits_tiles: Optional[int] = None, checkpoint_offload: Optional[bool] = None) -> Estimate:
    """Per-GPU, per-node host and NVMe bytes of one candidate at one micro-batch. `logits_tiles` None: as the
    trainer's model.tiled_logits "auto" decides at these sizes (`planned_logits_tiles`). `checkpoint_offload` None:
    as the inputs say (a plan turns it on only when nothing fits without: decide.make_plan)."""
    precision = precision or inputs.precision
    m, stage = inputs.model.config, candidate.stage
    on_nvme = candidate.stage == 3 and "nvme" in (candidate.offload_optimizer, candidate.offload_param)
    states = _model_states(inputs, candidate, precision)
    attention = attention or m.attn_implementation  # 'auto' is counted as sdpa, the larger of the two
    sequences = micro_batch * inputs.sequences_per_sample  # a preference pair is two sequences
    if logits_tiles is None:
        logits_tiles = planned_logits_tiles(inputs, sequences, precision, stage)
    logits_tiles = even_tiles(inputs.seq_len // inputs.sp * sequences, logits_tiles) if logits_tiles >= 2 else 0
    if checkpoint_offload is None:
        checkpoint_offload = bool(inputs.checkpoint_offload)
    checkpoint_offload = checkpoint_offload and checkpointing
    activations = mem.activation_bytes(m, inputs.seq_len, sequences, checkpointing, precision, attention,
                                       inputs.masked, stage, inputs.sp, mlp_tiles, logits_tiles,
                                       checkpoint_offload,
                                       forward="policy" if inputs.preference or inputs.grpo else "causal")
    # the plan's own config: 'auto' (hidden^2), raised to the useful floor for a small model (ds.with_bucket_floor)
    bucket = reduce_bucket_size if reduce_bucket_size is not None else max(m.hidden_size ** 2, dsc.USEFUL_BUCKET[0])
    buffers = (states.working + mem.reduce_bucket_bytes(stage, bucket, precision, overlap_comm)
               + mem.hpz_secondary_bytes(inputs.params, hpz_partition_size if stage == 3 else 1, precision))
    cpu, nvme = states.cpu_bytes + activations.host * inputs.gpus_per_node, 0
    if on_nvme:
        trained = inputs.lora_params or inputs.params
        offload_opt, offload_par = (candidate.offload_optimizer == "nvme"), (candidate.offload_param == "nvme")
        nvme = mem.nvme_offload_bytes(trained, inputs.nodes, offload_opt, offload_par)
        cpu = (mem.nvme_host_buffer_bytes(trained, inputs.world_size, inputs.gpus_per_node)
               + activations.host * inputs.gpus_per_node)
        if inputs.lora_params:  # the frozen base is swapped like any 16-bit param
            nvme += mem.nvme_offload_bytes(inputs.params, inputs.nodes, optimizer=False, params=True)
    reference, precompute_pass, rollout, weights = 0, 0, 0, 0
    if inputs.has_reference:
        weights, host, forward = reference_costs(inputs, candidate, sequences, precision, attention)
        cpu += host
        if inputs.reference == "precomputed":  # the pass runs beside the policy's states, before any activation
            precompute_pass = states.params + states.gradients + states.optimizer + buffers + weights + forward
        elif inputs.grpo:  # GRPO's reference runs in the rollout phase, after generation: not beside training
            reference = weights
        else:
            reference = weights + forward
    if inputs.grpo:  # generation (the whole model gathered under ZeRO-3, a KV cache), then the reference's forward
        generation = rollout_bytes(m, inputs.params, stage, inputs.seq_len, sequences, precision, attention)
        rollout = (states.params + states.gradients + states.optimizer + buffers + weights
                   + max(generation, forward if inputs.has_reference else 0))
    gpu_budget, cpu_budget, nvme_budget = budgets(inputs)
    return Estimate(candidate, micro_batch, checkpointing, hpz_partition_size if stage == 3 else 1, states,
                    activations, buffers, int(cpu), int(nvme), gpu_budget, cpu_budget, nvme_budget, reference,
                    precompute_pass, rollout, mlp_tiles if mlp_tiles >= 2 else 0, logits_tiles, checkpoint_offload)


def planned_logits_tiles(inputs: PlanInputs, sequences: int, precision: str, stage: int = 0) -> int:
    """model.tiled_logits as the trainer's "auto" (resolve.auto_logits_tiles) turns it on for this plan's sizes."""
    task = "preference" if inputs.preference else "pretrain" if inputs.task == "pretrain" else "sft"
    return auto_logits_tiles(inputs.model.config, inputs.seq_len, inputs.sp, sequences, precision, task, stage)


def planned_mlp_tiles(inputs: PlanInputs, micro_batch: int) -> int:
    """model.tiled_mlp the planner turns on when checkpointing alone does not fit: ALST's tiles of about hidden_size
    tokens of one rank's share (resolve.alst_mlp_tiles); 0 where there is nothing to tile (a share of at most
    hidden_size tokens) or no dense MLP (MoE experts are not tiled: train.sequence_parallel.tile_mlps)."""
    m = inputs.model.config
    tiles = alst_mlp_tiles(m.hidden_size, inputs.seq_len, inputs.sp, micro_batch * inputs.sequences_per_sample)
    return tiles if tiles >= 2 and not m.num_experts else 0


def reference_costs(inputs: PlanInputs, candidate: Candidate, sequences: int, precision: str,
                    attention: str) -> tuple[int, int, int]:
    """(GPU weight bytes, host bytes per node, GPU forward bytes) of the reference model: no weights of its own for
    LoRA (the adapter-disabled base, as 'adapter' and a LoRA run's precomputed pass use), else a frozen engine,
    ZeRO-3 (offloaded with the policy's parameters) when training is (trainer/train/preference.py)."""
    m = inputs.model.config
    forward = mem.reference_forward_bytes(m, inputs.seq_len // inputs.sp, sequences, precision, attention,
                                          inputs.masked)
    if inputs.lora_enabled and inputs.reference in ("adapter", "precomputed"):
        return 0, 0, forward
    offload = inputs.reference_offload
    if offload is None:
        offload = candidate.offload_param != "none"
    weights, host = mem.frozen_reference(inputs.params, inputs.largest_layer, candidate.stage, inputs.gpus_per_node,
                                         inputs.nodes, offload, precision)
    return weights, host, forward


def _model_states(inputs: PlanInputs, candidate: Candidate, precision: str) -> mem.ModelStates:
    stage = candidate.stage
    offload_optimizer = candidate.offload_optimizer != "none"
    offload_param = candidate.offload_param != "none" and stage == 3  # DeepSpeed ignores it below stage 3
    if inputs.lora_enabled:
        return mem.lora_model_states(inputs.params, inputs.lora_params, inputs.largest_layer, stage,
                                     inputs.gpus_per_node, inputs.nodes, offload_optimizer, offload_param, precision)
    # zero.Init: the trainer builds/loads the model sharded at stage 3, as DeepSpeed's zero_init=True case.
    return mem.model_states(inputs.params, inputs.largest_layer, stage, inputs.gpus_per_node, inputs.nodes,
                            offload_optimizer, offload_param, zero_init=True, precision=precision)


def best_shot(inputs: PlanInputs, candidate: Candidate, micro_batch: int) -> Estimate:
    """A candidate at a micro-batch: without checkpointing if that fits, else with it (when allowed and
    when GPU memory is what does not fit: checkpointing frees no host RAM or NVMe), else with checkpointing and
    tiled MLPs (`planned_mlp_tiles`: one more MLP forward per layer, so only when checkpointing alone does not
    fit). Tiled logits are counted throughout as the trainer's "auto" runs them."""
    plain = estimate(inputs, candidate, micro_batch, checkpointing=False)
    if plain.fits or plain.fits_gpu or not inputs.allow_checkpointing:
        return plain
    checkpointed = estimate(inputs, candidate, micro_batch, checkpointing=True)
    tiles = planned_mlp_tiles(inputs, micro_batch)
    if checkpointed.fits_gpu or not tiles:
        return checkpointed
    return estimate(inputs, candidate, micro_batch, checkpointing=True, mlp_tiles=tiles)


def micro_batch_options(inputs: PlanInputs) -> list[int]:
    """Micro-batches worth trying: divisors of the per-rank share of the global batch, else powers of two."""
    if inputs.global_batch:
        per_rank = inputs.global_batch // inputs.data_parallel_size
        options = [d for d in range(1, min(per_rank, MAX_MICRO_BATCH) + 1) if per_rank % d == 0]
    else:
        options = [2 ** i for i in range(int(math.log2(MAX_MICRO_BATCH)) + 1)]
    if inputs.grpo:  # a micro-batch holds whole groups of at least 2 completions of a prompt
        options = [d for d in options if d % 2 == 0]
    return options


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
    preset_overrides: list[str] = field(default_factory=list)   # the launch line's --set items
    deepspeed: Optional[dict] = None
    launch: Optional[str] = None

    @property
    def global_batch(self) -> Optional[int]:
        if not self.choice:
            return None
        return self.choice.micro_batch * self.grad_accum * self.inputs.data_parallel_size


def inputs_for_resolved(resolved) -> PlanInputs:
    """Planner inputs describing a resolved preset (its model, hardware, sequence and LoRA settings)."""
    cfg, hw = resolved.config, resolved.config.hardware
    sp = dsc.sequence_parallel_size(cfg.deepspeed)
    task = "lora" if cfg.model.lora.enabled else ("pretrain" if cfg.model.name_or_path is None else "full")
    reference = "auto"
    if cfg.data.task == "grpo":
        task, reference = "grpo", "engine" if cfg.grpo.beta else "none"
    if cfg.data.task == "preference":
        task = "dpo-lora" if cfg.model.lora.enabled else "dpo"
        reference = cfg.preference.reference
        if reference == "auto":  # as train/preference.py reference_kind decides it
            reference = "adapter" if cfg.model.lora.enabled else "engine"
    return PlanInputs(model=ModelSpec(cfg.model, cfg.name), gpu=hardware.gpu(hw.gpu), gpus_per_node=hw.gpus_per_node,
                      nodes=hw.nodes, cpu_ram_gb=hw.cpu_ram_gb, nvme_gb=hw.nvme_gb, task=task,
                      seq_len=cfg.data.seq_len, lora=cfg.model.lora,
                      # under sequence parallelism the model gets no attention mask (Ulysses attends causally by
                      # position: train/sequence_parallel.py model_inputs), so sdpa builds no (b, 1, s, s) mask;
                      # isolated pretraining documents get one (transformers builds it from the position ids)
                      padding_mask=(cfg.data.task in ("sft", "preference", "grpo")
                                    or cfg.data.cross_document_attention is False), reference=reference,
                      reference_offload=cfg.preference.reference_offload,
                      expert_parallel=dsc.autoep_size(cfg.deepspeed),
                      sequence_parallel=sp, checkpoint_offload=dsc.cpu_checkpointing(cfg.deepspeed))


def plan_for_resolved(resolved, micro_batch: Optional[int] = None, checkpointing: Optional[bool] = None,
                      candidate: Optional[Candidate] = None, attention: Optional[str] = None) -> Estimate:
    """The planner's estimate for a resolved preset as configured, or with one thing changed
    (micro-batch, checkpointing, stage/offload, the attention kernel that really runs): used by lint, doctor,
    the preset memory report and scripts/gpu_check.py."""
    cfg, ds = resolved.config, resolved.ds
    candidate = candidate or Candidate(cfg.name, dsc.zero_stage(ds), dsc.offload_optimizer_device(ds),
                                       dsc.offload_param_device(ds))
    return estimate(inputs_for_resolved(resolved), candidate,
                    micro_batch or resolved.batch.micro_batch_size,
                    cfg.model.gradient_checkpointing if checkpointing is None else checkpointing,
                    hpz_partition_size=dsc.hpz_partition_size(ds),
                    reduce_bucket_size=int(dsc.zero_setting(ds, "reduce_bucket_size")),
                    precision=dsc.precision(ds), attention=attention, overlap_comm=dsc.overlap_comm(ds),
                    mlp_tiles=cfg.model.tiled_mlp, logits_tiles=cfg.model.tiled_logits or 0,
                    checkpoint_offload=dsc.cpu_checkpointing(ds))
