"""An inference plan: the per-GPU need, where the weights go, the DeepSpeed config for that placement, and
when nothing fits, what would (each hint checked by placing again)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .. import ds as dsc
from . import memory as mem
from .estimate import GPU_HEADROOM, HOST_HEADROOM, gb
from .inference import InferenceMemory, Placement, choose_placement, inference_memory, pinned_weight_bytes
from .inference_inputs import InferenceInputs


@dataclass
class InferencePlan:
    inputs: InferenceInputs
    need: InferenceMemory
    placement: Placement
    hints: list[str] = field(default_factory=list)   # what would fit, when nothing does
    deepspeed: Optional[dict] = None  # ZeRO-Inference's config, init_inference's at --tp > 1; None: plain model


def _need(inputs: InferenceInputs, **changes) -> InferenceMemory:
    values = {"batch": inputs.batch, "context": inputs.context, "tp": inputs.tp, **changes}
    return inference_memory(inputs.model.config, values["batch"], values["context"], inputs.dtype, values["tp"],
                            inputs.model.params_override)


def _place(inputs: InferenceInputs, need: InferenceMemory) -> Placement:
    ram = None if inputs.cpu_ram_gb is None else int(inputs.cpu_ram_gb * mem.GB)
    return choose_placement(need, inputs.gpu.memory_bytes, ram, int((inputs.nvme_gb or 0) * mem.GB),
                            ranks_per_node=inputs.gpus_per_node, nodes=inputs.nodes)


def make_inference_plan(inputs: InferenceInputs) -> InferencePlan:
    need = _need(inputs)
    plan = InferencePlan(inputs, need, _place(inputs, need))
    mode = plan.placement.mode
    if mode == "none":
        plan.hints = what_would_fit(inputs)
    elif mode == "gpu" and inputs.tp > 1:
        plan.deepspeed = dsc.init_inference_config(inputs.tp, inputs.dtype)
    elif mode != "gpu":
        plan.deepspeed = dsc.zero_inference_config(mode, inputs.nvme_path, largest_layer=need.largest_layer,
                                                   dtype=inputs.dtype)
    return plan


def what_would_fit(inputs: InferenceInputs) -> list[str]:
    """More GPUs for AutoTP, --tp 1 for ZeRO-Inference, more host RAM or NVMe, a smaller batch or a
    shorter context: each checked by placing again."""
    out, need = [], _need(inputs)
    m = inputs.model.config
    kv_heads = m.num_kv_heads or m.num_heads
    for tp in (t for t in range(inputs.tp + 1, kv_heads + 1) if kv_heads % t == 0 and m.num_heads % t == 0):
        if _place(inputs, _need(inputs, tp=tp)).mode == "gpu":
            more = "" if tp <= inputs.world_size else f" (you gave {inputs.world_size}: --gpus-per-node {tp})"
            out.append(f"--tp {tp}: AutoTP over {tp} GPUs fits{more}")
            break
    if inputs.tp > 1 and (place := _place(inputs, _need(inputs, tp=1))).mode != "none":
        out.append(f"--tp 1: ZeRO-Inference ({place.mode}) fits, {gb(place.gpu_bytes)} GB per GPU")
    if inputs.tp == 1 and _zero_gpu_fits(inputs, need):
        out.append(_more_host(inputs, need))  # host size does not depend on batch or context
    else:
        out += [line for key in ("batch", "context") for line in _smaller(inputs, key)]
    return out or ["nothing tried fits: a smaller model, or GPUs with more memory"]


def _zero_gpu_fits(inputs: InferenceInputs, need: InferenceMemory) -> bool:
    return need.tp == 1 and need.zero_gpu <= inputs.gpu.memory_bytes * (1 - GPU_HEADROOM)


def _more_host(inputs: InferenceInputs, need: InferenceMemory) -> str:
    ram = pinned_weight_bytes(need, inputs.nodes) / (1 - HOST_HEADROOM)
    disk = need.model_weights / inputs.nodes / (1 - HOST_HEADROOM)
    return (f"ZeRO-Inference with --cpu-ram-gb {_whole_gb(ram)} (per node), or from NVMe with "
            f"--nvme-gb {_whole_gb(disk)}")


def _smaller(inputs: InferenceInputs, key: str) -> list[str]:
    """The first halving of --batch or --context that fits, or at which ZeRO-Inference's GPU side fits."""
    value = getattr(inputs, key) // 2
    while value >= 1:
        need = _need(inputs, **{key: value})
        if (place := _place(inputs, need)).mode != "none":
            return [f"--{key} {value}: {place.mode} fits"]
        if _zero_gpu_fits(inputs, need):
            return [f"--{key} {value} and {_more_host(inputs, need)}"]
        value //= 2
    return []


def _whole_gb(size: float) -> int:
    return -(-int(size) // int(mem.GB))
