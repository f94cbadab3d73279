"""One table of accelerator facts used by the validator, the planner and the MFU meter.

Peaks are dense bf16 (fp16 for V100, which has no bf16) tensor-core TFLOP/s from the vendors'
data sheets; memory is what the card reports, in GiB-ish vendor GB (we use 1e9 bytes).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gb: float      # device memory, 1e9 bytes
    bf16: bool            # hardware bf16 support (Ampere and newer)
    peak_tflops: float    # dense 16-bit tensor-core peak
    description: str
    # What PyTorch reports as the card's total (torch.cuda.get_device_properties().total_memory, the
    # "total capacity" in CUDA OOM messages), GiB: less than the marketing size, and what the planner budgets.
    usable_gib: float = 0.0

    @property
    def memory_bytes(self) -> int:
        """Device memory the allocator can see, in bytes (falls back to the vendor size)."""
        return int(self.usable_gib * 2**30) if self.usable_gib else int(self.memory_gb * 1e9)


GPUS: dict[str, Gpu] = {g.name: g for g in [
    Gpu("a100-40g", 40, True, 312, "NVIDIA A100 40GB SXM", 39.39),
    Gpu("a100-80g", 80, True, 312, "NVIDIA A100 80GB SXM", 79.15),
    Gpu("h100-80g", 80, True, 989, "NVIDIA H100 80GB SXM", 79.11),
    Gpu("h200", 141, True, 989, "NVIDIA H200 141GB SXM", 139.8),
    Gpu("v100-16g", 16, False, 125, "NVIDIA V100 16GB SXM2 (fp16 only)", 15.78),
    Gpu("v100-32g", 32, False, 125, "NVIDIA V100 32GB SXM2 (fp16 only)", 31.74),
    Gpu("l40s", 48, True, 362, "NVIDIA L40S 48GB", 44.39),
    Gpu("rtx4090", 24, True, 165, "NVIDIA GeForce RTX 4090 24GB", 23.65),
    # CPU ranks (tests, rehearsals): no GPU memory budget, fp32 only in practice.
    Gpu("cpu", 0, True, 0, "CPU ranks (gloo); fp32 recommended"),
]}

