"""A plan for people (the table, the walk, the choice) and for programs (`--json`)."""
from __future__ import annotations

import json
from typing import Optional

from .estimate import GPU_HEADROOM, Estimate, Plan, budgets, gb


def plan_to_json(plan: Plan) -> dict:
    inputs = plan.inputs
    return {
        "model": {"label": inputs.model.label, "hidden_size": inputs.model.config.hidden_size,
                  "num_layers": inputs.model.config.num_layers, "vocab_size": inputs.model.config.vocab_size},
        "params": inputs.params,
        "active_params": inputs.active_params,
        "largest_layer_params": inputs.largest_layer,
        "lora_params": inputs.lora_params or None,
        "hardware": {"gpu": inputs.gpu.name, "gpu_memory_bytes": inputs.gpu.memory_bytes,
                     "gpus_per_node": inputs.gpus_per_node, "nodes": inputs.nodes, "cpu_ram_gb": inputs.cpu_ram_gb,
                     "nvme_gb": inputs.nvme_gb},
        "task": inputs.task, "seq_len": inputs.seq_len, "precision": inputs.precision,
        "reference": inputs.reference if inputs.preference or inputs.grpo else None,
        "sequences_per_sample": inputs.sequences_per_sample,
        "sequence_parallel_size": inputs.sp, "data_parallel_size": inputs.data_parallel_size,
        "expert_parallel_size": inputs.expert_parallel,
        "gpu_budget_bytes": budgets(inputs)[0],
        "candidates": [_estimate_json(e) for e in plan.rows],
        "walk": plan.walk,
        "choice": _choice_json(plan),
        "fits": plan.choice is not None,
        "suggestions": plan.suggestions,
        "notes": plan.notes,
        "preset": plan.preset,
        "preset_differences": plan.preset_differences,
        "preset_overrides": plan.preset_overrides,
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
            "checkpoint_offload_host_bytes_per_gpu": e.activations.host,
            "precompute_pass_gpu_bytes": e.precompute_pass or None,
            "rollout_gpu_bytes": e.rollout or None, "rollout_sets_peak": e.rollout_sets_peak,
            "fits": e.fits, "fits_gpu": e.fits_gpu, "fits_cpu": e.fits_cpu, "fits_nvme": e.fits_nvme}


def _choice_json(plan: Plan) -> Optional[dict]:
    if plan.choice is None:
        return None
    e = plan.choice
    return {**_estimate_json(e), "grad_accum": plan.grad_accum, "global_batch": plan.global_batch,
            "hpz_partition_size": e.hpz_partition_size, "sequence_parallel_size": plan.inputs.sp,
            "tiled_mlp": e.mlp_tiles, "tiled_logits": e.logits_tiles, "checkpoint_offload": e.checkpoint_offload}


def print_plan(plan: Plan) -> None:
    inputs = plan.inputs
    gpu_budget, cpu_budget, nvme_budget = budgets(inputs)
    lora = f", LoRA r={inputs.lora.r} ({inputs.lora_params / 1e6:.1f}M adapter params)" if inputs.lora_params else ""
    active = f", {inputs.active_params:,} active per token" if inputs.active_params != inputs.params else ""
    print(f"Plan: {inputs.model.label}: {inputs.params:,} params{active} (largest layer {inputs.largest_layer:,}){lora}")
    print(f"      {inputs.nodes} node(s) x {inputs.gpus_per_node} {inputs.gpu.description}, {inputs.task}, "
          f"seq {inputs.seq_len}, {inputs.precision}"
          + (f", reference {inputs.reference} (a micro-batch of pairs is twice the sequences)"
             if inputs.preference else "")
          + (f", sequence parallel {inputs.sp} ({inputs.seq_len // inputs.sp} tokens per GPU)" if inputs.sp > 1 else ""))
    runtime = "HIP context, RCCL" if inputs.gpu.rocm else "CUDA context, NCCL"
    print(f"Budget per GPU {gb(gpu_budget)} GB ({int(GPU_HEADROOM * 100)}% of {gb(inputs.gpu.memory_bytes)} GB kept for "
          f"{runtime}, fragmentation); host RAM per node "
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
    header = ("candidate", "ckpt", "params", "grads", "optim", "activ", "buffers", "ref", "GPU total", "CPU/node",
              "NVMe", "fits")
    widths = (20, 4, 7, 7, 7, 7, 8, 6, 10, 9, 7, 4)
    print("  ".join(f"{h:>{w}}" if i else f"{h:<{w}}" for i, (h, w) in enumerate(zip(header, widths))))
    for e in rows:
        b = e.gpu_bytes()
        cells = (e.candidate.name, "yes" if e.checkpointing else "no", gb(b["params"]), gb(b["gradients"]),
                 gb(b["optimizer"]), gb(b["activations"]), gb(b["buffers"]),
                 gb(b["reference"]) if b["reference"] else "-", gb(b["total"]),
                 gb(e.cpu_bytes_per_node), gb(e.nvme_bytes) if e.nvme_bytes else "-", "yes" if e.fits else "no")
        print("  ".join(f"{c:>{w}}" if i else f"{c:<{w}}" for i, (c, w) in enumerate(zip(cells, widths))))
    print(f"(GB per GPU at micro-batch {rows[0].micro_batch}; 'ckpt' = activation checkpointing needed to fit; "
          f"model states on DeepSpeed's accounting, host RAM with its 1.5x margin)")


def print_choice(plan: Plan) -> None:
    e, inputs = plan.choice, plan.inputs
    hpz = f" + ZeRO++ hpZ {e.hpz_partition_size}" if e.hpz_partition_size > 1 else ""
    hpz += f" + sequence parallel {inputs.sp}" if inputs.sp > 1 else ""
    print(f"Chosen: {e.candidate.name} ({e.candidate.label}{hpz}), micro-batch {e.micro_batch}, grad accumulation "
          f"{plan.grad_accum} -> {e.micro_batch} x {plan.grad_accum} x {inputs.data_parallel_size} = {plan.global_batch} "
          + (f"pairs ({2 * plan.global_batch} sequences, " if inputs.preference else "sequences (")
          + f"{plan.global_batch * inputs.sequences_per_sample * inputs.seq_len:,} tokens) per step, activation checkpointing "
          f"{'on' if e.checkpointing else 'off'}{' (in host memory)' if e.checkpoint_offload else ''}, {inputs.precision}")
    b = e.gpu_bytes()
    print(f"  per GPU {gb(b['total'])} GB = params {gb(b['params'])} + grads {gb(b['gradients'])} + optimizer "
          f"{gb(b['optimizer'])} + activations {gb(b['activations'])} (logits {gb(e.activations.logits)}) + buffers "
          f"{gb(b['buffers'])}" + (f" + reference {gb(b['reference'])}" if b["reference"] else "")
          + f"; host RAM {gb(e.cpu_bytes_per_node)} GB/node"
          + (f"; NVMe {gb(e.nvme_bytes)} GB/node" if e.nvme_bytes else ""))
    if e.rollout:
        print(f"  rollout (generation): {gb(e.rollout)} GB per GPU at its peak (states, the gathered model under ZeRO-3, "
              f"KV cache of {e.micro_batch} completions x {inputs.seq_len} tokens)"
              + (" - the rollout, not training, sets the memory peak" if e.rollout_sets_peak
                 else "; training sets the peak"))
    if e.precompute_pass:
        print(f"  reference log-probs precomputed: one pass over the data before training, {gb(e.precompute_pass)} GB "
              f"per GPU at its peak; nothing during training")
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


# --- inference (`plan --inference`) ------------------------------------------------------------


def inference_to_json(plan) -> dict:
    """The inference plan as one JSON object: inputs, the per-GPU breakdown, the placement and its config."""
    inputs, need, place = plan.inputs, plan.need, plan.placement
    return {
        "model": {"label": inputs.model.label, "hidden_size": inputs.model.config.hidden_size,
                  "num_layers": inputs.model.config.num_layers, "vocab_size": inputs.model.config.vocab_size},
        "model_weights_bytes": need.model_weights, "largest_layer_params": need.largest_layer,
        "hardware": {"gpu": inputs.gpu.name, "gpu_memory_bytes": inputs.gpu.memory_bytes,
                     "gpus_per_node": inputs.gpus_per_node, "nodes": inputs.nodes, "cpu_ram_gb": inputs.cpu_ram_gb,
                     "nvme_gb": inputs.nvme_gb},
        "batch": inputs.batch, "context": inputs.context, "tp": inputs.tp, "dtype": inputs.dtype,
        "per_gpu_bytes": {"weights": need.weights, "kv_cache": need.kv_cache, "logits": need.logits,
                          "activations": need.activations, "total": need.total},
        "zero_inference_gpu_bytes": need.zero_gpu,
        "placement": {"mode": place.mode, "reason": place.reason, "gpu_bytes": place.gpu_bytes,
                      "cpu_bytes_per_node": place.cpu_bytes, "nvme_bytes_per_node": place.nvme_bytes},
        "fits": place.mode != "none",
        "hints": plan.hints,
        "deepspeed_config": plan.deepspeed,
    }


def print_inference(plan) -> None:
    inputs, need, place = plan.inputs, plan.need, plan.placement
    print(f"Inference plan: {inputs.model.label}, batch {inputs.batch} x context {inputs.context}, {inputs.dtype}, "
          f"--tp {inputs.tp} on {inputs.gpu.description} ({gb(inputs.gpu.memory_bytes)} GB; GB = 1e9 bytes)")
    budget = int(inputs.gpu.memory_bytes * (1 - GPU_HEADROOM))
    print(f"  per GPU: weights {gb(need.weights)} + KV cache {gb(need.kv_cache)} + logits {gb(need.logits)} + "
          f"activations {gb(need.activations)} = {gb(need.total)} GB (budget {gb(budget)} GB)")
    if inputs.tp == 1:
        print(f"  ZeRO-Inference per GPU: parameters in flight {gb(need.zero_working)} + KV cache, logits and "
              f"activations = {gb(need.zero_gpu)} GB")
    print(f"Placement: {place.mode}: {place.reason}")
    for line in plan.hints:
        print(f"  - {line}")
    if plan.deepspeed is None and place.mode == "gpu":
        print("DeepSpeed: not needed (the model runs as it is on one GPU)")
    elif plan.deepspeed is not None:
        what = "deepspeed.init_inference config" if place.mode == "gpu" else "DeepSpeed config (ZeRO-Inference)"
        print(f"{what}:")
        print(json.dumps(plan.deepspeed, indent=2))
