"""The DeepSpeed ops a run JIT-builds, read from its DeepSpeed config as DeepSpeed 0.19.8 chooses them: the
optimizer (DeepSpeedEngine._configure_basic_optimizer and get_optimizer_configuration: Adam/AdamW is
DeepSpeedCPUAdam when ZeRO offloads the optimizer, FusedAdam otherwise, torch's with `torch_adam`; Adagrad and
Lion have CPU ops when offloaded, Lamb and Lion fused ones), NVMe offload (the async_io op, which loads
pin_memory), and on CPU ranks the shared-memory all-reduce (comm/torch.py build_shm_op) when there is a peer.

`scripts/setup.sh PRESET` builds these ahead (scripts/build_ops.py), so a first run loads them in seconds.
"""
from __future__ import annotations

from .keys import offload_optimizer_device, offload_param_device

SHARED_MEMORY_COMM = "deepspeed_shm_comm"


def optimizer_ops(ds: dict) -> list[str]:
    """The op DeepSpeed's own optimizer needs (none for a client optimizer, which the config does not name)."""
    block = ds.get("optimizer") or {}
    name = str(block.get("type", "")).lower()
    params = block.get("params") or {}
    offloaded = offload_optimizer_device(ds) in ("cpu", "nvme")
    if name in ("adam", "adamw"):
        return [] if params.get("torch_adam") else ["cpu_adam" if offloaded else "fused_adam"]
    if name == "adagrad":
        return ["cpu_adagrad"] if offloaded else []
    if name == "lion":
        return ["cpu_lion" if offloaded else "fused_lion"]
    if name == "lamb":
        return ["fused_lamb"]
    return []


def jit_ops(ds: dict, world_size: int, accelerator: str) -> list[str]:
    """Every op a run of `ds` on `world_size` ranks of `accelerator` ('cpu', 'cuda', ...) loads, in load order."""
    ops = [SHARED_MEMORY_COMM] if accelerator == "cpu" and world_size > 1 else []
    ops += optimizer_ops(ds)
    if "nvme" in (offload_optimizer_device(ds), offload_param_device(ds)):
        ops.append("async_io")
    return ops
