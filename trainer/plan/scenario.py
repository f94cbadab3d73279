"""Scenario files (scenarios/*.yaml): the planner's inputs plus what it is expected to recommend.

A scenario is read with the same strict loader as a preset: unknown keys (with the closest valid one) and
wrong types anywhere, `expect` and `lora` included, are reported together, each naming the file.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional, Union

from .. import strict
from ..config import LoraConfig, doc
from ..errors import UserError, closest
from ..files import read_yaml_mapping
from ..paths import is_there
from ..presets import REPO_ROOT


SCENARIO_DIR = REPO_ROOT / "scenarios"


@dataclass
class Expect:
    candidate: Optional[str] = doc("Candidate the planner must choose (zero2, zero3_cpu_optimizer, ...).")
    stage: Optional[int] = doc("Its ZeRO stage.")
    offload_optimizer: Optional[str] = doc("Its optimizer offload device (none, cpu, nvme).")
    offload_param: Optional[str] = doc("Its parameter offload device (none, cpu, nvme).")
    micro_batch: Optional[tuple[int, int]] = doc("[low, high]: the chosen micro-batch lies in this range.")
    activation_checkpointing: Optional[bool] = doc("Whether the plan turns activation checkpointing on.")
    hpz_partition_size: Optional[int] = doc("ZeRO++ hpZ partition size of the plan (1 = none).")
    preset: Optional[str] = doc("The nearest shipped preset the plan names (for a model no preset ships, the one "
                                "its launch line makes that model).")
    fits: Optional[bool] = doc("false: nothing fits, and the planner says what would.")
    suggestions_mention: Optional[list[str]] = doc("Words the 'what would fit' suggestions contain.")


@dataclass
class Scenario:
    description: str = doc("One line: the model, task and hardware.", "")
    model: Union[str, float, dict, None] = doc(
        "Named size (7b, 70b, ...), preset name, HF config.json, inline architecture, or a parameter count.")
    hidden_size: Optional[int] = doc("Hidden size, with a raw parameter count.")
    num_layers: Optional[int] = doc("Layers, with a raw parameter count.")
    gpu: Optional[str] = doc("GPU type: a name or alias from trainer/accelerators.yaml.")
    gpus_per_node: int = doc("GPUs per node.", 1)
    nodes: int = doc("Nodes.", 1)
    cpu_ram_gb: Optional[float] = doc("Host RAM per node in GB; absent = not checked.")
    nvme_gb: Optional[float] = doc("Local NVMe per node in GB; 0 or absent = none.")
    nvme_path: Optional[str] = doc("NVMe mount for ZeRO-Infinity (default /local_nvme).")
    task: Literal["pretrain", "full", "lora", "dpo", "dpo-lora"] = doc(
        "pretrain, full (fine-tune), lora, dpo (full preference tuning) or dpo-lora.", "full")
    reference: Literal["auto", "adapter", "engine", "precomputed"] = doc(
        "dpo tasks: the reference model as adapter (dpo-lora), engine or precomputed; auto: the planner's choice.",
        "auto")
    seq_len: int = doc("Tokens per sequence.", 2048)
    micro_batch: Optional[int] = doc("Required micro-batch per GPU (default: the largest that fits).")
    global_batch: Optional[int] = doc("Target sequences per optimizer step.")
    activation_checkpointing: bool = doc("false: never plan activation checkpointing.", True)
    checkpoint_offload: Optional[bool] = doc(
        "Checkpointed layer inputs in host memory (DeepSpeed cpu_checkpointing): true always, false never; absent: "
        "only when nothing fits without it.")
    lora: Optional[LoraConfig] = doc("model.lora settings for task lora (r, alpha, target_modules).")
    expect: Optional[Expect] = doc("What the planner must recommend (checked by tests/test_plan.py).")
    seed: Optional[dict] = doc("The design brief's own numbers for this scenario, for comparison.")


def read_scenario(path: str) -> dict:
    """The scenario file's values as a dict, after the strict check (every problem at once, naming the file)."""
    file = Path(path).expanduser()
    if not is_there(file, "scenario file"):
        shipped = sorted(p.name for p in SCENARIO_DIR.glob("*.yaml"))
        hint = closest(file.name, shipped)
        example = f"scenarios/{hint.split(chr(39))[1]}" if hint else f"scenarios/{shipped[0]}" if shipped else ""
        raise UserError(f"scenario file {path!r} does not exist{hint}; the shipped ones are in {SCENARIO_DIR}"
                        + (f" (e.g. `python -m trainer plan {example}`)" if example else ""))
    raw = read_yaml_mapping(file, "scenario file", hint="a mapping of inputs (model, gpu, gpus_per_node, ...)")
    strict.from_dict(Scenario, raw, str(file))
    return raw
