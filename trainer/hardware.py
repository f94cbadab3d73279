"""One table of accelerator facts used by the validator, the planner and the MFU meter, and its lookups.

Peaks are dense bf16 (fp16 for V100, which has no bf16) tensor-core TFLOP/s from the vendors'
data sheets; memory is what the card reports, in GiB-ish vendor GB (we use 1e9 bytes).
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import UserError, closest


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


# What torch.cuda.get_device_name() contains -> the row it is (first match wins: "H100" before "A100").
_DEVICE_MARKERS = (("H200", "h200"), ("H100", "h100-80g"), ("A100", "a100-80g"), ("V100", "v100-32g"),
                   ("L40S", "l40s"), ("4090", "rtx4090"))


def gpu(name: str) -> Gpu:
    """The row of a `hardware.gpu` that `resolve` has already checked (a KeyError here is a bug)."""
    return GPUS[name]


def gpu_named(name: str, where: str, allow_cpu: bool = False) -> Gpu:
    """A GPU type a user typed (a flag, a scenario key), or a UserError naming `where` and the known types."""
    key = str(name).lower()
    known = [g for g in GPUS if g != "cpu" or allow_cpu]
    if key == "cpu" and not allow_cpu:
        raise UserError(f"{where}: 'cpu' ranks have no GPU memory to plan; give a GPU type ({', '.join(known)})")
    if key not in known:
        raise UserError(f"{where}: unknown GPU type {name!r}{_hint(key, known)}; known: {', '.join(known)} "
                        f"(add a row to trainer/hardware.py for another)")
    return GPUS[key]


def gpu_of_device(device_name: str | None) -> Gpu | None:
    """The row for a device torch names ("NVIDIA H100 80GB HBM3"), or None for an unknown one."""
    upper = (device_name or "").upper()
    return next((GPUS[key] for marker, key in _DEVICE_MARKERS if marker in upper), None)


def _hint(name: str, known: list[str]) -> str:
    """' (did you mean ...)': rows that start with what was typed (h100 -> h100-80g), else the closest."""
    prefixed = [g for g in known if g.startswith(name)]
    if prefixed:
        return f" (did you mean {' or '.join(repr(g) for g in prefixed)}?)"
    return closest(name, known)
