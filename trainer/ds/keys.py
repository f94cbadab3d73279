"""Accessors: what a DeepSpeed config says, asked by name (`zero_stage(ds)`, `offload_param_device(ds)`, ...).

A DeepSpeed key rename is a change here; no other module spells these keys.
"""
from __future__ import annotations

from typing import Optional

from ..config import AUTO


def leaf_paths(ds: dict, prefix: str = "") -> dict[str, object]:
    """Every setting of a config as a dotted path and its value (zero_optimization.stage -> 3): how a message
    that names a key is matched to the config."""
    out: dict[str, object] = {}
    for key, value in ds.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(leaf_paths(value, f"{path}."))
        else:
            out[path] = value
    return out


def zero(ds: dict) -> dict:
    return ds.get("zero_optimization") or {}


def zero_stage(ds: dict) -> int:
    return int(zero(ds).get("stage", 0))


def offload_optimizer_device(ds: dict) -> str:
    """'none', 'cpu' or 'nvme'."""
    return str((zero(ds).get("offload_optimizer") or {}).get("device", "none"))


def offload_param_device(ds: dict) -> str:
    return str((zero(ds).get("offload_param") or {}).get("device", "none"))


def offload_block(ds: dict, which: str) -> dict:
    """`which` is 'offload_optimizer' or 'offload_param'."""
    return zero(ds).get(which) or {}


def nvme_offloads(ds: dict) -> list[tuple[str, Optional[str], int]]:
    """(block name, nvme_path, buffer_count) of each offload block that targets NVMe."""
    out = []
    for which in ("offload_optimizer", "offload_param"):
        block = offload_block(ds, which)
        default_buffers = 4 if which == "offload_optimizer" else 5  # DeepSpeed's defaults
        if block.get("device") == "nvme":
            out.append((which, block.get("nvme_path"), int(block.get("buffer_count", default_buffers))))
    return out


def autotp_size(ds: dict) -> int:
    return int((ds.get("tensor_parallel") or {}).get("autotp_size", 0) or 1)


def expert_parallel(ds: dict) -> dict:
    """DeepSpeed's AutoEP section (`expert_parallel`: enabled, autoep_size, use_grouped_mm, ...)."""
    return ds.get("expert_parallel") or {}


def autoep_size(ds: dict) -> int:
    """The ranks that share one copy of the experts under AutoEP (1 = off: every rank holds every expert)."""
    block = expert_parallel(ds)
    return int(block.get("autoep_size", 1) or 1) if block.get("enabled") else 1


def sequence_parallel_size(ds: dict) -> int:
    """Ulysses sequence parallelism (DeepSpeed's top-level key; 1 = off): the ranks that share one sequence."""
    return int(ds.get("sequence_parallel_size", 1) or 1)


def cpu_checkpointing(ds: dict) -> bool:
    """DeepSpeed's activation checkpoint offload (ALST's "activation checkpoint offload to CPU"): with
    activation_checkpointing.cpu_checkpointing, deepspeed.checkpointing keeps each checkpointed layer input in host
    memory until its backward (0.19.8: one asynchronous offload engine, the newest input kept on the GPU)."""
    return bool((ds.get("activation_checkpointing") or {}).get("cpu_checkpointing", False))


def has_pipeline(ds: dict) -> bool:
    return bool(ds.get("pipeline"))


def bf16_enabled(ds: dict) -> bool:
    return bool((ds.get("bf16") or {}).get("enabled", False))


def fp16_enabled(ds: dict) -> bool:
    return bool((ds.get("fp16") or {}).get("enabled", False))


def precision(ds: dict) -> str:
    return "bf16" if bf16_enabled(ds) else "fp16" if fp16_enabled(ds) else "fp32"



def scheduler_type(ds: dict) -> Optional[str]:
    return (ds.get("scheduler") or {}).get("type")


def micro_batch_size(ds: dict) -> int:
    return int(ds["train_micro_batch_size_per_gpu"])



def hpz_partition_size(ds: dict) -> int:
    return int(zero(ds).get("zero_hpz_partition_size", 1))


def quantized_weights(ds: dict) -> bool:
    return bool(zero(ds).get("zero_quantized_weights", False))


def quantized_gradients(ds: dict) -> bool:
    return bool(zero(ds).get("zero_quantized_gradients", False))


def gather_16bit_on_save(ds: dict) -> bool:
    z = zero(ds)
    return bool(z.get("stage3_gather_16bit_weights_on_model_save", z.get("gather_16bit_weights_on_model_save", False)))


def has_activation_checkpointing(ds: dict) -> bool:
    return "activation_checkpointing" in ds


def aio_block(ds: dict) -> dict:
    return ds.get("aio") or {}


def without_tensor_parallel(ds: dict) -> dict:
    """The config for transformers' HfDeepSpeedConfig: with the `tensor_parallel` block, transformers 5.x
    refuses sharded loading (NotImplementedError), so it gets the config without it (see notes)."""
    return {k: v for k, v in ds.items() if k != "tensor_parallel"}


# DeepSpeed 0.19.8 defaults of the keys below (runtime/zero/config.py), used when a config omits them.
_ZERO_DEFAULTS = {"reduce_bucket_size": int(5e8), "allgather_bucket_size": int(5e8), "prefetch_bucket_size": int(5e7),
                  "max_live_parameters": int(1e9), "max_reuse_distance": int(1e9),
                  "param_persistence_threshold": int(1e5), "sub_group_size": int(1e9)}


_STAGE3_ALIASED = ("prefetch_bucket_size", "max_live_parameters", "max_reuse_distance", "param_persistence_threshold",
                   "gather_16bit_weights_on_model_save")


def zero_key(ds: dict, name: str) -> str:
    """The spelling of a ZeRO key this config uses: stage-3 keys have a `stage3_` alias, and giving both is an
    error, so an override must reuse whichever is present (the prefixed one when neither is)."""
    if name not in _STAGE3_ALIASED:
        return name
    return name if name in zero(ds) else f"stage3_{name}"


def zero_setting(ds: dict, name: str):
    """A ZeRO setting (either spelling), or DeepSpeed's default."""
    z = zero(ds)
    for key in (name, f"stage3_{name}"):
        if key in z and z[key] != AUTO:
            return z[key]
    return _ZERO_DEFAULTS.get(name)


def overlap_comm(ds: dict) -> bool:
    """DeepSpeed's default is on at stage 3 only."""
    return bool(zero(ds).get("overlap_comm", zero_stage(ds) == 3))


def contiguous_gradients(ds: dict) -> bool:
    return bool(zero(ds).get("contiguous_gradients", True))


def offload_pin_memory(ds: dict, which: str) -> bool:
    return bool(offload_block(ds, which).get("pin_memory", False))


def nvme_pipelined(ds: dict) -> bool:
    """Whether optimizer NVMe swaps overlap with compute (pipeline_read and pipeline_write)."""
    block = offload_block(ds, "offload_optimizer")
    return bool(block.get("pipeline_read", False)) and bool(block.get("pipeline_write", False))


def fp16_min_loss_scale(ds: dict) -> float:
    return float((ds.get("fp16") or {}).get("min_loss_scale", 1))


def forces_ds_cpu_optimizer(ds: dict) -> bool:
    """DeepSpeed insists on DeepSpeedCPUAdam for CPU offload unless this is turned off."""
    return bool(ds.get("zero_force_ds_cpu_optimizer", True))


def zero3_leaf_block(ds: dict) -> dict | None:
    """The config's own zero_optimization.leaf_module block (DeepSpeed applies it at engine start; its default lists
    transformers' Mixtral / Qwen2-MoE / Qwen3-MoE blocks), None when the config has none."""
    return zero(ds).get("leaf_module")
