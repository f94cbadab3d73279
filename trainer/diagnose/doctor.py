"""`python -m trainer doctor PRESET LOG`: recognise why a run failed and propose the next change.

The log (or traceback file) is matched against a table of known failures, most specific first; the
proposal is a list of `--set` overrides for the same preset, with the reason. The current config is
read through `trainer.ds` accessors, so rungs already taken are skipped.

| failure                         | recognised by                                              | next change                        |
|---------------------------------|------------------------------------------------------------|------------------------------------|
| OOM while loading / zero.Init   | CUDA OOM or SIGKILL (-9) with from_pretrained / zero.Init / | stage 3 (sharded load), then param |
|                                 | "Loading checkpoint shards" in the traceback               | offload (CPU, then NVMe)           |
| CUDA out of memory              | torch.OutOfMemoryError / "CUDA out of memory"              | the seed's OOM ladder (step 7.1)   |
| fp16 loss scale at its minimum  | "Current loss scale already at minimum" / overflow at 1    | bf16 if the GPU has it, else raise |
|                                 |                                                            | fp16.min_loss_scale                |
| stage-3 save incomplete         | "Did not save the model", torch.Size([0]) weights          | gather 16-bit weights on save, or  |
|                                 |                                                            | zero_to_fp32                       |
| DeepSpeedCPUAdam build failure  | "Error building extension 'cpu_adam'", no ds_opt_adam      | fix the toolchain; torch AdamW     |
| NCCL timeout                    | "Watchdog caught collective operation timeout"             | find the stuck rank / fabric       |
| batch-size triad                | "Check batch related parameters"                           | accumulation for this world size   |

The OOM ladder (seed step 7.1): 1 smaller micro-batch (same global batch), 2 activation
checkpointing, 3 ZeRO stage up (0/1 -> 2 -> 3), 4 optimizer offload to CPU, then parameter offload,
5 smaller stage-3 buffers, 6 NVMe offload, 7 LoRA.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import shlex
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional

from .. import ds as dsc
from .. import hardware
from ..errors import UserError
from ..launch.command import command_for
from ..options import add_preset_arguments, load_and_resolve
from ..plan.estimate import gb, plan_for_resolved
from ..presets import load_preset
from ..resolve import Resolved, resolve


@dataclass(frozen=True)
class Proposal:
    step: str
    overrides: list[str]
    reason: str


@dataclass
class Diagnosis:
    failure: str
    title: str
    evidence: str
    proposal: Optional[Proposal] = None
    then: list[Proposal] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)

    @property
    def recognised(self) -> bool:
        return self.failure != "unrecognised"


# --- reading the log -----------------------------------------------------------------------------

OOM = re.compile(r"(torch\.(cuda\.)?OutOfMemoryError|CUDA out of memory|CUDA error: out of memory)")
KILLED = re.compile(r"(exits? with return code = -9|return code -9|signal 9|SIGKILL|^Killed$|Out of memory: Killed process)",
                    re.MULTILINE)
LOADING = re.compile(r"(from_pretrained|zero\.Init|partition_parameters\.py|Loading checkpoint shards|"
                     r"_load_pretrained_model|load_state_dict|modeling_utils\.py)")
ZERO_INIT = re.compile(r"(zero\.Init|partition_parameters\.py)")
TRAINING_STEP = re.compile(r"(engine\.backward|\.backward\(|engine\.step|optimizer\.step|step=\d+)")
LOSS_SCALE = re.compile(r"(Current loss scale already at minimum|Attempted loss scale: 1, reducing to 1)")
SAVE_SKIPPED = re.compile(r"Did not save the model .* because stage3_gather_16bit_weights_on_model_save is False")
EMPTY_WEIGHTS = re.compile(r"(copying a param with shape torch\.Size\(\[0\]\)|shape torch\.Size\(\[0\]\) from checkpoint)")
CPU_ADAM = re.compile(r"(Error building extension 'cpu_adam'|'DeepSpeedCPUAdam' object has no attribute 'ds_opt_adam'|"
                      r"cpu_adam\.so: cannot open shared object)")
NCCL_TIMEOUT = re.compile(r"(Watchdog caught collective operation timeout|NCCL.*[Tt]imeout|"
                          r"DistBackendError.*[Tt]imeout)")
TRIAD = re.compile(r"train_batch_size is not equal to micro_batch_per_gpu \* gradient_acc_step \* world_size "
                   r"(\d+) != (\d+) \* (\d+) \* (\d+)")
ERROR_LINE = re.compile(r"(Error|Exception|error:|FAILED|Traceback|fatal)", re.IGNORECASE)


def first_line(pattern: re.Pattern, text: str) -> Optional[str]:
    for line in text.splitlines():
        if pattern.search(line):
            return line.strip()
    return None


def traceback_of(pattern: re.Pattern, text: str) -> str:
    """The log from the last 'Traceback' before the first line matching `pattern` up to that line."""
    lines = text.splitlines()
    hit = next((i for i, line in enumerate(lines) if pattern.search(line)), len(lines) - 1)
    start = max((i for i in range(hit + 1) if "Traceback" in lines[i]), default=max(0, hit - 40))
    return "\n".join(lines[max(0, start - 5):hit + 1])  # a few lines before: progress bars of the load


def read_log(path: str) -> str:
    file = Path(path)
    if not file.is_file():
        raise UserError(f"log file {path!r} not found: give the failed run's log or traceback file")
    return file.read_text(errors="replace")


# --- the OOM ladder ------------------------------------------------------------------------------

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


Reresolve = Callable[[list[str]], Resolved]  # the same preset with extra --set overrides, resolved


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
                                        f"{_first_line(err)}; the next rungs are judged without it)")
    return proposals


# --- one handler per failure -------------------------------------------------------------------


def diagnose_load_oom(r: Resolved, text: str, evidence: str, reresolve: Optional[Reresolve] = None) -> Diagnosis:
    host = bool(KILLED.search(text)) and not OOM.search(text)
    where = "host RAM (the kernel's OOM killer, signal 9)" if host else "GPU memory"
    d = Diagnosis("load_oom", f"out of {where} while loading the model / zero.Init", evidence)
    stage, param = dsc.zero_stage(r.ds), dsc.offload_param_device(r.ds)
    if stage < 3:
        new = dsc.base_config(3, dsc.offload_optimizer_device(r.ds), "none")
        d.proposal = Proposal("ZeRO stage 3 (sharded load)", dsc.zero_overrides(r.ds, new),
                              f"below stage 3 every rank loads the whole model ({r.world_size} copies per node in "
                              f"host RAM, a full copy per GPU); at stage 3 the trainer builds and loads it under "
                              f"deepspeed.zero.Init, so each rank only materialises its shard")
    elif host and param == "cpu":
        new = dsc.base_config(3, "nvme", "nvme", "/local_nvme")
        d.proposal = Proposal("NVMe offload", dsc.zero_overrides(r.ds, new),
                              "the parameters offloaded to host RAM do not fit it: put them (and the optimizer) "
                              "on NVMe; point nvme_path at a local NVMe mount")
    elif host and param == "none" and dsc.offload_optimizer_device(r.ds) == "cpu":
        new = dsc.base_config(3, "nvme", "none", "/local_nvme")
        d.proposal = Proposal("optimizer offload to NVMe", dsc.zero_overrides(r.ds, new),
                              "the load is sharded already; the host-side fp32 optimizer states (16 bytes/param "
                              "per node, x1.5 in DeepSpeed's estimate) are what does not fit: move them to NVMe")
    elif not host and param == "none":
        new = dsc.base_config(3, dsc.offload_optimizer_device(r.ds), "cpu")
        d.proposal = Proposal("parameter offload to CPU", dsc.zero_overrides(r.ds, new),
                              "even sharded, the 16-bit parameters do not fit next to the load buffers; offloaded "
                              "they are loaded straight into host memory")
    if stage == 3 and not ZERO_INIT.search(text):
        d.advice.append("the traceback shows no zero.Init (partition_parameters.py): with your own script, create "
                        "transformers' HfDeepSpeedConfig(ds_config) before from_pretrained, or build the model "
                        "inside `with deepspeed.zero.Init(config_dict_or_path=ds_config):` (seed step 7.2)")
    if host:
        d.advice.append("host RAM per node must hold what DeepSpeed's estimator says; `python -m trainer plan` "
                        "prints it per candidate (CPU/node column)")
    return d


def diagnose_oom(r: Resolved, text: str, evidence: str, reresolve: Optional[Reresolve] = None) -> Diagnosis:
    d = Diagnosis("cuda_oom", "CUDA out of memory" + _oom_details(evidence), evidence)
    steps = walk_ladder(r, OOM_LADDER, reresolve)
    d.proposal, d.then = (steps[0], steps[1:]) if steps else (None, [])
    if not steps:
        d.advice.append("every rung of the seed's OOM ladder is already taken: more GPUs, a shorter data.seq_len, "
                        "or a smaller model")
    fragmented = re.search(r"([\d.]+) GiB is reserved by PyTorch but unallocated", evidence)
    if fragmented and float(fragmented.group(1)) >= 1.0:
        d.advice.append(f"{fragmented.group(1)} GiB was reserved but unallocated (fragmentation): also try "
                        f"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    return d


def _oom_details(evidence: str) -> str:
    wanted = re.search(r"Tried to allocate ([\d.]+ [MG]iB)", evidence)
    gpu = re.search(r"GPU (\d+) has a total capacity of ([\d.]+ GiB)", evidence)
    parts = ([f"tried to allocate {wanted.group(1)}"] if wanted else []) + (
        [f"GPU {gpu.group(1)} of {gpu.group(2)}"] if gpu else [])
    return f" ({', '.join(parts)})" if parts else ""


def diagnose_loss_scale(r: Resolved, text: str, evidence: str, reresolve: Optional[Reresolve] = None) -> Diagnosis:
    d = Diagnosis("fp16_loss_scale", "fp16 dynamic loss scale collapsed to its minimum", evidence)
    gpu = hardware.gpu(r.config.hardware.gpu)
    if gpu.bf16:
        d.proposal = Proposal("switch to bf16", ["train.precision=bf16"] + dsc.precision_overrides(r.ds, "bf16"),
                              f"{gpu.description} has bf16: the fp32 exponent range needs no loss scaling, so it "
                              f"cannot collapse (seed step 7.2)")
    else:
        current = dsc.fp16_min_loss_scale(r.ds)
        raised = max(128.0, current * 2)
        d.proposal = Proposal("raise fp16.min_loss_scale", [dsc.min_loss_scale_override(raised)],
                              f"{gpu.description if gpu else 'this GPU'} has no bf16; a floor of {raised:g} (now "
                              f"{current:g}) stops the scale from collapsing - overflowing steps are then skipped "
                              f"instead of ending the run")
    d.advice.append("a scale that keeps overflowing at 1 usually means the run is diverging: lower train.lr or "
                    "check the data for broken samples before the failure")
    return d


def diagnose_save(r: Resolved, text: str, evidence: str, reresolve: Optional[Reresolve] = None) -> Diagnosis:
    d = Diagnosis("stage3_save", "ZeRO-3 saved incomplete (sharded or empty) weights", evidence)
    if dsc.zero_stage(r.ds) == 3 and not dsc.gather_16bit_on_save(r.ds):
        d.proposal = Proposal("gather 16-bit weights on save", [dsc.gather_on_save_override(r.ds)],
                              "under ZeRO-3 each rank holds a shard; DeepSpeed only writes a whole 16-bit model "
                              "when told to gather it at save time (seed step 7.2)")
    d.advice.append("weights already trained are in the DeepSpeed checkpoint: rebuild them with "
                    "`python -m deepspeed.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR` (OUTPUT_DIR is a folder)")
    return d


def diagnose_cpu_adam(r: Resolved, text: str, evidence: str, reresolve: Optional[Reresolve] = None) -> Diagnosis:
    d = Diagnosis("cpu_adam_build", "DeepSpeedCPUAdam failed to build (JIT extension cpu_adam)", evidence)
    cause = first_line(re.compile(r"(not found|No such file|fatal error|CUDA_HOME)"), text)
    d.advice.append("fix the toolchain first, then rerun (it compiles once into ~/.cache/torch_extensions): "
                    "apt install build-essential python3-dev ninja-build, or prebuild with "
                    "DS_BUILD_CPU_ADAM=1 when installing DeepSpeed" + (f"; the build said: {cause}" if cause else ""))
    if dsc.offload_optimizer_device(r.ds) != "none" and dsc.forces_ds_cpu_optimizer(r.ds):
        d.proposal = Proposal("torch AdamW on the CPU (fallback)", dsc.torch_adam_on_cpu_overrides(),
                              "lets the offloaded optimizer run without the compiled extension; the CPU step is "
                              "5-7x slower than DeepSpeedCPUAdam, so fix the build when you can")
    return d


def diagnose_nccl(r: Resolved, text: str, evidence: str, reresolve: Optional[Reresolve] = None) -> Diagnosis:
    op = re.search(r"OpType=(\w+)", evidence)
    timeout = re.search(r"Timeout\(ms\)=(\d+)", evidence)
    title = "NCCL collective timed out" + (f" ({op.group(1)}" if op else "") + (
        f" after {int(timeout.group(1)) // 1000} s)" if timeout else (")" if op else ""))
    d = Diagnosis("nccl_timeout", title, evidence)
    d.advice += [
        "one rank stopped reaching the collective: look for the first error of any rank earlier in the log "
        "(an OOM, an exception, a stuck data loader) - the timeout is the symptom, not the cause",
        "if no rank failed, check the fabric: rerun with NCCL_DEBUG=INFO (look for NET/IB vs NET/Socket), set "
        "NCCL_SOCKET_IFNAME to the fast interface, NCCL_IB_DISABLE=0 with InfiniBand",
        "do not just raise the timeout: a hang stays a hang",
    ]
    if r.config.hardware.nodes > 1 and dsc.zero_stage(r.ds) == 3 and dsc.hpz_partition_size(r.ds) <= 1:
        d.advice.append("once the hang is fixed, a slow cross-node link is helped by ZeRO++ hpZ (see "
                        "`python -m trainer lint`)")
    return d


def diagnose_triad(r: Resolved, text: str, evidence: str, reresolve: Optional[Reresolve] = None) -> Diagnosis:
    total, micro, accum, world = (int(x) for x in TRIAD.search(evidence).groups())
    d = Diagnosis("batch_triad", f"batch-size triad: {total} != {micro} x {accum} x {world} (world size {world})",
                  evidence)
    overrides = []
    hw = r.config.hardware
    if world != r.world_size:
        nodes = hw.nodes if world % hw.nodes == 0 else 1
        overrides += ([f"hardware.nodes={nodes}"] if nodes != hw.nodes else []) + [
            f"hardware.gpus_per_node={world // nodes}"]
    accum_for_total = dsc.accumulation(total, micro, world)
    if accum_for_total:
        overrides += [f"train.micro_batch_size={micro}", f"train.grad_accum={accum_for_total}"]
        keep = f"grad_accum {accum_for_total} keeps train_batch_size {total} at world size {world}"
    else:
        overrides += [f"train.micro_batch_size={micro}", f"train.grad_accum={accum}"]
        keep = f"train_batch_size becomes {micro * accum * world}"
    d.proposal = Proposal("make the triad agree with the launched world size", overrides,
                          f"DeepSpeed requires train_batch_size = micro x accumulation x world size (the global "
                          f"world, also under AutoTP); {keep}. The trainer solves the third value from the other two "
                          f"when the DeepSpeed batch keys are 'auto'")
    return d


# Most specific first: a load-time OOM is also an OOM; an NCCL timeout after an OOM is the OOM's symptom.
HANDLERS: list[tuple[str, Callable[[str], Optional[str]], Callable]] = [
    ("load_oom", lambda t: _load_oom_line(t), diagnose_load_oom),
    ("cuda_oom", lambda t: first_line(OOM, t), diagnose_oom),
    ("fp16_loss_scale", lambda t: first_line(LOSS_SCALE, t), diagnose_loss_scale),
    ("stage3_save", lambda t: first_line(SAVE_SKIPPED, t) or first_line(EMPTY_WEIGHTS, t), diagnose_save),
    ("cpu_adam_build", lambda t: first_line(CPU_ADAM, t), diagnose_cpu_adam),
    ("batch_triad", lambda t: first_line(TRIAD, t), diagnose_triad),
    ("nccl_timeout", lambda t: first_line(NCCL_TIMEOUT, t), diagnose_nccl),
]


def _load_oom_line(text: str) -> Optional[str]:
    """An OOM (or SIGKILL) whose traceback is in model construction/loading, not a training step."""
    line = first_line(OOM, text) or first_line(KILLED, text)
    if line is None:
        return None
    context = traceback_of(OOM if OOM.search(text) else KILLED, text)
    if LOADING.search(context) and not TRAINING_STEP.search(context):
        return line
    return None


def diagnose(r: Resolved, text: str, reresolve: Optional[Reresolve] = None) -> Diagnosis:
    for _, match, handler in HANDLERS:
        evidence = match(text)
        if evidence:
            return handler(r, text, evidence, reresolve)
    first = first_line(ERROR_LINE, text) or next((l.strip() for l in reversed(text.splitlines()) if l.strip()), "")
    return Diagnosis("unrecognised", "not recognised", first, advice=[
        "none of the known failures (CUDA OOM, OOM while loading, fp16 loss scale, ZeRO-3 save, CPU Adam build, "
        "NCCL timeout, batch triad) matched; the first error line is shown above"])


# --- the command ---------------------------------------------------------------------------------


def doctor_arguments(parser: argparse.ArgumentParser) -> None:
    add_preset_arguments(parser)
    parser.add_argument("log", help="the failed run's log or traceback file")
    parser.add_argument("--json", action="store_true", help="print the diagnosis as JSON")


def doctor(args) -> int:
    text = read_log(args.log)
    resolved = load_and_resolve(args)
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout when imported
        d = diagnose(resolved, text, lambda extra: resolve(load_preset(args.preset, args.overrides + extra),
                                                           args.world_size))
        memory = memory_effect(args, resolved, d.proposal) if d.failure == "cuda_oom" else None
    if args.json:
        print(json.dumps(diagnosis_json(args, resolved, d, memory), indent=2))
    else:
        print_diagnosis(args, resolved, d, memory)
    return 0 if d.recognised else 1


def memory_effect(args, resolved: Resolved, proposal: Optional[Proposal]) -> Optional[str]:
    """The planner's per-GPU estimate now and after the proposed change (when both resolve)."""
    if proposal is None or resolved.config.hardware.gpu == "cpu":
        return None
    before = plan_for_resolved(resolved)
    try:
        after = plan_for_resolved(resolve(load_preset(args.preset, args.overrides + proposal.overrides),
                                          args.world_size))
    except UserError:
        return f"planner: now {gb(before.gpu_total)} GB per GPU of {gb(before.gpu_budget)}"
    return (f"planner: {gb(before.gpu_total)} -> {gb(after.gpu_total)} GB per GPU "
            f"(budget {gb(before.gpu_budget)}; host {gb(after.cpu_bytes_per_node)} GB per node after)")


def rerun_command(args, resolved: Resolved, proposal: Proposal) -> str:
    """The launch line for the preset with the proposed change, for the world size the run had (the planner's
    and the preset headers' builder, so the trainer accepts it). When the changed config does not resolve on
    this machine (an NVMe path that exists only on the cluster), the line is laid out from the run's config
    and says so."""
    overrides = args.overrides + proposal.overrides
    try:
        with contextlib.redirect_stdout(sys.stderr):
            changed = resolve(load_preset(args.preset, overrides), args.world_size)  # offload may change
    except UserError as err:
        return f"{command_for(resolved, args.preset, overrides)}  # not resolved here: {_first_line(err)}"
    return command_for(changed, args.preset, overrides)


def _first_line(err: Exception) -> str:
    lines = [line.strip(" -") for line in str(err).splitlines() if line.strip()]
    return lines[1] if len(lines) > 1 and lines[0].endswith(":") else lines[0]


def diagnosis_json(args, resolved: Resolved, d: Diagnosis, memory: Optional[str]) -> dict:
    return {"recognised": d.recognised, "failure": d.failure, "title": d.title, "evidence": d.evidence,
            "proposal": asdict(d.proposal) if d.proposal else None, "then": [asdict(p) for p in d.then],
            "advice": d.advice, "memory": memory,
            "command": rerun_command(args, resolved, d.proposal) if d.proposal else None}


def print_diagnosis(args, r: Resolved, d: Diagnosis, memory: Optional[str]) -> None:
    print(f"doctor: {r.config.name} (world {r.world_size}, ZeRO-{dsc.zero_stage(r.ds)}, "
          f"offload {dsc.offload_optimizer_device(r.ds)}/{dsc.offload_param_device(r.ds)}, "
          f"micro {r.batch.micro_batch_size} x accum {r.batch.grad_accum}, checkpointing "
          f"{'on' if r.config.model.gradient_checkpointing else 'off'}, {dsc.precision(r.ds)}) + {args.log}")
    print(f"{'recognised' if d.recognised else 'NOT RECOGNISED'}: {d.title}")
    print(f"  evidence: {d.evidence}")
    if d.proposal:
        print(f"next change ({d.proposal.step}):")
        print("  " + " ".join(f"--set {shlex.quote(o)}" for o in d.proposal.overrides))
        print(f"  reason: {d.proposal.reason}")
        if memory:
            print(f"  {memory}")
        print(f"  rerun: {rerun_command(args, r, d.proposal)}")
    for p in d.then:
        print(f"if that is not enough: {p.step}: {' '.join('--set ' + shlex.quote(o) for o in p.overrides)}")
    for line in d.advice:
        print(f"advice: {line}")
