"""Out of memory: GPU memory (while loading, at start-up, in a training step) and host RAM (the kernel's OOM
killer), with the next change for the phase the run died in.

The phase decides the ladder: before the first step nothing of the batch is allocated, so a smaller
micro-batch or activation checkpointing cannot help an OOM while loading or inside deepspeed.initialize, and
at the optimizer step the activations are already freed. The OOM ladder (seed step 7.1): 1 smaller
micro-batch (same global batch), 2 activation checkpointing, 3 ZeRO stage up (0/1 -> 2 -> 3), 4 optimizer
offload to CPU, then parameter offload, 5 smaller stage-3 buffers, 6 NVMe offload, 7 LoRA.
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Callable, Optional

from .. import ds as dsc
from ..errors import UserError
from ..plan.estimate import gb
from ..resolve import Resolved
from .findings import Diagnosis, Found, Proposal, Reresolve, first_error_line, planned
from .logtext import Log

GPU_OOM = re.compile(r"(torch\.(cuda\.)?OutOfMemoryError|CUDA out of memory|CUDA error: out of memory)")
# The kernel's OOM killer as each launcher reports it, and the shell's own "Killed" (also glued to the end of
# a progress bar, "...35.73s/it]Killed", or as bash's job line "line 5: 12989 Killed").
HOST_KILL = re.compile(
    r"(exits? with return code = -9\b|exitcode\s*:\s*-9\b|Signal 9 \(SIGKILL\)|<Signals\.SIGKILL: 9>|"
    r"terminated with signal SIGKILL|return code -9\b|Out of memory: Killed process|oom-kill|"
    r"(?:^|[\]\s:|])Killed\.?(?:\s|$)|^\s*killed\s*$|DefaultCPUAllocator: (?:can't|not enough memory))")
LOADING = re.compile(r"(from_pretrained|_load_pretrained_model|load_state_dict|Loading checkpoint shards|"
                     r"modeling_utils\.py|partition_parameters\.py|zero\.Init|loading weights file|Loading model)")
INIT = re.compile(r"(deepspeed\.initialize|in initialize\b|DeepSpeedEngine\(|_configure_optimizer|"
                  r"_configure_zero_optimizer|_configure_distributed_model|initialize_optimizer_states|"
                  r"_setup_for_real_optimizer|_create_fp32_partitions|DeepSpeedZeroOptimizer|"
                  r"initializing optimizer states|creating fp(16|32) partitions|DeepSpeedZeRoOffload initialize)")
RESUME = re.compile(r"(Attempting to resume|load_checkpoint|_get_all_zero_checkpoint_state_dicts|optim_states\.pt)")
STEP = re.compile(r"(engine\.step|optimizer\.step|_take_model_step|\bin step$|\.step\(\))")
BACKWARD = re.compile(r"backward")
FORWARD = re.compile(r"(forward|_call_impl|__call__)")
TRAINING = re.compile(r"(step=\d+|'loss':|\bloss[=:]\s*\d|Epoch \d|global_step|Running training)")


# --- which phase the run died in ----------------------------------------------------------------------------


def gpu_phase(log: Log, index: int) -> str:
    """The phase of a CUDA OOM from its traceback: loading, init (inside deepspeed.initialize: model states
    allocated), step, backward, forward, or unknown (no traceback)."""
    context = log.traceback_of(index)
    for phase, pattern in (("loading", LOADING), ("init", INIT), ("step", STEP), ("backward", BACKWARD),
                           ("forward", FORWARD)):
        if pattern.search(context):
            return phase
    return "unknown"


def host_phase(log: Log, index: int) -> str:
    """The phase of a host kill from the log before it: the last of resume / loading / init / training that
    shows (a kill leaves no traceback), unknown when none does."""
    latest, phase = -1, "unknown"
    for name, pattern in (("resume", RESUME), ("loading", LOADING), ("init", INIT), ("training", TRAINING)):
        found = max((i for i in range(max(0, index - 40), index + 1) if pattern.search(log.lines[i])), default=-1)
        if found > latest:
            latest, phase = found, name
    return phase


PHASE_WORDS = {"loading": "while loading the model", "init": "at start-up (deepspeed.initialize)",
               "resume": "while resuming from a checkpoint", "training": "during training",
               "step": "in the optimizer step", "backward": "in the backward pass", "forward": "in the forward pass",
               "unknown": "(the log shows no phase)"}


# --- the OOM ladder ------------------------------------------------------------------------------------------

Rung = Callable[[Resolved], Optional[Proposal]]


def smaller_micro_batch(r: Resolved) -> Optional[Proposal]:
    micro, accum = r.batch.micro_batch_size, r.batch.grad_accum
    if micro == 1:
        return None
    smaller = max(d for d in range(1, micro) if micro % d == 0)
    return Proposal("1. smaller micro-batch", [f"train.micro_batch_size={smaller}",
                                               f"train.grad_accum={accum * micro // smaller}"],
                    f"activations scale with the micro-batch; {micro} -> {smaller} with grad_accum "
                    f"{accum} -> {accum * micro // smaller} keeps the global batch ({r.batch.global_batch_size})")


def activation_checkpointing(r: Resolved) -> Optional[Proposal]:
    if r.config.model.gradient_checkpointing:
        return None
    return Proposal("2. activation checkpointing", ["model.gradient_checkpointing=true"],
                    "keeps only each layer's input and recomputes the rest in backward: activations drop to "
                    "~1/20 for ~30% more compute")


def stage_up(r: Resolved) -> Optional[Proposal]:
    stage = dsc.zero_stage(r.ds)
    if stage == 3:
        return None
    target = 2 if stage < 2 else 3
    new = dsc.base_config(target, dsc.offload_optimizer_device(r.ds), "none")
    what = "gradients and optimizer states" if target == 2 else "parameters too"
    return Proposal(f"3. ZeRO stage {stage} -> {target}", dsc.zero_overrides(r.ds, new),
                    f"stage {target} shards {what} across the {r.world_size} ranks"
                    + (" (same communication as stage 1)" if target == 2 else " (~1.5x communication)"))


def optimizer_offload(r: Resolved) -> Optional[Proposal]:
    stage = dsc.zero_stage(r.ds)
    if stage == 0 or dsc.offload_optimizer_device(r.ds) != "none":
        return None
    new = dsc.base_config(stage, "cpu", dsc.offload_param_device(r.ds))
    return Proposal("4. optimizer offload to CPU", dsc.zero_overrides(r.ds, new),
                    "fp32 master weights, Adam moments and fp32 gradients move to host RAM (12-16 bytes/param "
                    "off the GPU); the step runs on the CPU - launch with --bind_cores_to_rank")


def param_offload(r: Resolved) -> Optional[Proposal]:
    if dsc.zero_stage(r.ds) != 3 or dsc.offload_param_device(r.ds) != "none":
        return None
    new = dsc.base_config(3, dsc.offload_optimizer_device(r.ds), "cpu")
    return Proposal("4b. parameter offload to CPU", dsc.zero_overrides(r.ds, new),
                    "16-bit parameter partitions live in host RAM and are fetched per layer: the GPU holds "
                    "about one layer's weights")


def smaller_buffers(r: Resolved) -> Optional[Proposal]:
    overrides = dsc.smaller_stage3_buffers(r.ds) if dsc.zero_stage(r.ds) == 3 else []
    if not overrides:
        return None
    return Proposal("5. smaller stage-3 buffers", overrides,
                    "fewer parameters prefetched and kept live between uses (some throughput lost)")


def nvme_offload(r: Resolved) -> Optional[Proposal]:
    if dsc.zero_stage(r.ds) != 3 or (dsc.offload_optimizer_device(r.ds), dsc.offload_param_device(r.ds)) == (
            "nvme", "nvme"):
        return None
    new = dsc.base_config(3, "nvme", "nvme", "/local_nvme")
    return Proposal("6. NVMe offload (ZeRO-Infinity)", dsc.zero_overrides(r.ds, new),
                    "optimizer states and parameters go to a local NVMe drive; host RAM keeps only swap buffers. "
                    "Point nvme_path at your NVMe mount (it must exist); set hardware.nvme_gb for the planner")


def lora(r: Resolved) -> Optional[Proposal]:
    if r.config.model.lora.enabled:
        return None
    note = "" if r.config.model.name_or_path else " (needs pretrained weights: set model.name_or_path)"
    return Proposal("7. LoRA", ["model.lora.enabled=true"],
                    f"train low-rank adapters only: gradients and Adam states shrink to <1% of the model{note}")


OOM_LADDER: list[Rung] = [smaller_micro_batch, activation_checkpointing, stage_up, optimizer_offload, param_offload,
                          smaller_buffers, nvme_offload, lora]
# Before the first step and at the optimizer step no activations are live: only model states can move.
STATES_LADDER: list[Rung] = [stage_up, optimizer_offload, param_offload, nvme_offload, lora]
LADDERS = {"init": STATES_LADDER, "step": STATES_LADDER}


def walk_ladder(r: Resolved, ladder: list[Rung], reresolve: Optional[Reresolve] = None) -> list[Proposal]:
    """Each rung not yet taken, in order; with `reresolve`, each rung sees the config after the earlier
    proposals (cumulative: after a stage-up, the optimizer offload is the stage-3 kind)."""
    proposals, applied = [], []
    for rung in ladder:
        proposal = rung(r)
        if proposal is None:
            continue
        proposals.append(proposal)
        if reresolve is not None:
            try:
                r = reresolve(applied + proposal.overrides)
                applied += proposal.overrides
            except UserError as err:  # e.g. an NVMe path that does not exist on this machine
                proposals[-1] = replace(proposal, reason=f"{proposal.reason} (not checked on this machine: "
                                        f"{first_error_line(err)}; the next rungs are judged without it)")
    return proposals


# --- GPU memory ----------------------------------------------------------------------------------------------


def diagnose_load_oom(f: Found) -> Diagnosis:
    """CUDA OOM while building/loading the model (from_pretrained, zero.Init)."""
    r, d = f.resolved, Diagnosis("load_oom", "out of GPU memory while loading the model / zero.Init", f.line)
    stage, param = dsc.zero_stage(r.ds), dsc.offload_param_device(r.ds)
    if stage < 3:
        d.proposal = sharded_load(r)
    elif param == "none":
        new = dsc.base_config(3, dsc.offload_optimizer_device(r.ds), "cpu")
        d.proposal = Proposal("parameter offload to CPU", dsc.zero_overrides(r.ds, new),
                              "even sharded, the 16-bit parameters do not fit next to the load buffers; offloaded "
                              "they are loaded straight into host memory")
    if stage == 3 and not re.search(r"(zero\.Init|partition_parameters\.py)", f.log.traceback_of(f.index)):
        d.advice.append(NOT_UNDER_ZERO_INIT)
    return d


NOT_UNDER_ZERO_INIT = ("the traceback shows no zero.Init (partition_parameters.py): with your own script, create "
                       "transformers' HfDeepSpeedConfig(ds_config) before from_pretrained, or build the model inside "
                       "`with deepspeed.zero.Init(config_dict_or_path=ds_config):` (seed step 7.2)")


def sharded_load(r: Resolved) -> Proposal:
    new = dsc.base_config(3, dsc.offload_optimizer_device(r.ds), "none")
    return Proposal("ZeRO stage 3 (sharded load)", dsc.zero_overrides(r.ds, new),
                    f"below stage 3 every rank loads the whole model ({r.world_size} copies per node in host RAM, "
                    f"a full copy per GPU); at stage 3 the trainer builds and loads it under deepspeed.zero.Init, "
                    f"so each rank only materialises its shard")


def diagnose_gpu_oom(f: Found) -> Diagnosis:
    """CUDA OOM at start-up or in a training step: the ladder for that phase, rungs already taken skipped."""
    phase = gpu_phase(f.log, f.index)
    details = _oom_details(f.log.joined(f.index))
    if phase == "init":
        d = Diagnosis("init_oom", f"CUDA out of memory at start-up, allocating model states in "
                                  f"deepspeed.initialize{details}", f.line)
        d.advice.append("nothing of the batch exists before the first step: a smaller micro-batch or activation "
                        "checkpointing cannot help here - the model states (parameters, gradients, optimizer) "
                        "must be sharded further or moved off the GPU")
    else:
        where = "" if phase == "unknown" else f" {PHASE_WORDS[phase]}"
        d = Diagnosis("cuda_oom", f"CUDA out of memory{where}{details}", f.line)
        if phase == "step":
            d.advice.append("the optimizer step holds the model states, not the activations: the states rungs come "
                            "first")
    steps = walk_ladder(f.resolved, LADDERS.get(phase, OOM_LADDER), f.reresolve)
    d.proposal, d.then = (steps[0], steps[1:]) if steps else (None, [])
    if not steps:
        d.advice.append("every rung of the seed's OOM ladder is already taken: more GPUs, a shorter data.seq_len, "
                        "or a smaller model")
    fragmented = re.search(r"([\d.]+) GiB is reserved by PyTorch but unallocated", f.log.joined(f.index))
    if fragmented and float(fragmented.group(1)) >= 1.0:
        d.advice.append(f"{fragmented.group(1)} GiB was reserved but unallocated (fragmentation): also try "
                        f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    return d


def _oom_details(message: str) -> str:
    wanted = re.search(r"Tried to allocate ([\d.]+ [MG]iB)", message)
    gpu = (re.search(r"GPU (\d+) has a total capacity of ([\d.]+ GiB)", message)
           or re.search(r"\(GPU (\d+); ([\d.]+ GiB) total capacity", message))
    parts = ([f"tried to allocate {wanted.group(1)}"] if wanted else []) + (
        [f"GPU {gpu.group(1)} of {gpu.group(2)}"] if gpu else [])
    return f" ({', '.join(parts)})" if parts else ""


# --- host RAM ------------------------------------------------------------------------------------------------

SWAP = ("confirm the kernel's OOM killer ended it (`dmesg -T | grep -i 'killed process'`), then give the peak "
        "room: add swap (`sudo fallocate -l 128G /swapfile && sudo chmod 600 /swapfile && sudo mkswap /swapfile "
        "&& sudo swapon /swapfile`; in WSL set memory= and swap= in %UserProfile%\\.wslconfig) or more RAM")


def diagnose_host_oom(f: Found) -> Diagnosis:
    r, phase = f.resolved, host_phase(f.log, f.index)
    d = Diagnosis("host_oom", f"host RAM ran out {PHASE_WORDS[phase]}: the kernel's OOM killer ended the process "
                              f"(signal 9)", f.line)
    if phase == "loading":
        d.proposal = _host_load_change(r)
    elif phase != "resume" and "cpu" in (dsc.offload_optimizer_device(r.ds), dsc.offload_param_device(r.ds)):
        d.proposal, d.then = _offload_out_of_host(f)
    if d.proposal is None:
        reason = ("resuming loads the ZeRO checkpoint's optimizer states into host memory before they move to "
                  "the GPUs: the peak is above the steady state" if phase == "resume" else
                  "nothing this preset keeps in host RAM explains the kill: the peak came from outside the "
                  "model states (the load, the data pipeline, other processes)")
        d.proposal = Proposal("make room in host RAM (swap or more RAM), then rerun", [], f"{SWAP}. {reason}")
        if phase == "unknown" and dsc.zero_stage(r.ds) < 3:
            d.then.append(replace(sharded_load(r), step="if it died while loading the model: ZeRO stage 3"))
    plan = planned(r)
    if plan is not None:
        budget = f" of the {r.config.hardware.cpu_ram_gb:g} GB hardware.cpu_ram_gb" if r.config.hardware.cpu_ram_gb else ""
        d.advice.append(f"the planner puts this preset at {gb(plan.cpu_bytes_per_node)} GB of host RAM per node"
                        f"{budget} (DeepSpeed's estimate, x1.5 margin); `python -m trainer plan` prints it per "
                        f"candidate (CPU/node column)")
    return d


def _host_load_change(r: Resolved) -> Optional[Proposal]:
    stage, param, opt = dsc.zero_stage(r.ds), dsc.offload_param_device(r.ds), dsc.offload_optimizer_device(r.ds)
    if stage < 3:
        return sharded_load(r)
    if param == "cpu":
        return Proposal("NVMe offload", dsc.zero_overrides(r.ds, dsc.base_config(3, "nvme", "nvme", "/local_nvme")),
                        "the parameters offloaded to host RAM do not fit it: put them (and the optimizer) on NVMe; "
                        "point nvme_path at a local NVMe mount")
    if opt == "cpu":
        return Proposal("optimizer offload to NVMe",
                        dsc.zero_overrides(r.ds, dsc.base_config(3, "nvme", "none", "/local_nvme")),
                        "the load is sharded already; the host-side fp32 optimizer states (16 bytes/param per node, "
                        "x1.5 in DeepSpeed's estimate) are what does not fit: move them to NVMe")
    return None


def _offload_out_of_host(f: Found) -> tuple[Proposal, list[Proposal]]:
    """Mid-run with CPU offload: what lives in host RAM is the offloaded state. Parameters go back to the GPU
    when the planner says they fit there (DeepSpeed's first answer), else the offloaded state goes to NVMe."""
    r = f.resolved
    nvme = Proposal("offloaded states to NVMe (ZeRO-Infinity)",
                    dsc.zero_overrides(r.ds, dsc.base_config(3, "nvme", "nvme" if dsc.offload_param_device(r.ds) ==
                                                             "cpu" else "none", "/local_nvme")),
                    "the offloaded optimizer states (and parameters) fill host RAM: move them to a local NVMe drive "
                    "(nvme_path must exist); host RAM keeps only swap buffers")
    if dsc.offload_param_device(r.ds) != "cpu":
        return nvme, []
    back = Proposal("parameters back on the GPU", dsc.zero_overrides(r.ds, dsc.base_config(
        3, dsc.offload_optimizer_device(r.ds), "none")),
        "the offloaded parameters and optimizer states together overflow host RAM; sharded over the GPUs the "
        "16-bit parameters fit there (planner), which frees 2 bytes/param of host RAM per rank")
    plan = planned(f.resolves(back.overrides))
    return (back, [nvme]) if plan is not None and plan.fits_gpu else (nvme, [])
