"""The DeepSpeed config of ZeRO-Inference: ZeRO-3 with the parameters offloaded, no optimizer.

Each forward gathers one module's parameters onto the GPU and frees them after use, so the GPU holds the
KV cache, the activations and a bounded working set of parameters. The stage-3 limits below are written
out (not DeepSpeed's training defaults of 1e9 live parameters) so that the working set the planner prices
is the one the run gets.
"""
from __future__ import annotations

from typing import Any, Optional

from .build import aio_defaults


# Parameters with at most this many elements stay on the GPU (DeepSpeed's default, written explicitly
# so the planner's "persistent" term and the run agree): the RMSNorm weights and q/k/v biases.
PERSISTENCE_THRESHOLD = 100_000

PARAM_BUFFER_COUNT = 5          # DeepSpeed's default pool of NVMe read buffers per rank
MIN_PARAM_BUFFER_SIZE = int(1e8)  # DeepSpeed's default buffer size (elements)


def zero_inference_config(mode: str, nvme_path: Optional[str] = None, *, largest_layer: int,
                          dtype: str = "bf16") -> dict:
    """The config for `deepspeed.initialize(model=..., config=...)` then `engine.module.generate(...)`.

    mode is "zero-cpu" (parameters in pinned host RAM) or "zero-nvme" (on NVMe, read through pinned
    buffers). largest_layer is the most parameters one module owns: the prefetch bucket holds one such
    module while another computes (max live = 2 x largest), and every NVMe read buffer must hold the
    largest parameter, or DeepSpeed's swapper asserts."""
    if mode not in ("zero-cpu", "zero-nvme"):
        raise ValueError(f"ZeRO-Inference mode {mode!r} is not zero-cpu or zero-nvme")
    offload: dict[str, Any] = {"device": "cpu", "pin_memory": True}
    if mode == "zero-nvme":
        offload.update(device="nvme", nvme_path=nvme_path or "/local_nvme", buffer_count=PARAM_BUFFER_COUNT,
                       buffer_size=nvme_buffer_size(largest_layer))
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,  # DeepSpeed requires a batch size; generate() never steps
        "zero_optimization": {
            "stage": 3, "offload_param": offload,
            "stage3_prefetch_bucket_size": largest_layer, "stage3_max_live_parameters": 2 * largest_layer,
            # Llama uses each parameter once per forward: keep nothing gathered for a later reuse
            "stage3_max_reuse_distance": largest_layer,
            "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD,
        },
    }
    if dtype in ("bf16", "fp16"):
        ds[dtype] = {"enabled": True}
    if mode == "zero-nvme":
        ds["aio"] = aio_defaults()
    return ds


def nvme_buffer_size(largest_layer: int) -> int:
    """Elements per NVMe read buffer: DeepSpeed's default, or the largest module when that is bigger."""
    return max(MIN_PARAM_BUFFER_SIZE, largest_layer)


def init_inference_config(tp: int, dtype: str, kernel_inject: bool = False) -> dict:
    """The config for `deepspeed.init_inference(model, config=...)`: AutoTP over tp GPUs; kernel injection only
    when asked (AutoTP's sharding is what the planner prices; kernels would replace the layers)."""
    return {"tensor_parallel": {"tp_size": tp}, "dtype": dtype, "replace_with_kernel_inject": kernel_inject}
