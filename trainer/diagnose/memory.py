"""Out of memory: GPU memory (while loading, at start-up, in a training step, a gather, a save) and host RAM
(the kernel's OOM killer), with the next change for the phase the run died in.

The phase (phases.py) decides which changes can help: before the first step nothing of the batch is
allocated, so a smaller micro-batch or activation checkpointing cannot help an OOM while loading or inside
deepspeed.initialize, and at the optimizer step the activations are already freed. Which change comes first
is the planner's call (ladder.py): the cheapest one that fits by its estimate. When the estimate says the
preset already fits, the OOM is not ordinary memory pressure: another process on the GPU, pinned host memory
(WSL2), fragmentation or a leak across steps - each named from what the message and the log show.
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Optional

from .. import ds as dsc
from ..plan.estimate import gb
from ..resolve import Resolved
from . import ladder, phases
from .findings import Diagnosis, Found, Proposal, planned
from .ladder import GIB, OomNumbers

GPU_OOM = re.compile(r"(torch\.(cuda\.)?OutOfMemoryError|CUDA out of memory|CUDA error: out of memory)")
# The kernel's OOM killer as each launcher reports it, and the shell's own "Killed" (also glued to the end of
# a progress bar, "...35.73s/it]Killed", or as bash's job line "line 5: 12989 Killed").
HOST_KILL = re.compile(
    r"(exits? with return code = -9\b|exitcode\s*:\s*-9\b|Signal 9 \(SIGKILL\)|<Signals\.SIGKILL: 9>|"
    r"terminated with signal SIGKILL|return code -9\b|Out of memory: Killed process|oom-kill|"
    r"(?:^|[\]\s:|])Killed\.?(?:\s|$)|^\s*killed\s*$|DefaultCPUAllocator: (?:can't|not enough memory))")
WSL = re.compile(r"(microsoft-standard-WSL|WSL2|\bwsl\b)", re.IGNORECASE)
PINNED = re.compile(r"(pin_memory|cudaHostAlloc|pinned memory|page-locked)")
TRAINING_STEP = re.compile(r"(\bstep[=:]\s*(\d+)|global_step[=:]\s*(\d+)|'loss':)")
EXPANDABLE = (("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True"),)


def gpu_phase(log, index: int) -> str:
    return phases.phase(log, index)


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
    """CUDA OOM at start-up, in a step, a gather or a save: the cheapest change that fits by the planner's
    estimate, or - when the estimate says the preset fits - the cause that is not memory pressure."""
    phase = phases.phase(f.log, f.index)
    numbers = OomNumbers.of(f.log.joined(f.index, following=6))
    failure = "init_oom" if phase == "init" else "cuda_oom"
    where = "" if phase == "unknown" else f" {phases.WORDS[phase]}"
    d = Diagnosis(failure, f"CUDA out of memory{where}{_oom_details(numbers, f.log.joined(f.index))}", f.line)
    d.advice += PHASE_ADVICE.get(phase, [])
    f = _as_the_log_ran(f, d)
    pricer = ladder.pricer_for(f, numbers)
    on_other_gpu = ladder.same_gpu(numbers, f.resolved) is False
    if on_other_gpu:
        d.advice.append(f"the log's GPU has {numbers.capacity / GIB:.1f} GiB, preset {f.resolved.config.name} plans "
                        f"for {f.resolved.config.hardware.gpu}: the estimates below are the preset's, on its GPU")
    if phase == "save" and _save_gather(f, d):
        return d
    now = pricer.price(pricer.base) if pricer else None
    if now is not None and now.fits and not on_other_gpu and _not_memory_pressure(f, d, numbers, now, phase):
        return d
    result = ladder.walk(f, ladder.LADDERS.get(phase, ladder.OOM_LADDER), pricer)
    d.proposal, d.then = result.proposal, result.then
    if result.proposal is None:
        d.advice.append(_nothing_fits(result))
    _fragmentation_advice(d, numbers)
    return d


def _as_the_log_ran(f: Found, d: Diagnosis) -> Found:
    """The preset as the log's run held its model states, when the log shows a stage or offload other than the
    preset's (an FSDP full_shard run judged against a preset that offloads): the log's allocation calibrates the
    estimate of what ran, and the ladder climbs from there - not from a config the run never had."""
    ran, r = f.facts.sharding, f.resolved
    if not ran or f.reresolve is None or r.config.hardware.gpu == "cpu":
        return f
    preset = (dsc.zero_stage(r.ds), dsc.offload_optimizer_device(r.ds), dsc.offload_param_device(r.ds))
    wanted = (ran["stage"], ran["offload_optimizer"], ran["offload_param"])
    if wanted == preset:
        return f
    overrides = dsc.zero_overrides(r.ds, dsc.base_config(*wanted))
    resolved = f.resolves(overrides)
    if resolved is None:
        return f
    d.advice.append(f"the log's run used {ran['how']}, not preset {r.config.name}'s ZeRO stage {preset[0]} "
                    f"(optimizer offload {preset[1]}, parameter offload {preset[2]}): the estimates start from what "
                    f"it ran")
    base = f.reresolve
    return replace(f, resolved=resolved, reresolve=lambda extra: base([*overrides, *extra]))


PHASE_ADVICE = {
    "init": ["nothing of the batch exists before the first step: a smaller micro-batch or activation checkpointing "
             "cannot help here - the model states (parameters, gradients, optimizer) must be sharded further or moved "
             "off the GPU"],
    "step": ["the optimizer step holds the model states, not the activations: the states rungs come first"],
    "gather": ["a ZeRO-3 gather materialises the prefetched and live parameters: the prefetch bucket and the "
               "live-parameter limit bound it"],
    "eval": ["evaluation ran out, not training: eval batches larger than the training micro-batch, generation "
             "(its KV cache grows with max_new_tokens) or logits kept across eval steps (HF: eval_accumulation_steps) "
             "are the usual causes"],
}


def _oom_details(numbers: OomNumbers, message: str) -> str:
    gpu = re.search(r"GPU (\d+)", message)
    parts = ([f"tried to allocate {numbers.requested / GIB:.2f} GiB"] if numbers.requested else []) + (
        [f"GPU {gpu.group(1) if gpu else '?'} of {numbers.capacity / GIB:.2f} GiB"] if numbers.capacity else [])
    return f" ({', '.join(parts)})" if parts else ""


def _nothing_fits(result: "ladder.Ladder") -> str:
    if result.best is None:
        return ("every rung of the seed's OOM ladder is already taken: more GPUs, a shorter data.seq_len, or a "
                "smaller model")
    return (f"nothing on the OOM ladder fits by the planner's estimate - with every rung the preset still needs "
            f"{gb(result.best.total)} of {gb(result.best.estimate.gpu_budget)} GB per GPU: more GPUs "
            f"(hardware.gpus_per_node / hardware.nodes), a shorter data.seq_len, or a smaller model")


def _fragmentation_advice(d: Diagnosis, numbers: OomNumbers) -> None:
    if numbers.reserved_unallocated and numbers.reserved_unallocated >= GIB:
        d.advice.append(f"{numbers.reserved_unallocated / GIB:.2f} GiB was reserved but unallocated (fragmentation): "
                        f"also try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")


FSDP_IN_LOG = re.compile(r"(torch/distributed/fsdp/|FullyShardedDataParallel|\bFSDP\b|fsdp_sharding_strategy|--fsdp\b)")


def _save_gather(f: Found, d: Diagnosis) -> bool:
    """An OOM while saving where the whole model is assembled on one GPU: FSDP's full state dict without CPU
    offload (the log's run was FSDP), or ZeRO-3 with the 16-bit gather on."""
    r = f.resolved
    if f.log.has(FSDP_IN_LOG):
        d.proposal = Proposal(
            "gather the full state dict on the CPU, on rank 0 only: FullStateDictConfig(offload_to_cpu=True, "
            "rank0_only=True) under FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, ...) in the save "
            "(accelerate: fsdp_state_dict_type: SHARDED_STATE_DICT, and merge the shards after)", [],
            "the log's run is FSDP: a full state dict assembled without offload_to_cpu puts every parameter, "
            "unsharded, on each GPU at once at the save - after training fitted. Offloaded, the copy is built in host "
            "memory on rank 0; a sharded save writes each rank's shard and needs no gather at all")
        return True
    if dsc.zero_stage(r.ds) != 3 or not dsc.gather_16bit_on_save(r.ds):
        return False
    d.proposal = Proposal("save ZeRO-3 shards only, convert offline", [dsc.set_override(
        f"zero_optimization.{dsc.zero_key(r.ds, 'gather_16bit_weights_on_model_save')}", False)],
        "stage3_gather_16bit_weights_on_model_save assembles the whole 16-bit model on rank 0's GPU at every save; "
        "without it each rank writes its shard and `python -m deepspeed.utils.zero_to_fp32 CHECKPOINT_DIR "
        "OUTPUT_DIR` rebuilds the weights on the CPU afterwards")
    return True


def _not_memory_pressure(f: Found, d: Diagnosis, numbers: OomNumbers, now: "ladder.Price", phase: str) -> bool:
    """The estimate says the preset fits: name what else took the memory, when the log shows it."""
    budget = now.estimate.gpu_budget
    d.advice.append(f"the planner puts preset {f.resolved.config.name} at {gb(now.total)} of {gb(budget)} GB per GPU: "
                    f"it fits, so this is not ordinary memory pressure")
    causes = [c for c in (_pinned(f), _other_process(numbers), _fragmented(numbers), _leak(f, phase)) if c]
    if not causes:  # the planner's verdict gates the ladder: its rungs come after finding what else holds memory
        causes = [_outside_the_config(f, now)]
    d.proposal, d.then = causes[0], causes[1:]
    fallback = ladder.walk(f, ladder.LADDERS.get(phase, ladder.OOM_LADDER), ladder.pricer_for(f, OomNumbers())).proposal
    if fallback is not None:
        d.then.append(replace(fallback, step=f"if the memory is really needed: {fallback.step}"))
    return True


def _outside_the_config(f: Found, now: "ladder.Price") -> Proposal:
    """The planner fits the config and the log names no other holder: what differs from the planned run is outside
    the config - the code that runs it (the launcher or framework and its version), another process, the data."""
    frameworks = sorted({fr.package for fr in (f.log.frames(f.index) or []) if fr.package} - COMMON_PACKAGES)
    who = f" ({', '.join(frameworks)})" if frameworks else ""
    return Proposal("find what holds the memory outside the planned config (the planner says it fits)", [],
                    f"the planner puts this config at {gb(now.total)} of {gb(now.estimate.gpu_budget)} GB per GPU, so a "
                    f"memory change is not the first thing to try: compare with a run of the same config that fitted - "
                    f"the version of the framework or launcher that started this one{who} (pin the release that worked), "
                    f"another process on the GPU (`nvidia-smi`), sequences longer than data.seq_len, tensors kept across "
                    f"steps; torch.cuda.memory_summary() at the failure names who holds it")


COMMON_PACKAGES = {"torch", "deepspeed", "transformers", "accelerate", "peft", "trl", "python", "runpy", "threading",
                   "contextlib", "functools", "multiprocessing", "site-packages", "dist-packages", ""}


def _pinned(f: Found) -> Optional[Proposal]:
    context = f.log.traceback_of(f.index)
    wsl = f.log.has(WSL)
    if not (wsl or PINNED.search(context)):
        return None
    overrides = dsc.unpinned_offload_overrides(f.resolved.ds)
    where = ("WSL2 limits page-locked host memory" if wsl else
             "the allocation that failed pins host memory")
    return Proposal("stop pinning host memory" + ("" if overrides else " (pin_memory=False)"), overrides,
                    f"{where}: pinned (page-locked) buffers of the CPU offload or the data loader fail as a CUDA "
                    f"out-of-memory error while the GPU still has room; unpinned copies are slower but work "
                    f"(DeepSpeed honours pin_memory=false since 0.10.1)")


def _other_process(numbers: OomNumbers) -> Optional[Proposal]:
    if numbers.others is None or numbers.others < GIB:
        return None
    return Proposal("free the GPU: another process holds its memory", [],
                    f"{numbers.others / GIB:.1f} GiB of the GPU is held outside this process (capacity - free - this "
                    f"process): a leftover rank of an earlier run, another job or a notebook; `nvidia-smi` names the "
                    f"PID - stop it or run on another GPU")


def _fragmented(numbers: OomNumbers) -> Optional[Proposal]:
    frag = numbers.reserved_unallocated
    if not frag or frag < max(numbers.requested or 0, GIB):
        return None
    return Proposal("let the allocator grow segments (fragmentation)", [],
                    f"{frag / GIB:.2f} GiB is reserved by PyTorch but unallocated - more than the "
                    f"{(numbers.requested or 0) / GIB:.2f} GiB that failed: the free memory is fragmented. "
                    f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets segments grow instead", env=EXPANDABLE)


def _leak(f: Found, phase: str) -> Optional[Proposal]:
    if phase not in ("forward", "backward", "step", "training", "unknown"):
        return None
    steps = [int(g) for m in f.log.all(TRAINING_STEP) for g in m.groups()[1:] if g]
    if not steps or max(steps) < 10:
        return None
    return Proposal(f"find what grows across steps (it ran {max(steps)} steps first)", [],
                    "the preset fits and the run trained for a while before the OOM: memory grows step by step - a "
                    "loss or metric kept as a tensor instead of .item(), outputs kept for logging, a cache that is "
                    "never cleared. Compare torch.cuda.memory_allocated() across steps; "
                    "torch.cuda.memory._record_memory_history() names the allocation site")


# --- host RAM ------------------------------------------------------------------------------------------------

SWAP = ("confirm the kernel's OOM killer ended it (`dmesg -T | grep -i 'killed process'`), then give the peak "
        "room: add swap (`sudo fallocate -l 128G /swapfile && sudo chmod 600 /swapfile && sudo mkswap /swapfile "
        "&& sudo swapon /swapfile`; in WSL set memory= and swap= in %UserProfile%\\.wslconfig) or more RAM")


def diagnose_host_oom(f: Found) -> Diagnosis:
    r, phase = f.resolved, phases.phase_before(f.log, f.index)
    d = Diagnosis("host_oom", f"host RAM ran out {phases.WORDS[phase]}: the kernel's OOM killer ended the process "
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
