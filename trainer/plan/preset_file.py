"""`plan --write-preset FILE`: the plan's launch line as a preset file of its own.

The nearest shipped preset is copied (a preset is data, read top to bottom: no inheritance) with the launch line's
`--set` items written into it, under the header every shipped preset has (Hardware, Model, Trade-off, Expected
memory, Launch). The numbers in the header are the written file's own: it is read back and resolved, and its
expected memory is `plan_for_resolved`'s, the estimate `lint` and `show` print for it."""
from __future__ import annotations

from pathlib import Path

import yaml

from ..errors import UserError
from ..files import read_yaml_mapping, write_text_atomic
from ..presets import ACCEPTED_WARNING, PRESET_DIR, apply_overrides, load_preset, preset_path
from .estimate import MEMORY_HEADROOM, TIGHT, Plan, gb

FLAG = "--write-preset"
TASKS = {"pretrain": "pretraining", "full": "full fine-tune", "lora": "LoRA fine-tune", "dpo": "DPO",
         "dpo-lora": "LoRA DPO"}


def check_preset_target(target: str) -> None:
    """Refused before any work: not a .yaml file, or a preset under presets/ this command did not write (a shipped
    one: the file a plan copies from)."""
    path = Path(target).expanduser()
    if path.suffix not in (".yaml", ".yml"):
        raise UserError(f"{FLAG} {target!r}: a preset is a .yaml file (presets/NAME.yaml is listed by `presets`)")
    if path.is_file() and path.resolve().parent == PRESET_DIR.resolve() and not written_by_plan(path):
        raise UserError(f"{FLAG} {target}: a shipped preset; write a new name (presets/my_model_4x4090.yaml)")


MARK = f"Written by `python -m trainer plan {FLAG}`"


def written_by_plan(path: Path) -> bool:
    """A preset this command wrote (its header says so): never the one a plan copies from."""
    with open(path, errors="replace") as handle:
        return MARK in handle.read(4000)


def write_preset(plan: Plan, target: str) -> Path:
    """Write the plan as a preset at `target` and return its path; the file resolves as the launch line does."""
    if plan.choice is None or plan.preset is None:
        raise UserError(f"{FLAG}: the plan fits nowhere, so there is no preset to write")
    path = Path(target).expanduser()
    name = path.stem
    raw = read_yaml_mapping(preset_path(plan.preset), "preset")
    in_deepspeed = [item for item in plan.preset_overrides if item.startswith("deepspeed.")]
    raw = apply_overrides(raw, [item for item in plan.preset_overrides if item not in in_deepspeed])
    raw = apply_overrides(raw, in_deepspeed)  # null stays null: in a preset's own section it removes a template key
    raw.pop("name", None)
    raw["description"] = description(plan)
    raw.setdefault("train", {})["output_dir"] = f"runs/{name}"
    if isinstance(raw.get("logging"), dict) and raw["logging"].get("wandb_project"):
        raw["logging"]["wandb_project"] = name
    body = yaml.safe_dump(raw, sort_keys=False, width=120, default_flow_style=False)
    write_text_atomic(str(path), body, FLAG)  # read back below: the header's numbers are the written file's
    text = "\n".join(f"# {line}" if line else "#" for line in header(plan, path)) + "\n" + body
    return write_text_atomic(str(path), text, FLAG)


def preset_argument(path: Path) -> str:
    """What `--preset` takes for the file: its name under presets/, else its path."""
    return path.stem if path.resolve().parent == PRESET_DIR.resolve() else str(path)


def description(plan: Plan) -> str:
    inputs, e = plan.inputs, plan.choice
    return (f"{inputs.model.label} {inputs.task} on {inputs.nodes} x {inputs.gpus_per_node} {inputs.gpu.name}, "
            f"{e.candidate.label} {inputs.precision}, micro {e.micro_batch} (from `plan`, copied from {plan.preset})")


def header(plan: Plan, path: Path) -> list[str]:
    from ..launch.command import command_for  # the line the shipped presets' headers and the doctor print
    from ..resolve import resolve
    from .estimate import plan_for_resolved
    inputs, e = plan.inputs, plan.choice
    resolved = resolve(load_preset(str(path)))
    est = plan_for_resolved(resolved)
    batch = resolved.batch
    lora = f" + LoRA r={inputs.lora.r}" if inputs.lora_enabled else ""
    weights = resolved.config.model.name_or_path or "none: trained from scratch"
    host = resolved.config.hardware.cpu_ram_gb
    return [
        f"{path.stem} — {TASKS[inputs.task]} of {inputs.model.label} on {inputs.nodes} node(s) x "
        f"{inputs.gpus_per_node} {inputs.gpu.description}.",
        f"{MARK} from the shipped preset {plan.preset} and the plan's --set items.",
        f"Hardware: {inputs.nodes} node(s) x {inputs.gpus_per_node} {inputs.gpu.description}, "
        + (f"{host:g} GB host RAM per node" if host else "host RAM not given (plan --cpu-ram-gb checks it)") + ".",
        f"Model: {inputs.model.label}: {inputs.params:,} params{lora}; weights: {weights}.",
        f"Trade-off: {e.candidate.label}, activation checkpointing {'on' if e.checkpointing else 'off'}, micro-batch "
        f"{batch.micro_batch_size} x accumulation {batch.grad_accum} x {batch.data_parallel_size} ranks = "
        f"{batch.global_batch_size} sequences of {resolved.config.data.seq_len} tokens per step; the plan's walk:",
        *[f"  {line}" for line in plan.walk],
        f"Expected memory per GPU: ~{gb(est.gpu_total)} GB of {gb(est.gpu_budget)} usable (params "
        f"{gb(est.states.params)}, grads {gb(est.states.gradients)}, optimizer {gb(est.states.optimizer)}, activations "
        f"{gb(est.activations.total)}, buffers {gb(est.buffers)}: the planner's estimate, as `lint` prints it).",
        *([f"{ACCEPTED_WARNING} [{MEMORY_HEADROOM}]: the plan's pick fills {gb(est.peak)} of "
           f"{gb(est.gpu_budget)} GB, past {TIGHT:.0%}; nothing roomier fits these GPUs"] if est.tight else []),
        "Check it: python -m trainer lint " + preset_argument(path) + "; rehearse its DeepSpeed features on 2 CPU "
        "ranks: deepspeed --num_gpus 2 train.py --preset " + preset_argument(path) + " --rehearse",
        f"Launch: {command_for(resolved, preset_argument(path), [])}",
    ]
