"""The seed's decision tree: lowest stage that fits, checkpointing before a stage up, offload last, ZeRO++ hpZ
across nodes, then the largest micro-batch and the accumulation that reaches the global batch.

Long sequences add DeepSpeed Ulysses sequence parallelism (SP) to the tree, in this order (`make_plan`):
  1. every candidate at SP 1, the tree's order (WALK: zero0, zero2, zero2_cpu_offload, zero3, ...): a plan where
     one sequence fits a GPU never changes;
  2. if only candidates that offload (a CPU/NVMe optimizer step) fit at SP 1, or none does: the candidates that keep
     everything on the GPU (ON_GPU), each at the smallest SP size that fits. An offloaded optimizer step moves the
     whole gradient and parameter partition over PCIe every step, more than Ulysses' all-to-alls over NVLink; ALST
     itself pairs SP with ZeRO-3, not offload, when there are GPUs to spread the sequence over;
  3. else the SP-1 offload candidate of step 1, else the offloading candidates with SP (OFFLOADED, smallest size);
  4. when nothing fits: all of the above again with the activation checkpoints in host memory (DeepSpeed's
     cpu_checkpointing, ALST's checkpoint offload), which moves every layer's input over PCIe twice a micro-step
     and needs host RAM for all of them: the last resort, unless the inputs ask for it (or forbid it).
In every step checkpointing comes before tiled MLPs (estimate.best_shot), and tiled logits are counted as the
trainer's "auto" runs them."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from .. import ds as dsc
from ..errors import ConfigError
from ..presets import load_preset, with_overrides
from . import memory as mem
from .artifacts import launch_line, nearest_preset, planned_deepspeed_config, shipped_config
from .estimate import (
    CANDIDATES, HOST_HEADROOM, MAX_MICRO_BATCH, TIGHT, WALK, Candidate, Estimate, Plan, best_shot, estimate, gb,
    inputs_for_resolved, micro_batch_options, plan_for_resolved, planned_mlp_tiles, slower_because,
    stage_below_two_wasted
)
from .inputs import PlanInputs, sequence_parallel_blocked, sequence_parallel_sizes


def offloads(candidate: Candidate) -> bool:
    return "none" != candidate.offload_optimizer or "none" != candidate.offload_param


ON_GPU = tuple(c for c in WALK if not offloads(c))      # tried with sequence parallelism before any offload
OFFLOADED = tuple(c for c in WALK if offloads(c))


def make_plan(inputs: PlanInputs, output: Optional[str] = None) -> Plan:
    """Each step below returns what it decided and the lines that explain it; only this function fills the plan."""
    if inputs.preference and inputs.reference == "auto":
        return plan_with_reference(inputs, output)
    required = inputs.micro_batch or 1
    rows = [best_shot(inputs, c, required) for c in CANDIDATES]
    plan = Plan(inputs, rows, [])
    chosen, lines = walk_tree(inputs, required)
    plan.walk += lines
    if chosen is None and inputs.micro_batch:
        plan.notes.append(f"micro-batch {inputs.micro_batch} fits nowhere; planning the largest micro-batch that fits")
        chosen, lines = walk_tree(inputs, 1)
        plan.walk += lines
    wants_sequence_parallel = inputs.sequence_parallel is None and (chosen is None or only_offload_fits(inputs, chosen))
    if wants_sequence_parallel and sequence_parallel_blocked(inputs):
        plan.walk.append(f"sequence parallelism: {sequence_parallel_blocked(inputs)}")
    elif wants_sequence_parallel:
        found = sequence_parallel_before_offload(inputs, chosen)
        plan.walk += found[2]
        if found[1] is not None and found[0].sp > 1:
            inputs, chosen = found[0], found[1]
            plan.inputs, plan.rows = inputs, [best_shot(inputs, c, 1) for c in CANDIDATES]
    if chosen is None and inputs.checkpoint_offload is None and inputs.allow_checkpointing:
        offloaded = make_plan(dataclasses.replace(inputs, checkpoint_offload=True), output)
        if offloaded.choice is not None:
            offloaded.walk = plan.walk + ["nothing fits with the activation checkpoints on the GPU: planning again "
                                          "with them in host memory (DeepSpeed cpu_checkpointing)"] + offloaded.walk
            return offloaded
    if chosen is None:
        plan.suggestions = what_would_fit(inputs)
        return plan
    plan.notes += (sequence_parallel_notes(inputs, chosen) + tiling_notes(inputs, chosen)
                   + checkpoint_offload_notes(inputs, chosen) + expert_parallel_notes(inputs, chosen)
                   + rocm_notes(inputs))
    chosen, note = add_zeropp(inputs, chosen)
    plan.notes += [note] if note else []
    plan.choice, line = largest_micro_batch(inputs, chosen)
    plan.walk += [line] if line else []
    plan.grad_accum = (dsc.accumulation(inputs.global_batch, plan.choice.micro_batch, inputs.data_parallel_size)
                       if inputs.global_batch else 1)  # largest_micro_batch chose a micro-batch that divides
    plan.deepspeed = planned_deepspeed_config(plan)
    plan.preset, plan.preset_differences, plan.preset_overrides = nearest_preset(plan)
    price_the_launch_line(plan)
    plan.launch = launch_line(plan, plan.preset_overrides, output)
    return plan


def launched_estimate(plan: Plan) -> Optional[Estimate]:
    """The launch line's config (the preset and its --set items, resolved) priced as lint, show and a written preset
    price it (estimate.plan_for_resolved), under the plan's candidate name; None where it does not resolve on this
    machine (an NVMe path that exists only where it will run: `launch` checks it there). The plan takes the launch
    line's accumulation too (it keeps a preset's global batch), so its DeepSpeed config is the line's batch."""
    from ..resolve import resolve
    try:
        resolved = resolve(load_preset(plan.preset, plan.preset_overrides))
    except ConfigError:
        return None
    launched = inputs_for_resolved(resolved)
    if (launched.grpo, launched.preference) != (plan.inputs.grpo, plan.inputs.preference):
        # no shipped preset of this task trains this model: the line's estimate is another training's (no rollout,
        # no reference), so the plan keeps its own and says so
        plan.walk.append(f"as launched: {plan.preset} trains data.task={resolved.config.data.task}, not this plan's "
                         f"{plan.inputs.task}; the numbers above are the plan's own, not the line's")
        return None
    if resolved.batch.micro_batch_size == plan.choice.micro_batch and resolved.batch.grad_accum != plan.grad_accum:
        plan.grad_accum = resolved.batch.grad_accum
        plan.deepspeed = planned_deepspeed_config(plan)
    return dataclasses.replace(plan_for_resolved(resolved), candidate=plan.choice.candidate)


def price_the_launch_line(plan: Plan) -> None:
    """One estimate: the launch line keeps what the preset sets and the plan did not choose (its bucket sizes, above
    all), so the plan's choice becomes the launch line's own estimate, the number `lint` and `show` print for it.
    Where the preset's settings take it past TIGHT of the budget (or out of it) and the plan's own did not, the launch
    line takes the plan's bucket sizes instead."""
    if plan.preset is None:
        return
    launched = launched_estimate(plan)
    if launched is None or gb(launched.peak) == gb(plan.choice.peak):
        plan.choice = launched or plan.choice
        return
    if plan.choice.roomy and not launched.roomy:
        buckets = dsc.bucket_overrides(shipped_config(plan.preset).deepspeed, plan.deepspeed)
        if buckets:
            plan.preset_overrides = with_overrides(plan.preset_overrides, buckets)
            plan.preset_differences.append(f"bucket sizes: {plan.preset}'s would fill {gb(launched.peak)} GB per "
                                           f"GPU; the launch line takes the plan's")
            launched = launched_estimate(plan) or launched
    plan.walk.append(f"as launched ({plan.preset} with the --set items below): {gb(launched.peak)} of "
                     f"{gb(launched.gpu_budget)} GB per GPU (the plan's own DeepSpeed config: {gb(plan.choice.peak)}), "
                     f"the number `lint` prints for it")
    plan.choice = launched


def plan_with_reference(inputs: PlanInputs, output: Optional[str]) -> Plan:
    """Full preference tuning without --reference: both references priced, and the frozen engine (the loss sees the
    reference live, no pass before training, no cache to keep) unless it needs a costlier stage or offload than
    log-probs precomputed once, which cost nothing while training."""
    engine = make_plan(dataclasses.replace(inputs, reference="engine"), output)
    precomputed = make_plan(dataclasses.replace(inputs, reference="precomputed"), output)
    order = [c.name for c in WALK]

    def rank(plan: Plan) -> int:
        return order.index(plan.choice.candidate.name) if plan.choice else len(order)
    chosen = engine if rank(engine) <= rank(precomputed) else precomputed
    lines = [f"reference {name}: " + (f"fits with {plan.choice.candidate.name} at micro-batch "
                                      f"{plan.choice.micro_batch} ({gb(plan.choice.gpu_total)} GB per GPU)"
                                      if plan.choice else "fits nowhere")
             for name, plan in (("engine", engine), ("precomputed", precomputed))]
    why = ("the frozen engine needs no stage or offload more than precomputing" if chosen is engine
           else "precomputed log-probs need a lighter stage or offload than a frozen engine")
    chosen.notes = lines + [f"reference -> {chosen.inputs.reference} ({why}; --reference to choose)"] + chosen.notes
    return chosen


def walk_tree(inputs: PlanInputs, micro_batch: int) -> tuple[Optional[Estimate], list[str]]:
    """Seed step 1.2: lowest stage first, offload last; checkpointing before a stage up (step 7.1's order).
    The first candidate that fits (or None), and one line per candidate tried."""
    lines, tight = [], None
    for candidate in WALK:
        if stage_below_two_wasted(candidate.stage, inputs.data_parallel_size):
            lines.append(f"{candidate.name}: skipped on {inputs.data_parallel_size} data-parallel ranks: stage 2 has "
                         f"the same communication and shards gradients and optimizer states too")
            continue
        if tight is not None and offloads(candidate) and not offloads(tight.candidate):
            continue  # an offloaded optimizer step costs more than a tight fit: the next on-GPU candidate only
        shot = best_shot(inputs, candidate, micro_batch)
        how = "with activation checkpointing" if shot.checkpointing else "without activation checkpointing"
        if shot.roomy:
            lines.append(f"{candidate.name}: fits at micro-batch {micro_batch} {how} "
                         f"({gb(shot.gpu_total)} of {gb(shot.gpu_budget)} GB per GPU) -> chosen")
            return shot, lines + below(inputs, shot, micro_batch)
        if shot.fits and tight is None:  # past TIGHT: lint would warn, so the next candidate first
            tight = shot
            lines.append(f"{candidate.name}: fits at micro-batch {micro_batch} {how} but fills {gb(shot.peak)} of "
                         f"{gb(shot.gpu_budget)} GB per GPU, past {TIGHT:.0%} (lint warns): the next candidate first")
            continue
        if not shot.fits:
            tried = " even with activation checkpointing" if shot.checkpointing else ""
            lines.append(f"{candidate.name}: does not fit at micro-batch {micro_batch}{tried}: {shot.why_not()}")
    if tight is not None:
        lines.append(f"{tight.candidate.name}: nothing roomier fits -> chosen, tight")
    return tight, lines


def below(inputs: PlanInputs, chosen: Estimate, micro_batch: int) -> list[str]:
    """Why the chosen candidate beats the next one down the tree that also fits: what that one costs more
    (estimate.COSTS, the table lint's notes read)."""
    for candidate in WALK[WALK.index(chosen.candidate) + 1:]:
        shot = best_shot(inputs, candidate, micro_batch)
        costs = slower_because(chosen, shot)
        if shot.fits and costs:
            return [f"{candidate.name} (below) fits too ({gb(shot.gpu_total)} GB per GPU) but is slower: "
                    + "; ".join(costs)]
    return []


def only_offload_fits(inputs: PlanInputs, chosen: Estimate) -> bool:
    """The tree's pick at SP 1 offloads, and no candidate that keeps everything on the GPU fits even at
    micro-batch 1: then sequence parallelism is tried first (module docstring, step 2)."""
    return offloads(chosen.candidate) and not any(best_shot(inputs, c, 1).fits for c in ON_GPU)


def sequence_parallel_before_offload(inputs: PlanInputs, offloaded: Optional[Estimate]
                                     ) -> tuple[PlanInputs, Optional[Estimate], list[str]]:
    """Steps 2 and 3 of the module docstring: the on-GPU candidates with SP; else the SP-1 offload pick
    (`offloaded`), else the offloading candidates with SP."""
    trial, shot, lines = smallest_sequence_parallel(inputs, ON_GPU)
    if shot is not None:
        if offloaded is not None:
            lines.append(f"sequence parallel {trial.sp} before {offloaded.candidate.name} (which fits one sequence "
                         f"per GPU): Ulysses' all-to-alls over NVLink cost less than an optimizer step over PCIe; "
                         f"--sequence-parallel 1 plans the offload instead")
        return trial, shot, lines
    if offloaded is not None:
        return inputs, offloaded, lines + [f"{offloaded.candidate.name} at sequence parallel 1 -> chosen"]
    trial, shot, more = smallest_sequence_parallel(inputs, OFFLOADED)
    return trial, shot, lines + more


def smallest_sequence_parallel(inputs: PlanInputs, candidates: tuple[Candidate, ...] = WALK
                               ) -> tuple[PlanInputs, Optional[Estimate], list[str]]:
    """When one sequence's activations fit no GPU at micro-batch 1 (long context), DeepSpeed Ulysses splits each
    sequence over an SP group: every activation outside attention (logits included) is held s/sp tokens per GPU,
    attention runs on the whole sequence for a/sp heads. `candidates` in the tree's order (make_plan passes the
    on-GPU ones first, then the offloading ones), and for each candidate the smallest size that fits: SP adds an
    all-to-all per attention and divides the data-parallel ranks."""
    sizes = sequence_parallel_sizes(inputs)[1:]
    if not sizes:
        return inputs, None, ["sequence parallelism: no size > 1 divides the GPUs, the heads and the sequence"]
    lines = []
    for candidate in candidates:
        for sp in sizes:
            trial = dataclasses.replace(inputs, sequence_parallel=sp)
            if stage_below_two_wasted(candidate.stage, trial.data_parallel_size):
                continue
            shot = best_shot(trial, candidate, 1)
            if shot.fits:
                lines.append(f"{candidate.name} + sequence parallel {sp} (DeepSpeed Ulysses): each GPU holds "
                             f"{inputs.seq_len // sp} of the {inputs.seq_len} tokens' activations -> fits at "
                             f"micro-batch 1 ({gb(shot.gpu_total)} of {gb(shot.gpu_budget)} GB per GPU) -> chosen")
                return trial, shot, lines
        widest = best_shot(dataclasses.replace(inputs, sequence_parallel=sizes[-1]), candidate, 1)
        lines.append(f"{candidate.name}: does not fit even at sequence parallel {sizes[-1]}: {widest.why_not()}")
    return inputs, None, lines


def sequence_parallel_notes(inputs: PlanInputs, chosen: Estimate) -> list[str]:
    sp = inputs.sp
    if sp == 1:
        return []
    m = inputs.model.config
    per_layer = mem.ulysses_all_to_all_bytes(m, inputs.seq_len, chosen.micro_batch, sp, inputs.precision)
    recompute = 1.5 if chosen.checkpointing else 1.0  # checkpointing repeats the forward's two all-to-alls
    fabric = "inside a node (NVLink)" if sp <= inputs.gpus_per_node else "across nodes: the network sets the pace"
    return [f"Ulysses all-to-all: {gb(per_layer * recompute)} GB sent per GPU per layer per micro-batch "
            f"({gb(per_layer * recompute * m.num_layers)} GB over {m.num_layers} layers), {fabric}; "
            f"{inputs.data_parallel_size} data-parallel group(s) of {sp} GPUs, each training one sequence at a time"]


def tiling_notes(inputs: PlanInputs, chosen: Estimate) -> list[str]:
    """What runs tiled along the sequence (DeepSpeed ALST), and what the planned config sets for it."""
    notes, m = [], inputs.model.config
    tokens = inputs.seq_len // inputs.sp * chosen.micro_batch * inputs.sequences_per_sample
    if chosen.logits_tiles:
        notes.append(f"tiled logits + loss: model.tiled_logits auto -> {chosen.logits_tiles} tiles of "
                     f"{tokens // chosen.logits_tiles} tokens (the trainer's rule: a GPU's share of a sequence x "
                     f"vocab >= 2^30 logits; DeepSpeed's TiledFusedLogitsLoss): the loss side holds "
                     f"{gb(chosen.activations.logits)} GB instead of {gb(12 * tokens * m.vocab_size)} GB")
    if chosen.mlp_tiles:
        notes.append(f"tiled MLP: model.tiled_mlp={chosen.mlp_tiles} (DeepSpeed's TiledMLP, ALST's tiles of ~hidden_size "
                     f"= {m.hidden_size} tokens), needed to fit after activation checkpointing: each layer keeps no "
                     f"SwiGLU tensors, one tile's exist at a time (one more MLP forward per layer in backward); "
                     f"set in the launch line")
    return notes


def checkpoint_offload_notes(inputs: PlanInputs, chosen: Estimate) -> list[str]:
    if not chosen.checkpoint_offload:
        return []
    host = chosen.activations.host
    return [f"activation checkpoint offload: deepspeed.activation_checkpointing.cpu_checkpointing=true (ALST's "
            f"checkpoint offload): every layer's checkpointed input but the newest waits for its backward in pinned "
            f"host memory, {gb(host)} GB per GPU ({gb(host * inputs.gpus_per_node)} GB per node"
            + ("" if inputs.cpu_ram_gb else ", not checked: give --cpu-ram-gb")
            + f"), copied over PCIe out in forward and back in backward: {gb(2 * host)} GB per GPU per micro-step; "
            f"set in the launch line"]


def expert_parallel_notes(inputs: PlanInputs, chosen: Estimate) -> list[str]:
    ep, m = inputs.expert_parallel, inputs.model.config
    if ep == 1:
        return []
    per_layer = mem.expert_all_to_all_bytes(m, inputs.seq_len, chosen.micro_batch, ep, inputs.precision)
    recompute = 1.5 if chosen.checkpointing else 1.0  # checkpointing repeats the forward's dispatch and combine
    fabric = "inside a node (NVLink)" if ep <= inputs.gpus_per_node else "across nodes: the network sets the pace"
    return [f"AutoEP all-to-all: {gb(per_layer * recompute)} GB sent per GPU per MoE layer per micro-batch "
            f"({gb(per_layer * recompute * m.num_layers)} GB over {m.num_layers} layers), {fabric}; each GPU holds "
            f"{m.num_experts // ep} of {m.num_experts} experts per layer (the ZeRO-3 largest layer shrinks with it)"]


def rocm_notes(inputs: PlanInputs) -> list[str]:
    """What changes on an AMD card (ROCm builds of torch and DeepSpeed): the collectives' library, and the fused
    kernels the trainer takes from CUDA builds by default."""
    if not inputs.gpu.rocm:
        return []
    return [f"ROCm ({inputs.gpu.name}): the collectives run on RCCL, which reads the same NCCL_* variables "
            f"(a `launch --fabric` profile applies as written; NCCL_DEBUG=INFO logs as RCCL); DeepSpeed's JIT ops "
            f"(fused_adam, cpu_adam) build with hipcc on the machine (scripts/build_ops.py there); model.liger and "
            f"attn_implementation flash_attention_2 need the ROCm builds of liger-kernel and flash-attn (the plan counts "
            f"attention 'auto' as sdpa, so its memory holds without flash-attn)"]


def add_zeropp(inputs: PlanInputs, chosen: Estimate) -> tuple[Estimate, Optional[str]]:
    """Seed step 6 #9: across nodes at stage 3, hpZ keeps parameter all-gathers inside the node, for 2P/g more
    per GPU. The estimate (with hpZ when it fits) and a note on the decision (None on one node or below stage 3)."""
    c = chosen.candidate
    if inputs.nodes == 1 or c.stage != 3:
        return chosen, None
    if c.offload_optimizer != "none":
        return chosen, "ZeRO++ hpZ not added: with offload the CPU/NVMe optimizer step, not the network, sets the pace"
    with_hpz = estimate(inputs, c, chosen.micro_batch, chosen.checkpointing, hpz_partition_size=inputs.gpus_per_node,
                        mlp_tiles=chosen.mlp_tiles)
    extra = gb(with_hpz.buffers - chosen.buffers)
    if with_hpz.fits:
        return with_hpz, (f"ZeRO++: hpZ {inputs.gpus_per_node} (node-local secondary partition, +{extra} GB per GPU) "
                          f"with quantized weights and gradients")
    return chosen, f"ZeRO++ hpZ would not fit (+{extra} GB per GPU); quantized gradients alone cost no memory"


def largest_micro_batch(inputs: PlanInputs, chosen: Estimate) -> tuple[Estimate, Optional[str]]:
    """Seed step 6 #3: the largest micro-batch that fits (and divides the per-rank share of the global batch),
    and the line that says why it is the largest (None: the micro-batch the user asked for fits)."""
    if inputs.micro_batch and chosen.micro_batch == inputs.micro_batch:
        return chosen, tight_line(chosen) if chosen.tight else None
    best = chosen

    def at(micro: int) -> Estimate:  # a tiled MLP keeps its tiles of ~hidden_size tokens at any micro-batch
        tiles = planned_mlp_tiles(inputs, micro) if chosen.mlp_tiles else 0
        return estimate(inputs, chosen.candidate, micro, chosen.checkpointing, chosen.hpz_partition_size,
                        mlp_tiles=tiles)
    for micro in micro_batch_options(inputs):
        shot = at(micro)
        if shot.roomy and micro > best.micro_batch:  # past TIGHT of the budget lint warns: not a plan's pick
            best = shot
    if best.tight:
        return best, tight_line(best)
    bigger = [m for m in micro_batch_options(inputs) if m > best.micro_batch]
    if bigger:
        shot = at(bigger[0])
        why = (f"would fill {gb(shot.peak)} of {gb(shot.gpu_budget)} GB per GPU, past {TIGHT:.0%} (lint warns)"
               if shot.fits else f"would need {gb(shot.peak)} GB per GPU")
        return best, f"micro-batch {best.micro_batch} is the largest that fits with room; {bigger[0]} {why}"
    return best, (f"micro-batch {best.micro_batch}: the largest option"
                  + (f" (the {inputs.global_batch // inputs.data_parallel_size} sequences per rank)"
                     if inputs.global_batch else f" (cap {MAX_MICRO_BATCH})"))


def tight_line(shot: Estimate) -> str:
    """The walk's line for a pick past TIGHT of the budget (nothing roomier fits): lint warns about it, and a preset
    written from the plan names it as an accepted trade-off (preset_file.header)."""
    return (f"micro-batch {shot.micro_batch} fills {gb(shot.peak)} of {gb(shot.gpu_budget)} GB per GPU, past "
            f"{TIGHT:.0%}: nothing roomier fits, so this is a trade-off to accept (`lint` warns about it)")


def what_would_fit(inputs: PlanInputs) -> list[str]:
    """For a plan that fits nowhere: more GPUs, host RAM, NVMe, or LoRA, each checked by planning again."""
    out = []
    if inputs.sequence_parallel is not None:  # the user fixed the size: would another one do?
        trial, shot, _ = smallest_sequence_parallel(dataclasses.replace(inputs, sequence_parallel=None))
        if shot is not None:
            out.append(f"sequence parallel {trial.sp}: {shot.candidate.name} fits (--sequence-parallel {trial.sp})")
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
    if not inputs.lora_enabled:
        task = "dpo-lora" if inputs.preference else "lora"
        lora = dataclasses.replace(inputs, task=task, reference="adapter" if inputs.preference else "auto")
        fitting = next((c for c in WALK if best_shot(lora, c, 1).fits), None)
        out.append(f"LoRA: fits with {fitting.name} (--task {task})" if fitting else "LoRA: does not fit either")
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
