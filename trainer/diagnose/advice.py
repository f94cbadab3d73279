"""The handlers of the training itself: fp16's dynamic loss scale and ZeRO-Infinity's NVMe swap. Each turns a
recogniser's hit into a Diagnosis with the next change: `--set` overrides the trainer accepts, or the exact
step when the fix is outside the config."""
from __future__ import annotations

import re
from typing import Optional

from .. import ds as dsc
from .. import hardware, shell
from .findings import Diagnosis, Found, Proposal, planned

TRAINER_DEEPSPEED = "0.19.8"  # the version this trainer pins (pyproject.toml) and is tested on


# --- fp16 loss scale -----------------------------------------------------------------------------------------


def diagnose_loss_scale(f: Found) -> Diagnosis:
    r = f.resolved
    d = Diagnosis("fp16_loss_scale", "fp16 dynamic loss scale collapsed to its minimum", f.line)
    gpu = hardware.gpu(r.config.hardware.gpu)
    precision = dsc.precision(r.ds)
    if precision != "fp16":  # the log's run was fp16 (only fp16 scales its loss): the preset's precision is the fix
        d.proposal = Proposal(f"train in {precision}, as {r.config.name} does (the log's run was fp16)", [],
                              f"dynamic loss scaling exists only in fp16; {precision} keeps fp32's exponent range, so "
                              f"it has no scale to collapse" + (" (seed step 7.2)" if precision == "bf16" else ""))
        as_the_log_ran = shell.join(word for item in ["train.precision=fp16"] + dsc.precision_overrides(r.ds, "fp16")
                                    for word in ("--set", item))
        d.advice.append(f"{r.config.name} trains in {precision}; to stay in fp16, diagnose the log as it ran for "
                        f"fp16's own steps: {as_the_log_ran}")
        return d
    if gpu.bf16:
        d.proposal = Proposal("switch to bf16", ["train.precision=bf16"] + dsc.precision_overrides(r.ds, "bf16"),
                              f"{gpu.description} has bf16: the fp32 exponent range needs no loss scaling, so it "
                              f"cannot collapse (seed step 7.2)")
    else:
        d.proposal = Proposal("leave fp16: train in fp32", ["train.precision=fp32"] +
                              dsc.precision_overrides(r.ds, "fp32"),
                              f"{gpu.description} has no bf16, and a scale pinned at its minimum means fp16 cannot "
                              f"hold this run's gradients; fp32 needs no scaling (more memory and slower - check "
                              f"the planner line)")
        d.then += _lower_lr(f)
    d.advice.append("raising fp16.min_loss_scale only turns the abort into skipped steps, and the trainer stops "
                    f"after train.max_bad_steps={r.config.train.max_bad_steps} of them; a model pretrained in bf16 "
                    "often overflows in fp16 - also check the data for broken samples before the failure")
    return d


def _lower_lr(f: Found) -> list[Proposal]:
    lr = f.resolved.config.train.lr
    overrides = [f"train.lr={lr / 2:g}"]
    if f.reresolve is not None and f.resolves(overrides) is None:
        return []
    return [Proposal("or stay in fp16 with half the learning rate", overrides,
                     f"lr {lr:g} -> {lr / 2:g}: overflows that grow until the scale bottoms out are usually a "
                     f"diverging run")]


def _nvme_to_cpu(f: Found) -> Optional[Proposal]:
    r = f.resolved
    to_cpu = lambda device: "cpu" if device == "nvme" else device  # noqa: E731
    new = dsc.base_config(3, to_cpu(dsc.offload_optimizer_device(r.ds)), to_cpu(dsc.offload_param_device(r.ds)))
    overrides = dsc.zero_overrides(r.ds, new)
    plan = planned(f.resolves(overrides))
    fits = "" if plan is None else f" (planner: {plan.cpu_bytes_per_node / 1e9:.0f} GB host RAM per node)"
    return Proposal("or offload to CPU instead of NVMe", overrides,
                    f"no async_io (libaio) needed when the states live in host RAM{fits}")


# --- NVMe swap -----------------------------------------------------------------------------------------------

SWAP_PATH = re.compile(r"(\S*?)/zero_stage_3/")


def diagnose_nvme(f: Found) -> Diagnosis:
    r = f.resolved
    match = next(iter(f.log.all(SWAP_PATH)), None)
    path = (match.group(1) or "/") if match else "NVME_PATH"
    d = Diagnosis("nvme_aio", f"ZeRO-Infinity swap I/O failed on {path}: a swap file came back shorter than its tensor",
                  f.line)
    d.proposal = Proposal(f"check the NVMe path: df -h {path}", [],
                          f"`df -h {path}` (free space for every rank's optimizer and parameter swap files), "
                          f"`findmnt -T {path}` (a local NVMe file system - not NFS, overlay or tmpfs, where O_DIRECT "
                          f"async I/O writes short), `dmesg -T | tail` for I/O errors, then rerun; aio.block_size must "
                          f"stay a multiple of the drive's sector size (the 512-byte partial block was the short write "
                          f"DeepSpeed fixed after 0.3.x; this trainer runs {TRAINER_DEEPSPEED})")
    if "nvme" in (dsc.offload_optimizer_device(r.ds), dsc.offload_param_device(r.ds)):
        d.then.append(_nvme_to_cpu(f))
    else:
        d.advice.append(f"preset {r.config.name} offloads nothing to NVMe: this log came from an NVMe config")
    return d
