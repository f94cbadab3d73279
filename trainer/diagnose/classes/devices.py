"""Tensors of one operation on two devices ("Expected all tensors to be on the same device, but found at least two
devices, cuda:0 and cuda:1"). The two devices the message names, and whose code raised, say which mistake it is:

- two GPUs: one process holds a model spread over the GPUs it sees (`device_map="auto"`, or a single-process run
  on a machine with several GPUs) and computes with inputs on another. Data-parallel training wants each process
  to see and use one GPU: a launcher's rank per GPU, or CUDA_VISIBLE_DEVICES for a run of one process;
- a GPU and the CPU, raised inside DeepSpeed's own optimizer or ZeRO code: the engine moved one of its own tensors
  and not the other - with CPU offload, a defect of that DeepSpeed release (the pin, or no offload, avoids it);
- a GPU and the CPU, raised in the user's code: a tensor made without a device (a mask, labels, a buffer)
  while the model is on the GPU.
"""
from __future__ import annotations

import re
from importlib import metadata

from ... import ds as dsc
from ..findings import Diagnosis, Found, Proposal
from ..raised import final_exception

DEVICE = r"(?:cuda|cpu|mps|xpu|meta|npu)(?::\d+)?"
# torch's two wordings: "... found at least two devices, cuda:0 and cpu" and (torch >= 2.1) "... but got mat2 is on
# cpu, different from other tensors on cuda:0"
TWO_DEVICES = re.compile(rf"Expected all tensors to be on the same device, but (?:found at least two devices, (?P<a>"
                         rf"{DEVICE}) and (?P<b>{DEVICE})|got \w+ is on (?P<c>{DEVICE}), different from other tensors "
                         rf"on (?P<d>{DEVICE}))")


def diagnose(f: Found) -> Diagnosis:
    m = TWO_DEVICES.search(f.log.joined(f.index))
    a, b = ((m.group("a") or m.group("c"), m.group("b") or m.group("d")) if m else ("", ""))
    raised = final_exception(f.log)
    inside = next((frame.package for frame in reversed(raised.frames) if frame.package), "") if raised else ""
    if a.startswith("cuda") and b.startswith("cuda"):
        d = Diagnosis("two_devices", f"one process computes with tensors on two GPUs ({a} and {b})", f.line)
        launched = f.facts.world_size is not None and f.facts.world_size > 1
        d.proposal = Proposal(
            "give each process one GPU: CUDA_VISIBLE_DEVICES=0 for a run of one process, or launch a rank per GPU "
            "(deepspeed/torchrun) with the model loaded on the rank's own device (`device_map={\"\": local_rank}`, "
            "not \"auto\")", [],
            "a process that sees several GPUs and loads with device_map='auto' (or that places layers itself) spreads "
            "the model over them while its inputs sit on one; data-parallel training keeps a whole copy per GPU"
            + (" - the log shows a multi-rank launch: check that no rank loads with device_map='auto'" if launched
               else ""),
            env=(("CUDA_VISIBLE_DEVICES", "0"),) if not launched else ())
        return d
    cpu_side = "cpu" in (a, b)
    if cpu_side and inside == "deepspeed":
        offload = dsc.offload_optimizer_device(f.resolved.ds) == "cpu"
        d = Diagnosis("two_devices", f"DeepSpeed's own code met a GPU and a CPU tensor ({a} and {b})", f.line)
        theirs = f.versions.get("deepspeed")
        d.proposal = Proposal(
            (f"use another DeepSpeed release than {theirs} (`deepspeed!={theirs}`): the project's pin, `pip install "
             f"deepspeed=={pinned('deepspeed')}`, or the release before it" if theirs else
             f"use another DeepSpeed release: the project's pin (`pip install deepspeed=={pinned('deepspeed')}`), or "
             f"the release before the one that raised"), [],
            "the tensors were DeepSpeed's own (raised in " + (raised.site.short() if raised and raised.site else
                                                              "DeepSpeed") +
            "): the engine moved one and not the other, a defect of that release in a feature few configs use - "
            + ("CPU optimizer offload, which this config has" if offload else "most often CPU offload"))
        d.then.append(Proposal("or run without the offload that puts the CPU tensor there", [],
                               "offload_optimizer / offload_param device none, if the memory allows (`plan`)"))
        return d
    d = Diagnosis("two_devices", f"an operation met tensors on {a} and {b}", f.line)
    d.proposal = Proposal(
        "create the tensor on the model's device: `torch.zeros(..., device=model.device)` or `.to(model.device)` "
        "for inputs, labels and masks made in your code", [],
        f"one operand is on {a}, the other on {b}: a tensor made without a device stays on the CPU while the model "
        f"is on the GPU (or the other way round after a model moved to the CPU)")
    return d


def pinned(package: str) -> str:
    """The installed release of `package` where the doctor runs (the project's pin), or 'the pinned release'."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "<the pinned release>"
