"""The seed's decision tree: lowest stage that fits, checkpointing before a stage up, offload last, ZeRO++ hpZ
across nodes, then the largest micro-batch and the accumulation that reaches the global batch."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from .. import ds as dsc
from . import memory as mem
from .artifacts import launch_line, nearest_preset, planned_deepspeed_config
from .estimate import (
    CANDIDATES, HOST_HEADROOM, MAX_MICRO_BATCH, WALK, Estimate, Plan, best_shot, estimate, gb, micro_batch_options
)
from .inputs import PlanInputs


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
    plan.grad_accum = (dsc.accumulation(inputs.global_batch, plan.choice.micro_batch, inputs.world_size)
                       if inputs.global_batch else 1)  # largest_micro_batch chose a micro-batch that divides
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
