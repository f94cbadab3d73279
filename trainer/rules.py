"""Every cross-field rule in one place. Each rule reads the resolved config and returns problems (errors).
Rows marked "checked in ..." are caught earlier, where the value is first read. tests/rule_cases.py holds
one case per rule (and per earlier check), run through `resolve()` and through the CLI.

DeepSpeed 0.19.8 accepts several of these combinations and silently does something else; the table
says what it would do, which is why each is an error here.

| rule | DeepSpeed 0.19.8 on its own |
|---|---|
| offload_param needs stage 3 | ignores offload_param at stage 1/2 |
| offload_optimizer needs stage >= 1 | fails late in engine setup |
| NVMe offload needs stage 3, an existing writable nvme_path, optimizer buffer_count >= 4 | stage 1/2 treat 'nvme' as CPU |
| aio.thread_count is not a key (intra_op_parallelism is) | ignores it (checked in ds.check_keys) |
| AutoTP size divides the world size | asserts at engine start (checked in ds.solve_batch) |
| bf16 needs a GPU with bf16 (not V100) | fails or emulates slowly |
| fp16 and bf16 not both | raises at config parse (checked in ds.fill_auto: the one train.precision does not name disagrees) |
| fp16 not on CPU ranks | "Type fp16 is not supported on your device" |
| round_robin_gradients only at stage 1/2 | ignores it |
| zero_hpz_partition_size divides the world size | hangs or asserts |
| ZeRO++ (hpZ, quantized weights/gradients) needs stage 3 | only stage 3 reads the keys: silently nothing |
| quantized weights not on CPU ranks | "not implemented on CPU backend" |
| 1-bit / 0-1 optimizers are gone | raises (checked in ds.check_keys) |
| activation_checkpointing block needs model.gradient_checkpointing | the block does nothing alone |
| train.min_lr > 0 needs WarmupCosineLR | WarmupDecayLR decays to 0 regardless |
| gradient checkpointing turns the model's use_cache off | transformers warns every step (a notice here) |
| AutoTP size divides the attention and KV heads | shards unevenly or fails at engine start |
| LoRA target_modules name modules of the model | PEFT fails at model build, after data preparation |
| legacy zero_optimization.cpu_offload / cpu_offload_param | honoured with a warning (checked in ds.check_keys) |
| model.family is one the trainer builds (dense or MoE), MoE keys only on MoE families | transformers fails at build |
| model.zero3_leaf_modules needs stage 3, not with zero_optimization.leaf_module | only stage 3 reads leaf flags |
| expert_parallel: enabled with autoep_size, an MoE family, autoep_size divides world and experts; no LoRA/AutoTP/SP | ignores autoep_size without enabled; checks experts after building on every rank |
| sequence_parallel_size divides the world size, not with AutoTP | asserts in its group setup (checked in ds.solve_batch) |
| sequence_parallel_size divides the attention heads; KV heads divide by it or it by them | raises at model setup |
| sequence_parallel_size divides data.seq_len | raises at the first batch |
| sequence parallelism needs sdpa or flash attention | raises at model setup ('eager' needs a 4D mask) |
| sequence parallelism: no pipeline block, no sample_prompts | no Ulysses groups in the pipeline engine; generation unsharded |
| model.tiled_logits not with fp16, tied embeddings or preference tuning | fp16: the LM head's gradient misses the loss scale; tied: reduced twice (ZeRO-1/2 assert) or partly lost (ZeRO-3); DPO: unused |
| model.tiled_mlp only on dense families | (the trainer's own key) an MoE's fused experts are not tiled: nothing would be |
| data.cross_document_attention only where documents share a sequence (pretrain, packed SFT) | (the trainer's own key) ignored |
| grpo.* only with data.task=grpo; G >= 2 divides train.micro_batch_size; rewards named by a built-in or an import path; prompt room in data.seq_len; no sequence parallelism, AutoTP, several sources or tiled logits | (the trainer's own keys) ignored, or found after the engine is built |
| preference.* only with data.task=preference; label_smoothing < 0.5, only with loss=sigmoid; reference=adapter needs LoRA; reference_offload needs a reference engine at ZeRO-3 | (the trainer's own keys) ignored, or refused only once the engines are built |
"""
from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Callable

from . import ds as dsc
from . import hardware
from .config import BUILTIN_REWARDS, LLAMA_LIKE, LORA_TARGETS, Config, RewardSpec
from .errors import closest
from .moe import MOE_FAMILIES, expert_parallel_problems, family_problems


Rule = Callable[[Config, dict, int], list[str]]
IMPORT_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*")
FLOAT32_MAX = 3.4028234663852886e38
IPO_SMALLEST_BETA = 1.0001 / (2 * FLOAT32_MAX ** 0.5)  # (1/(2 beta))^2 stays below float32's largest number


def offload_param_needs_stage3(cfg: Config, ds: dict, world: int) -> list[str]:
    if dsc.offload_param_device(ds) != "none" and dsc.zero_stage(ds) != 3:
        return [f"deepspeed.zero_optimization.offload_param needs stage 3 (stage is {dsc.zero_stage(ds)}; "
                f"DeepSpeed would silently ignore it): set zero_optimization.stage=3 or remove offload_param"]
    return []


def offload_optimizer_needs_zero(cfg: Config, ds: dict, world: int) -> list[str]:
    if dsc.offload_optimizer_device(ds) != "none" and dsc.zero_stage(ds) == 0:
        return ["deepspeed.zero_optimization.offload_optimizer needs ZeRO stage 1, 2 or 3 (stage is 0)"]
    return []


def nvme_offload(cfg: Config, ds: dict, world: int) -> list[str]:
    problems = []
    for which, path, buffer_count in dsc.nvme_offloads(ds):
        key = f"deepspeed.zero_optimization.{which}"
        if dsc.zero_stage(ds) != 3:
            problems.append(f"{key}.device=nvme needs stage 3: stages 1/2 quietly treat 'nvme' as CPU and never "
                            f"use nvme_path; set zero_optimization.stage=3 or device=cpu")
        if not path:
            problems.append(f"{key}.nvme_path is missing: point it at a directory on a local NVMe drive")
        elif not Path(path).is_dir():
            problems.append(f"{key}.nvme_path {path!r} does not exist: create it or point it at a mounted NVMe drive")
        elif not os.access(path, os.W_OK):
            problems.append(f"{key}.nvme_path {path!r} is not writable by this user")
        if which == "offload_optimizer" and buffer_count < 4:
            problems.append(f"{key}.buffer_count={buffer_count} is too small: Adam swaps 4 state "
                            f"tensors per parameter group, use buffer_count >= 4")
    return problems


def bf16_needs_hardware(cfg: Config, ds: dict, world: int) -> list[str]:
    gpu = hardware.gpu(cfg.hardware.gpu)
    if dsc.bf16_enabled(ds) and not gpu.bf16:
        return [f"bf16 is enabled but {gpu.description} has no bf16: use fp16 with dynamic loss scaling "
                f"(--set train.precision=fp16 with an fp16 block, as in preset 7b_2xv100)"]
    return []


def cpu_ranks_precision(cfg: Config, ds: dict, world: int) -> list[str]:
    if cfg.hardware.gpu == "cpu" and dsc.fp16_enabled(ds):
        return ["fp16 is enabled on CPU ranks: DeepSpeed's CPU accelerator does not support fp16; use "
                "train.precision=fp32 (bf16 works but is ~13x slower on these CPUs)"]
    return []


def round_robin_needs_stage_1_2(cfg: Config, ds: dict, world: int) -> list[str]:
    if dsc.zero(ds).get("round_robin_gradients") and dsc.zero_stage(ds) not in (1, 2):
        return [f"deepspeed.zero_optimization.round_robin_gradients only works at stage 1/2 "
                f"(stage is {dsc.zero_stage(ds)}); remove it"]
    return []


def engine_build_constraints(cfg: Config, ds: dict, world: int) -> list[str]:
    """What DeepSpeed 0.19.8 asserts of these values only once the model and data are built (or divides by at the
    first step): checked here, before any work."""
    problems = []
    steps = ds.get("steps_per_print")
    if isinstance(steps, (int, float)) and not isinstance(steps, bool) and steps == 0:
        problems.append("deepspeed.steps_per_print=0: DeepSpeed takes the step modulo steps_per_print at every step "
                        "(a ZeroDivisionError at the first one); give a positive number, or null for never")
    bucket = dsc.zero(ds).get("allgather_bucket_size")
    if dsc.zero_stage(ds) in (1, 2) and isinstance(bucket, (int, float)) and not isinstance(bucket, bool) and \
            (bucket <= 0 or bucket != int(bucket) or int(bucket) % 2):
        problems.append(f"deepspeed.zero_optimization.allgather_bucket_size={bucket}: DeepSpeed's stage 1/2 optimizer "
                        f"needs a positive multiple of 2 (it asserts 'must be a multiple of nccl_start_alignment_factor' "
                        f"when the engine is built, after the model and data); e.g. "
                        f"{max(2, int(abs(bucket)) // 2 * 2)}")
    return problems


def zeropp_needs_stage3(cfg: Config, ds: dict, world: int) -> list[str]:
    used = [k for k, on in (("zero_hpz_partition_size", dsc.hpz_partition_size(ds) > 1),
                            ("zero_quantized_weights", dsc.quantized_weights(ds)),
                            ("zero_quantized_gradients", dsc.quantized_gradients(ds))) if on]
    if used and dsc.zero_stage(ds) != 3:
        return [f"ZeRO++ ({', '.join(used)}) needs stage 3: in DeepSpeed 0.19.8 only the stage-3 code reads these "
                f"keys, so at stage {dsc.zero_stage(ds)} they silently do nothing (the seed's template F on stage 2 "
                f"is outdated); set zero_optimization.stage=3"]
    return []


def hpz_divides_world(cfg: Config, ds: dict, world: int) -> list[str]:
    hpz = dsc.hpz_partition_size(ds)
    group = min(hpz, world)  # DeepSpeed's secondary-partition group size
    if hpz > 1 and world % group:
        return [f"deepspeed.zero_optimization.zero_hpz_partition_size={hpz} must divide the world size {world} "
                f"(normally it equals GPUs per node, {cfg.hardware.gpus_per_node})"]
    return []


def quantized_weights_need_gpu(cfg: Config, ds: dict, world: int) -> list[str]:
    if cfg.hardware.gpu == "cpu" and dsc.quantized_weights(ds):
        return ["deepspeed.zero_optimization.zero_quantized_weights is not implemented on DeepSpeed's CPU "
                "backend; turn it off on CPU ranks"]
    return []


def checkpoint_writer_known_and_runnable(cfg: Config, ds: dict, world: int) -> list[str]:
    writer = cfg.train.checkpoint_writer
    if writer not in dsc.CHECKPOINT_WRITERS:
        return [f"train.checkpoint_writer={writer!r} is not a writer: use one of {', '.join(dsc.CHECKPOINT_WRITERS)}"]
    if cfg.hardware.gpu == "cpu" and writer != "torch":
        return [f"train.checkpoint_writer={writer} does not run on CPU ranks (checked with DeepSpeed 0.19.8): the "
                f"FAST writer pins its I/O buffer on the accelerator ('Cannot access accelerator device when none is "
                f"available'), and the decoupled one fails its first save ('Cowardly refusing to serialize non-leaf "
                f"tensor which requires_grad'); use train.checkpoint_writer=torch on CPU"]
    return []


def ds_checkpointing_needs_model_flag(cfg: Config, ds: dict, world: int) -> list[str]:
    if dsc.has_activation_checkpointing(ds) and not cfg.model.gradient_checkpointing:
        return ["deepspeed.activation_checkpointing is set but model.gradient_checkpointing is false: the block "
                "does nothing on its own; set model.gradient_checkpointing=true or remove the block"]
    return []


def min_lr_needs_cosine(cfg: Config, ds: dict, world: int) -> list[str]:
    if cfg.train.min_lr > 0 and dsc.scheduler_type(ds) != "WarmupCosineLR":
        return [f"train.min_lr={cfg.train.min_lr} is only used by the WarmupCosineLR scheduler (scheduler is "
                f"{dsc.scheduler_type(ds)}, which decays to 0): set deepspeed.scheduler.type=WarmupCosineLR or "
                f"train.min_lr=0"]
    return []


def autotp_shards_heads(cfg: Config, ds: dict, world: int) -> list[str]:
    tp, m = dsc.autotp_size(ds), cfg.model
    kv = m.num_kv_heads or m.num_heads
    if tp > 1 and (m.num_heads % tp or kv % tp):
        fits = [d for d in range(1, kv + 1) if kv % d == 0 and m.num_heads % d == 0 and world % d == 0]
        return [f"deepspeed.tensor_parallel.autotp_size={tp} cannot shard model.num_heads={m.num_heads} and "
                f"num_kv_heads={kv} evenly (AutoTP gives every rank whole heads): use one of {fits}"]
    return []


def sequence_parallel_shards_heads(cfg: Config, ds: dict, world: int) -> list[str]:
    """DeepSpeed's own rule (UlyssesSPAttentionHF): every rank gets whole query heads; KV heads are split the same
    way, or replicated when there are fewer KV heads than ranks (sp a multiple of them)."""
    sp, m = dsc.sequence_parallel_size(ds), cfg.model
    kv = m.num_kv_heads or m.num_heads

    def shards(d: int) -> bool:
        return m.num_heads % d == 0 and (kv % d == 0 or d % kv == 0)

    if sp > 1 and not shards(sp):
        fits = [d for d in range(1, world + 1) if world % d == 0 and shards(d)]
        return [f"deepspeed.sequence_parallel_size={sp} cannot split model.num_heads={m.num_heads} and num_kv_heads="
                f"{kv} (Ulysses gives every rank whole query heads, and KV heads must divide by it or it by them): "
                f"use one of {fits}"]
    return []


def sequence_parallel_divides_seq_len(cfg: Config, ds: dict, world: int) -> list[str]:
    sp, seq_len = dsc.sequence_parallel_size(ds), cfg.data.seq_len
    if sp > 1 and seq_len % sp:
        return [f"data.seq_len={seq_len} is not divisible by deepspeed.sequence_parallel_size={sp} (each rank of the "
                f"group holds seq_len / {sp} tokens): use data.seq_len={seq_len // sp * sp or sp}"]
    return []


def sequence_parallel_supported(cfg: Config, ds: dict, world: int) -> list[str]:
    """What DeepSpeed 0.19.8's Ulysses path (or this trainer's use of it) does not do."""
    sp = dsc.sequence_parallel_size(ds)
    if sp == 1:
        return []
    key = f"deepspeed.sequence_parallel_size={sp}"
    problems = []
    if cfg.model.attn_implementation == "eager":
        problems.append(f"{key} needs model.attn_implementation sdpa, flash_attention_2 or auto: DeepSpeed's "
                        f"Ulysses attention refuses 'eager' (it needs a 4D attention mask, O(seq_len^2) memory)")
    if dsc.has_pipeline(ds):
        problems.append(f"{key} with a deepspeed.pipeline block: the pipeline engine has no Ulysses groups; remove "
                        f"deepspeed.pipeline or set deepspeed.sequence_parallel_size=1")
    if cfg.train.sample_prompts:
        problems.append(f"{key} with train.sample_prompts: generation is not sharded along the sequence; set "
                        f"train.sample_prompts=[] (run `python -m trainer generate` on the export instead)")
    if cfg.data.task == "preference":
        problems.append(f"{key} with data.task=preference: the DPO loss sums each response's log-probs over the "
                        f"whole sequence and is not sharded yet; set deepspeed.sequence_parallel_size=1")
    return problems


def tiled_logits_supported(cfg: Config, ds: dict, world: int) -> list[str]:
    """TiledFusedLogitsLoss runs the LM head's backward inside the forward, before DeepSpeed applies fp16's loss scale
    (in engine.backward): that gradient would stay unscaled while the rest is scaled."""
    tiles = cfg.model.tiled_logits or 0
    if tiles < 2:
        return []
    problems = []
    if dsc.precision(ds) == "fp16":
        problems.append(f"model.tiled_logits={tiles} with fp16: DeepSpeed's TiledFusedLogitsLoss computes the LM "
                        f"head's gradient inside the forward, where fp16's loss scale never reaches it; use "
                        f"train.precision=bf16 (or fp32), or model.tiled_logits=0")
    if cfg.model.tie_word_embeddings:
        problems.append(f"model.tiled_logits={tiles} with model.tie_word_embeddings: DeepSpeed's TiledFusedLogitsLoss "
                        f"hands ZeRO the LM head's gradient inside the forward, and a tied weight gets its embedding "
                        f"gradient later, in the backward (ZeRO-1/2 stop: 'Gradient computed twice'; ZeRO-3 drops "
                        f"part of it); set model.tiled_logits=0")
    if cfg.data.task == "preference":
        problems.append(f"model.tiled_logits={tiles} with data.task=preference: the DPO loss needs every token's "
                        f"log-prob, not the tiled cross-entropy; set model.tiled_logits=0")
    return problems


def tiled_mlp_has_dense_mlps(cfg: Config, ds: dict, world: int) -> list[str]:
    """train.sequence_parallel.tile_mlps tiles dense MLPs (gate/up/down projections); an MoE's experts are fused
    3D weights it does not touch, so the setting would do nothing (the planner plans no MLP tiles for MoEs)."""
    tiles = cfg.model.tiled_mlp
    dense_layers = pretrained_config(cfg).get("mlp_only_layers")  # a Qwen3-MoE's dense layers would be tiled
    if tiles >= 2 and model_type(cfg) in MOE_FAMILIES and not dense_layers:
        return [f"model.tiled_mlp={tiles} with the MoE model {model_type(cfg)}: TiledMLP tiles dense MLPs, and the "
                f"experts here are fused weights it does not run, so nothing would be tiled; set model.tiled_mlp=0 "
                f"(sequence parallelism or activation checkpointing cut long-sequence memory instead)"]
    return []


def cross_document_attention_applies(cfg: Config, ds: dict, world: int) -> list[str]:
    """data.cross_document_attention is about documents sharing a packed sequence: preference pairs and unpacked SFT
    have one document per sequence, so an explicit value there would be ignored."""
    d = cfg.data
    if d.cross_document_attention is None or (d.task == "pretrain" or (d.task == "sft" and d.packing)):
        return []
    where = "preference pairs are never packed" if d.task == "preference" else "data.packing=false puts one " \
                                                                               "document in each sequence"
    return [f"data.cross_document_attention={d.cross_document_attention} with data.task={d.task}: {where}, so "
            f"there is no other document to attend to; remove the setting"]


def preference_settings(cfg: Config, ds: dict, world: int) -> list[str]:
    """The preference section's combinations that would be ignored, or refused only once the engines are built
    (train/preference.py reads these values; its reference kinds are 'auto' = adapter for LoRA, else engine)."""
    p, lora = cfg.preference, cfg.model.lora.enabled
    if cfg.data.task != "preference":
        changed = [f"preference.{f.name}" for f in dataclasses.fields(p) if getattr(p, f.name) != f.default]
        return [f"{', '.join(changed)} set, but data.task={cfg.data.task}: the preference section is only read for "
                f"preference pairs; set data.task=preference or remove it"] if changed else []
    d = cfg.data
    problems = [f"data.{name}_field={column!r} is also data.{other}_field: a record's {name} and {other} would be the "
                f"same text; name the column that holds each" for name, other, column in (
                    ("chosen", "rejected", d.chosen_field), ("prompt", "chosen", d.prompt_field),
                    ("prompt", "rejected", d.prompt_field))
                if column == getattr(d, f"{other}_field")]
    if p.label_smoothing >= 0.5:
        problems.append(f"preference.label_smoothing={p.label_smoothing}: at 0.5 or more the flipped pairs outweigh "
                        f"the rest; use a value below 0.5")
    if p.label_smoothing and p.loss != "sigmoid":
        problems.append(f"preference.label_smoothing={p.label_smoothing} with preference.loss={p.loss}: only the "
                        f"sigmoid (cDPO) loss reads it; set label_smoothing=0 or loss=sigmoid")
    target = 1 / (2 * p.beta) if p.beta > 0 else float("inf")
    if p.loss == "ipo" and not target * target < FLOAT32_MAX:  # the loss is computed in float32 at least
        problems.append(f"preference.beta={p.beta} with preference.loss=ipo: IPO's loss is (margin - 1/(2 beta))^2 and "
                        f"1/(2 beta) = {target:.3g} squared is past float32's range (every step's loss would be "
                        f"infinite and skipped); use beta >= {IPO_SMALLEST_BETA:.1e}")
    if p.reference == "adapter" and not lora:
        problems.append("preference.reference=adapter uses the LoRA base model as the reference, but "
                        "model.lora.enabled is false: enable LoRA or set preference.reference=engine (or auto)")
    engine = p.reference == "engine" or (p.reference in ("auto", "precomputed") and not lora)
    if p.reference_offload and (not engine or dsc.zero_stage(ds) != 3):
        why = f"stage is {dsc.zero_stage(ds)}" if engine else "the reference is the LoRA base (no engine)"
        problems.append(f"preference.reference_offload offloads a reference engine's parameters at ZeRO-3, but {why}: "
                        f"set deepspeed.zero_optimization.stage=3 with preference.reference=engine, or remove it")
    return problems


def reward_problems(spec: RewardSpec, index: int) -> list[str]:
    """What is wrong with one grpo.rewards entry, without importing anything (resolve time)."""
    key = f"grpo.rewards[{index}].name"
    if spec.name in BUILTIN_REWARDS:
        problems = []
        if spec.pattern is not None:
            if spec.name != "format":
                problems.append(f"grpo.rewards[{index}].pattern is only read by the 'format' reward (this is "
                                f"{spec.name!r}): remove it")
            else:
                try:
                    re.compile(spec.pattern)
                except re.error as err:
                    problems.append(f"grpo.rewards[{index}].pattern {spec.pattern!r} is not a regular expression "
                                    f"({err}): fix it, or remove it to check the answer format")
        return problems
    if ":" in spec.name or "." in spec.name:
        if not IMPORT_PATH.fullmatch(spec.name):
            return [f"{key}: {spec.name!r} is not an import path: write 'package.module:function' (a module Python "
                    f"can import from the working directory or PYTHONPATH, and a function in it)"]
        return []
    return [f"{key}: unknown reward {spec.name!r}{closest(spec.name, BUILTIN_REWARDS)}; built-in: "
            f"{', '.join(BUILTIN_REWARDS)}, or your own function as 'package.module:function'"]


def grpo_settings(cfg: Config, ds: dict, world: int) -> list[str]:
    """The grpo section's values (train/rl/ reads them): a group of at least 2, whole groups per micro-batch, rewards
    that name something, room for a prompt, and the features the rollout does not shard."""
    g, d = cfg.grpo, cfg.data
    if d.task != "grpo":
        changed = [f"grpo.{f.name}" for f in dataclasses.fields(g) if getattr(g, f.name) != getattr(type(g)(), f.name)]
        return [f"{', '.join(changed)} set, but data.task={d.task}: the grpo section is only read for RL on prompts; "
                f"set data.task=grpo or remove it"] if changed else []
    problems = []
    if g.num_generations < 2:
        problems.append(f"grpo.num_generations={g.num_generations}: GRPO compares completions within a group of the "
                        f"same prompt, and one completion has nothing to compare with (its advantage is always 0); "
                        f"use at least 2 (8 or 16 as published recipes)")
    micro = cfg.train.micro_batch_size
    if isinstance(micro, int) and g.num_generations >= 1 and micro % g.num_generations:
        problems.append(f"train.micro_batch_size={micro} counts completions and must hold whole groups of "
                        f"grpo.num_generations={g.num_generations}: use a multiple of it (e.g. {g.num_generations})")
    if not g.rewards:
        problems.append("grpo.rewards is empty: name at least one reward (exact_match, format, length_penalty or "
                        "'package.module:function')")
    for index, spec in enumerate(g.rewards):
        problems += reward_problems(spec, index)
    if g.rewards and not any(spec.weight > 0 for spec in g.rewards):
        problems.append("grpo.rewards: every weight is 0, so every advantage is 0 and nothing is learnt; give one "
                        "reward a positive weight")
    if g.max_new_tokens >= d.seq_len:
        problems.append(f"grpo.max_new_tokens={g.max_new_tokens} leaves no room for a prompt in data.seq_len="
                        f"{d.seq_len}: raise data.seq_len or lower grpo.max_new_tokens")
    if g.epsilon_high is not None and g.epsilon_high < g.epsilon:
        problems.append(f"grpo.epsilon_high={g.epsilon_high} is below grpo.epsilon={g.epsilon}: clip-higher widens "
                        f"the upper range; set it >= epsilon or remove it")
    if d.sources:
        problems.append("data.sources with data.task=grpo: GRPO reads one prompts file; give data.source")
    if dsc.sequence_parallel_size(ds) > 1 or dsc.autotp_size(ds) > 1:
        problems.append("data.task=grpo with sequence parallelism or AutoTP: rollouts are generated on each rank's "
                        "whole model and not sharded; set deepspeed.sequence_parallel_size=1 and no tensor_parallel")
    if (cfg.model.tiled_logits or 0) >= 2:
        problems.append(f"model.tiled_logits={cfg.model.tiled_logits} with data.task=grpo: the loss needs every "
                        f"completion token's log-prob, not the tiled cross-entropy; set model.tiled_logits=0")
    return problems


def lora_targets_exist(cfg: Config, ds: dict, world: int) -> list[str]:
    lora = cfg.model.lora
    if not lora.enabled or model_type(cfg) not in LLAMA_LIKE:
        return []
    if not lora.target_modules:
        return [f"model.lora.target_modules is empty: LoRA would train nothing; name some of {', '.join(LORA_TARGETS)}"]
    return [f"model.lora.target_modules: {name!r} names no module of the model{closest(name, LORA_TARGETS)}; "
            f"targets are {', '.join(LORA_TARGETS)}" for name in lora.target_modules if name not in LORA_TARGETS]


def model_family_buildable(cfg: Config, ds: dict, world: int) -> list[str]:
    return family_problems(cfg.model, model_type(cfg))


def zero3_leaf_modules_need_stage3(cfg: Config, ds: dict, world: int) -> list[str]:
    asked = cfg.model.zero3_leaf_modules
    if asked is None:
        return []
    if dsc.zero3_leaf_block(ds) is not None:
        return ["model.zero3_leaf_modules and deepspeed.zero_optimization.leaf_module both name ZeRO-3 leaf modules: "
                "keep one (model.zero3_leaf_modules is checked against the model before any step)"]
    if asked and dsc.zero_stage(ds) != 3:
        return [f"model.zero3_leaf_modules only matters at ZeRO stage 3 (stage is {dsc.zero_stage(ds)}; DeepSpeed "
                f"would ignore it): set zero_optimization.stage=3 or remove model.zero3_leaf_modules"]
    return []


def expert_parallel_fits(cfg: Config, ds: dict, world: int) -> list[str]:
    return expert_parallel_problems(dsc.expert_parallel(ds), world, model_type(cfg), _num_experts(cfg),
                                    cfg.model.lora.enabled, dsc.autotp_size(ds), dsc.sequence_parallel_size(ds))


def pretrained_config(cfg: Config) -> dict:
    """The pretrained model's config.json when it is on disk ({} for an inline model, a hub id or a bad file)."""
    import json
    path = cfg.model.name_or_path
    config = Path(path).expanduser() / "config.json" if path else None
    if config is None or not config.is_file():
        return {}
    try:
        loaded = json.loads(config.read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def _num_experts(cfg: Config):
    """Experts per layer: the pretrained config's (Mixtral's num_local_experts, Qwen3-MoE's num_experts) or the
    inline model's."""
    saved = pretrained_config(cfg)
    return saved.get("num_local_experts") or saved.get("num_experts") or cfg.model.num_experts


def model_type(cfg: Config) -> str:
    """The pretrained model's model_type when its config.json is on disk, else model.family (a hub id is assumed
    to be what the preset says)."""
    return str(pretrained_config(cfg).get("model_type", cfg.model.family))


RULES: list[Rule] = [
    offload_param_needs_stage3, offload_optimizer_needs_zero, nvme_offload, bf16_needs_hardware,
    cpu_ranks_precision, round_robin_needs_stage_1_2, engine_build_constraints,
    zeropp_needs_stage3, hpz_divides_world, quantized_weights_need_gpu, checkpoint_writer_known_and_runnable,
    ds_checkpointing_needs_model_flag,
    min_lr_needs_cosine, autotp_shards_heads, sequence_parallel_shards_heads, sequence_parallel_divides_seq_len,
    sequence_parallel_supported, tiled_logits_supported, tiled_mlp_has_dense_mlps, preference_settings, grpo_settings,
    cross_document_attention_applies,
    lora_targets_exist, model_family_buildable, zero3_leaf_modules_need_stage3, expert_parallel_fits,
]


def check_rules(cfg: Config, ds: dict, world: int) -> list[str]:
    return [problem for rule in RULES for problem in rule(cfg, ds, world)]


def notices(cfg: Config, ds: dict, world: int) -> list[str]:
    """Things the user should know that are not errors."""
    out = []
    if cfg.deepspeed_template and "/" in cfg.deepspeed_template:  # presets.template_source: read from a path
        out.append(f"deepspeed_template read from {cfg.deepspeed_template} (not presets/deepspeed/)")
    if cfg.model.gradient_checkpointing:
        out.append("gradient checkpointing is on: the model's use_cache is turned off for training")
    if cfg.model.trust_remote_code:
        out.append("trust_remote_code is ON: code from the model's hub repo will run")
    if dsc.zero_stage(ds) == 0 and dsc.precision(ds) == "fp32":
        out.append("ZeRO stage 0 in fp32 has no overflow check: a non-finite step cannot be skipped, so the run "
                   "stops at the first one (ZeRO >= 1 or bf16/fp16 skip it and go on)")
    if cfg.hardware.gpu == "cpu" and dsc.bf16_enabled(ds):
        out.append("bf16 on CPU ranks is ~13x slower than fp32 here; train.precision=fp32 is the CPU choice")
    return out
