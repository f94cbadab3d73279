"""Builders: DeepSpeed configs and `--set` overrides written from intent (stage, offload, precision, ...).

The planner writes configs through `base_config`/`zero_block`, the doctor and lint propose changes through
the `*_overrides` functions, and `rehearsal_changes` swaps what a CPU rehearsal cannot run.
"""
from __future__ import annotations

import copy
import json
import math
from typing import Any, Optional

from ..config import AUTO
from .keys import (
    cpu_checkpointing, has_activation_checkpointing, offload_block, offload_pin_memory, precision, quantized_weights,
    sequence_parallel_size, zero, zero_key, zero_setting, zero_stage,
)


def zero_block(stage: int, offload_optimizer: str = "none", offload_param: str = "none",
               nvme_path: Optional[str] = None) -> dict:
    """A `zero_optimization` block with the seed's recommended settings for that stage and offload."""
    block: dict[str, Any] = {"stage": stage, "contiguous_gradients": True, "overlap_comm": True}
    if stage in (1, 2):
        block.update(reduce_scatter=True, reduce_bucket_size=AUTO, allgather_bucket_size=5e8)
    if stage == 3:
        block.update(reduce_bucket_size=AUTO, stage3_prefetch_bucket_size=AUTO,
                     stage3_param_persistence_threshold=AUTO, stage3_gather_16bit_weights_on_model_save=True)
    if offload_optimizer != "none":
        block["offload_optimizer"] = _offload(offload_optimizer, nvme_path, buffer_count=4)
        if offload_optimizer == "nvme":
            block["offload_optimizer"].update(pipeline_read=True, pipeline_write=True, fast_init=True)
        if stage in (1, 2):
            block["round_robin_gradients"] = True
    if offload_param != "none":
        block["offload_param"] = _offload(offload_param, nvme_path, buffer_count=5)
    if "nvme" in (offload_optimizer, offload_param):
        block["sub_group_size"] = 1e9
    return block


def _offload(device: str, nvme_path: Optional[str], buffer_count: int) -> dict:
    block: dict[str, Any] = {"device": device, "pin_memory": True}
    if device == "nvme":
        block.update(nvme_path=nvme_path or "/local_nvme", buffer_count=buffer_count)
    return block


def aio_defaults() -> dict:
    """The seed's aio block with 0.19.8 key names (`thread_count` is `intra_op_parallelism` now)."""
    return {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1,
            "single_submit": False, "overlap_events": True}


def base_config(stage: int, offload_optimizer: str = "none", offload_param: str = "none",
                nvme_path: Optional[str] = None, precision_name: str = "bf16",
                activation_checkpointing: bool = False, checkpoint_offload: bool = False) -> dict:
    """A complete DeepSpeed config skeleton ("auto" batch/optimizer values, filled by `fill_auto`);
    `checkpoint_offload`: the checkpointed layer inputs kept in host memory (`keys.cpu_checkpointing`)."""
    ds: dict[str, Any] = {
        "train_batch_size": AUTO, "train_micro_batch_size_per_gpu": AUTO, "gradient_accumulation_steps": AUTO,
        "gradient_clipping": AUTO,
        "zero_optimization": zero_block(stage, offload_optimizer, offload_param, nvme_path),
        "optimizer": {"type": "AdamW", "params": {"lr": AUTO, "betas": AUTO, "eps": AUTO, "weight_decay": AUTO}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": AUTO, "warmup_max_lr": AUTO,
                                                          "warmup_num_steps": AUTO, "total_num_steps": AUTO}},
    }
    if precision_name == "bf16":
        ds["bf16"] = {"enabled": True}
    elif precision_name == "fp16":
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                      "hysteresis": 2, "min_loss_scale": 1}
    if "nvme" in (offload_optimizer, offload_param):
        ds["aio"] = aio_defaults()
    if activation_checkpointing:
        ds["activation_checkpointing"] = checkpointing_block(checkpoint_offload)
    return ds


def without_cpu_checkpointing(ds: dict) -> dict:
    """A copy whose activation checkpoints stay where they are computed."""
    return {**ds, "activation_checkpointing": {**ds["activation_checkpointing"], "cpu_checkpointing": False}}


def checkpointing_block(checkpoint_offload: bool = False) -> dict:
    return {"partition_activations": False, "cpu_checkpointing": checkpoint_offload}


def with_zeropp(ds: dict, hpz_partition_size: int, quantized_weights: bool = True,
                quantized_gradients: bool = True) -> dict:
    """A copy with ZeRO++ on (stage 3 only in 0.19.8): hpZ keeps a node-local secondary copy of the params so
    forward/backward all-gathers stay inside the node; weights and gradients cross nodes quantized."""
    ds = copy.deepcopy(ds)
    ds["zero_optimization"].update(zero_hpz_partition_size=hpz_partition_size,
                                   zero_quantized_weights=quantized_weights,
                                   zero_quantized_gradients=quantized_gradients)
    return ds


def with_sequence_parallel(ds: dict, sequence_parallel_size: int) -> dict:
    """A copy with DeepSpeed Ulysses' group size (top-level `sequence_parallel_size`): DeepSpeed 0.19.8 then checks
    its batch triad against world / sequence_parallel_size data-parallel ranks (runtime/config.py)."""
    ds = copy.deepcopy(ds)
    if sequence_parallel_size > 1:
        ds["sequence_parallel_size"] = sequence_parallel_size
    return ds


def with_expert_parallel(ds: dict, autoep_size: int) -> dict:
    """A copy with DeepSpeed AutoEP on over groups of `autoep_size` ranks (the `expert_parallel` section)."""
    ds = copy.deepcopy(ds)
    if autoep_size > 1:
        ds["expert_parallel"] = {"enabled": True, "autoep_size": autoep_size}
    return ds


# --- `--set` overrides (the planner's launch line and the doctor's proposals) ------------------


_ZERO_SWITCHES = ("stage", "round_robin_gradients", "sub_group_size", "zero_hpz_partition_size",
                  "zero_quantized_weights", "zero_quantized_gradients")


def set_override(path: str, value: Any) -> str:
    """`deepspeed.PATH=VALUE` for `--set` (JSON is YAML flow syntax; null deletes the key). A mapping is the whole
    new block (an offload block for another device): `:=`, which replaces what the preset and template had."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"deepspeed.{path}{':=' if isinstance(value, dict) else '='}{json.dumps(value)}"


USEFUL_BUCKET = (int(1e7), int(1e9))  # elements: below, many small collectives; above, late start and GBs of buffers
AUTO_BUCKETS = {"reduce_bucket_size": 1.0, "stage3_prefetch_bucket_size": 0.9}  # 'auto' = factor x hidden^2 (auto.py)


def bucket_floor_overrides(ds: dict, hidden_size: int) -> list[str]:
    """`--set` items for the 'auto' bucket sizes that hidden_size^2 (HF's rule, trainer.ds.auto) puts below the
    useful range lint checks -- a small model's: 896^2 = 8e5 elements, hundreds of small collectives a step --
    giving them the range's floor instead. None for a model of hidden size 3163 or more."""
    z = zero(ds)
    return [set_override(f"zero_optimization.{key}", USEFUL_BUCKET[0]) for key, factor in AUTO_BUCKETS.items()
            if z.get(key) == AUTO and factor * hidden_size * hidden_size < USEFUL_BUCKET[0]]


def bucket_overrides(current: dict, target: dict) -> list[str]:
    """`--set` items that give `current` the bucket sizes of `target` (a preset of another model: its buckets were
    sized for that model's hidden size, the plan's for this one)."""
    cz, tz = zero(current), zero(target)
    return [set_override(f"zero_optimization.{key}", tz[key]) for key in AUTO_BUCKETS
            if key in tz and key in cz and cz[key] != tz[key]]


def with_bucket_floor(ds: dict, hidden_size: int) -> dict:
    """`ds` with `bucket_floor_overrides` applied (the planner's own config)."""
    out = copy.deepcopy(ds)
    for key, factor in AUTO_BUCKETS.items():
        if zero(out).get(key) == AUTO and factor * hidden_size * hidden_size < USEFUL_BUCKET[0]:
            zero(out)[key] = USEFUL_BUCKET[0]
    return out


def zero_overrides(current: dict, target: dict) -> list[str]:
    """Overrides that move `current`'s stage, offload devices, round-robin and ZeRO++ settings to `target`'s.

    Tuned fields of an offload block that keeps its device are left alone; keys that would be errors or
    silently ignored after the move (round_robin at stage 3, ZeRO++ below 3, offload_param below 3) are removed."""
    cz, tz = zero(current), zero(target)
    out = []
    for key in _ZERO_SWITCHES:
        if key in tz and cz.get(key) != tz[key]:
            out.append(set_override(f"zero_optimization.{key}", tz[key]))
        elif key not in tz and key in cz and key != "sub_group_size":
            out.append(set_override(f"zero_optimization.{key}", None))
    for which in ("offload_optimizer", "offload_param"):
        now = (cz.get(which) or {}).get("device", "none")
        want = (tz.get(which) or {}).get("device", "none")
        if want == "none" and which in cz:
            out.append(set_override(f"zero_optimization.{which}", None))
        elif want != now:
            out.append(set_override(f"zero_optimization.{which}", tz[which]))
    if "aio" in target and "aio" not in current:
        out.append(set_override("aio", target["aio"]))
    return out


def precision_overrides(current: dict, precision_name: str) -> list[str]:
    """Overrides that make the bf16/fp16 blocks follow `train.precision=precision_name` (set that too)."""
    if precision(current) == precision_name:
        return []
    out = []
    for block in ("bf16", "fp16"):
        if block != precision_name and block in current:
            out.append(set_override(block, None))
    if precision_name == "bf16":
        out.append(set_override("bf16", {"enabled": AUTO}))
    elif precision_name == "fp16":
        fp16 = base_config(0, precision_name="fp16")["fp16"]
        out.append(set_override("fp16", {**fp16, "enabled": AUTO}))
    return out


def activation_checkpointing_overrides(current: dict, enabled: bool, offload: bool = False) -> list[str]:
    """The DeepSpeed block is only meaningful with model.gradient_checkpointing; drop it when that goes off. With
    `offload` the checkpoints go to host memory (cpu_checkpointing), the block written whole where it is missing."""
    if not enabled and has_activation_checkpointing(current):
        return [set_override("activation_checkpointing", None)]
    if enabled and offload and not cpu_checkpointing(current):
        if has_activation_checkpointing(current):
            return [set_override("activation_checkpointing.cpu_checkpointing", True)]
        return [set_override("activation_checkpointing", checkpointing_block(True))]
    return []


def gather_on_save_override(current: dict) -> str:
    return set_override(f"zero_optimization.{zero_key(current, 'gather_16bit_weights_on_model_save')}", True)


def min_loss_scale_override(value: float) -> str:
    return set_override("fp16.min_loss_scale", value)


def unpinned_offload_overrides(current: dict) -> list[str]:
    """Offload blocks with pin_memory off: page-locked host memory is limited (WSL2, containers with a small
    memlock limit) and an allocation there fails as a CUDA out-of-memory error."""
    return [set_override(f"zero_optimization.{which}.pin_memory", False)
            for which in ("offload_optimizer", "offload_param")
            if offload_block(current, which).get("device", "none") != "none" and offload_pin_memory(current, which)]


def client_optimizer_on_cpu_override() -> str:
    """Let ZeRO-Offload run an optimizer DeepSpeed did not build (a CPU optimizer of the user's)."""
    return set_override("zero_force_ds_cpu_optimizer", False)


def torch_adam_on_cpu_overrides() -> list[str]:
    """Offload with torch's AdamW on the CPU instead of the compiled DeepSpeedCPUAdam (5-7x slower step)."""
    return [set_override("zero_force_ds_cpu_optimizer", False), set_override("optimizer.params.torch_adam", True)]


# Stage-3 buffers the OOM ladder shrinks, with the floor below which halving stops paying.
_STAGE3_BUFFER_FLOORS = {"prefetch_bucket_size": int(1e7), "max_live_parameters": int(1e8),
                         "max_reuse_distance": int(1e8)}


def smaller_stage3_buffers(current: dict) -> list[str]:
    """Halve the stage-3 prefetch bucket, live-parameter and reuse-distance limits (never below a floor)."""
    out = []
    for name, floor in _STAGE3_BUFFER_FLOORS.items():
        value = int(zero_setting(current, name))
        if value > floor:
            out.append(set_override(f"zero_optimization.{zero_key(current, name)}", max(floor, value // 2)))
    return out


# --- rehearsal: the preset's DeepSpeed features on a toy model and the ranks present -------------


def rehearsal_changes(ds: dict, world_size: int, nvme_dir: str, on_cpu: bool) -> tuple[dict, list[str]]:
    """What must change for a CPU/laptop rehearsal, each with a one-line notice. Features stay on; only
    what the present hardware cannot do (or would need GBs for) is swapped."""
    ds = copy.deepcopy(ds)
    notices = []
    z = ds.get("zero_optimization") or {}
    for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
        if key in z and z[key] != AUTO:
            z[key] = AUTO  # 5e8-element buckets would allocate GBs for a toy model
            notices.append(f"zero_optimization.{key} -> 'auto' (sized for the shrunk model)")
    if "allgather_bucket_size" in z:
        z["allgather_bucket_size"] = 2e6
    for which in ("offload_optimizer", "offload_param"):
        block = z.get(which) or {}
        if block.get("device") == "nvme":
            block["nvme_path"] = nvme_dir
            notices.append(f"{which}.nvme_path -> {nvme_dir} (local directory)")
        if which == "offload_param" and "buffer_size" in block:
            block["buffer_size"] = 1e7
    sp = sequence_parallel_size(ds)
    if sp > 1 and world_size % sp:
        # gcd: still divides what sp divided (the heads), and the ranks present
        ds["sequence_parallel_size"] = math.gcd(sp, world_size)
        notices.append(f"sequence_parallel_size {sp} -> {ds['sequence_parallel_size']} (ranks present)")
    tp = ds.get("tensor_parallel") or {}
    if tp.get("autotp_size", 0) > 1 and world_size % tp["autotp_size"]:
        tp["autotp_size"] = world_size
        notices.append(f"tensor_parallel.autotp_size -> {world_size} (ranks present)")
    ep = ds.get("expert_parallel") or {}
    if isinstance(ep.get("autoep_size"), int) and ep["autoep_size"] > 1 and world_size % ep["autoep_size"]:
        size = math.gcd(ep["autoep_size"], world_size)  # still divides the experts, as autoep_size did
        notices.append(f"expert_parallel.autoep_size {ep['autoep_size']} -> {size} (ranks present)")
        ep["autoep_size"] = size
    if on_cpu:
        if quantized_weights(ds):
            z["zero_quantized_weights"] = False
            notices.append("zero_quantized_weights -> off (not implemented on DeepSpeed's CPU backend)")
        for block in ("bf16", "fp16"):
            if block in ds:
                ds[block]["enabled"] = AUTO  # filled from train.precision, which the rehearsal sets to fp32
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if key in ds:
            ds[key] = AUTO  # solved again from the rehearsal's batch
    return ds, notices


def frozen_reference_config(ds: dict, offload_param: bool) -> dict:
    """The config of a frozen reference model's engine (preference tuning), as DeepSpeed-Chat builds its reference:
    the training run's batch and precision, no optimizer or scheduler, ZeRO-3 (parameters sharded, optionally on the
    CPU) when training is ZeRO-3, else a whole copy on every rank (stage 0: nothing of a frozen model to shard)."""
    kept = {key: ds[key] for key in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                     "gradient_accumulation_steps", "bf16", "fp16", "steps_per_print",
                                     "wall_clock_breakdown") if key in ds}
    stage3 = zero_stage(ds) == 3
    zero_block_ = {"stage": 3 if stage3 else 0}
    if stage3:
        zero_block_["stage3_param_persistence_threshold"] = zero_setting(ds, "param_persistence_threshold") or int(1e4)
        if offload_param:
            zero_block_["offload_param"] = {"device": "cpu", "pin_memory": offload_pin_memory(ds, "offload_param")}
    return {**kept, "zero_optimization": zero_block_}


def frozen_reference_placement(ds: dict, offload_param: bool) -> str:
    """Where frozen_reference_config puts the reference, in words for the start-up line."""
    block = frozen_reference_config(ds, offload_param)["zero_optimization"]
    return f"ZeRO-{block['stage']}" + (", parameters offloaded to CPU memory" if "offload_param" in block else "")


def with_universal_load(ds: dict) -> dict:
    """A copy of `ds` whose `load_checkpoint` reads a universal checkpoint (ds_to_universal's layout, one folder
    per parameter): how a run resumes on another world size or ZeRO stage."""
    block = dict(ds.get("checkpoint") or {})
    block["load_universal"] = True
    return {**ds, "checkpoint": block}


def global_batch_overrides(grad_accum: int, global_batch_size: int) -> list[str]:
    """`--set` items that fix the accumulation and the global batch, with DeepSpeed's own batch keys left to be
    solved from them (a preset's numeric train_batch_size would otherwise disagree)."""
    return [f"train.grad_accum={grad_accum}", f"train.global_batch_size={global_batch_size}",
            "deepspeed.gradient_accumulation_steps=auto", "deepspeed.train_batch_size=auto"]


CHECKPOINT_WRITERS = {  # train.checkpoint_writer -> DeepSpeed's checkpoint.writer block (None: torch.save)
    "torch": None,
    "fast": {"type": "FAST", "decoupled": False, "data_parallel": "replica"},
    "decoupled": {"type": "FAST", "decoupled": True, "data_parallel": "replica"},
}


def with_checkpoint_writer(ds: dict, writer: str) -> dict:
    """A copy of `ds` whose checkpoints DeepSpeed writes with `writer` (deepspeed.runtime.checkpoint_engine:
    torch.save, the FAST writer over libaio, or FAST in a decoupled process)."""
    block = CHECKPOINT_WRITERS[writer]
    if block is None:
        return ds
    return {**ds, "checkpoint": {**(ds.get("checkpoint") or {}), "writer": dict(block)}}


def with_zero3_leaf_classes(ds: dict, classes: list[str]) -> dict:
    """A copy of `ds` whose zero_optimization.leaf_module lists exactly `classes` (the ones the trainer flagged), so
    DeepSpeed's own default list adds nothing the run did not ask for ([]: no leaf modules at all)."""
    block = {"classes": list(classes), "names": [], "name_suffixes": []}
    return {**ds, "zero_optimization": {**zero(ds), "leaf_module": block}}
