"""The handlers for everything but memory and collectives: precision, saving and loading under ZeRO-3, op
builds, launch problems, NVMe swap, known DeepSpeed regressions. Each turns a recogniser's hit into a
Diagnosis with the next change: `--set` overrides the trainer accepts, or the exact step when the fix is
outside the config (a toolchain, ssh keys, a version pin)."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from .. import ds as dsc
from .. import hardware
from .findings import Diagnosis, Found, Proposal, planned

TRAINER_DEEPSPEED = "0.19.8"  # the version this trainer pins (pyproject.toml) and is tested on


# --- fp16 loss scale -----------------------------------------------------------------------------------------


def diagnose_loss_scale(f: Found) -> Diagnosis:
    r = f.resolved
    d = Diagnosis("fp16_loss_scale", "fp16 dynamic loss scale collapsed to its minimum", f.line)
    gpu = hardware.gpu(r.config.hardware.gpu)
    if dsc.precision(r.ds) != "fp16":
        d.advice.append(f"this log did not come from preset {r.config.name} as configured: dynamic loss scaling "
                        f"exists only in fp16, and {r.config.name} trains in {dsc.precision(r.ds)} - diagnose the "
                        f"log with the config that wrote it (e.g. --set train.precision=fp16), or simply run the "
                        f"preset as it is")
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


# --- ZeRO-3 weights: saving and loading ----------------------------------------------------------------------


def diagnose_save(f: Found) -> Diagnosis:
    r = f.resolved
    d = Diagnosis("stage3_save", "ZeRO-3 saved incomplete (sharded or empty) weights", f.line)
    if dsc.zero_stage(r.ds) == 3 and not dsc.gather_16bit_on_save(r.ds):
        d.proposal = Proposal("gather 16-bit weights on save", [dsc.gather_on_save_override(r.ds)],
                              "under ZeRO-3 each rank holds a shard; DeepSpeed only writes a whole 16-bit model "
                              "when told to gather it at save time (seed step 7.2)")
    elif "stage3_gather_16bit_weights_on_model_save" in f.log.text:
        d.advice.append(f"this log did not come from preset {r.config.name} as configured: it " + (
            "already gathers 16-bit weights on save" if dsc.zero_stage(r.ds) == 3 else "is not ZeRO-3"))
    d.advice.append("weights already trained are in the DeepSpeed checkpoint: rebuild them with "
                    "`python -m deepspeed.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR` (OUTPUT_DIR is a folder)")
    return d


def diagnose_zero3_load(f: Found) -> Diagnosis:
    r = f.resolved
    d = Diagnosis("zero3_load", "a full state dict was loaded into a ZeRO-3 partitioned model (its parameters are "
                                "torch.Size([0]) placeholders)", f.line)
    own = "" if r.config.model.name_or_path else " (set model.name_or_path to the weights' directory or hub id)"
    d.proposal = Proposal("load the weights while the model is built (from_pretrained under deepspeed.zero.Init)", [],
                          "under ZeRO-3 each rank holds only a partition, so load_state_dict into the engine (or "
                          "into a model created under the stage-3 strategy) sees empty parameters. Let the loader "
                          f"gather each partition: this trainer loads model.name_or_path under deepspeed.zero.Init"
                          f"{own}; in your own script create HfDeepSpeedConfig(ds_config) (or the TrainingArguments "
                          "with deepspeed=...) before from_pretrained, or copy weights inside "
                          "`deepspeed.zero.GatheredParameters(params, modifier_rank=0)`")
    d.advice.append("to read a trained ZeRO-3 checkpoint outside DeepSpeed, convert it first: `python -m "
                    "deepspeed.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR` and load that into an unpartitioned model")
    return d


# --- JIT-compiled ops ----------------------------------------------------------------------------------------

OP_OF_OBJECT = {"CPUAdam": "cpu_adam", "multi_tensor_adam": "fused_adam", "fused_adam_frontend": "fused_adam", "cpu_adam_impl": "cpu_adam",
                "deepspeed_aio_common": "async_io", "deepspeed_py_aio": "async_io"}
BUILD_ENV = {"cpu_adam": "DS_BUILD_CPU_ADAM", "fused_adam": "DS_BUILD_FUSED_ADAM", "async_io": "DS_BUILD_AIO",
             "cpu_adagrad": "DS_BUILD_CPU_ADAGRAD", "cpu_lion": "DS_BUILD_CPU_LION", "fused_lamb": "DS_BUILD_FUSED_LAMB"}
OP_NAME = [re.compile(p) for p in (
    r"Error building extension '(\w+)'", r"Unable to JIT load the (\w+) op", r"Unable to pre-compile (\w+)",
    r"FAILED: (\w+?)(?:\.cuda)?\.(?:o|so)\b", r"/(\w+)/\1\.so: cannot open shared object", r"Building extension module (\w+)",
    r"\b(async_io) requires the", r"'DeepSpeed(CPUAdam)' object has no attribute 'ds_opt_adam'")]


@dataclass(frozen=True)
class BuildCause:
    pattern: re.Pattern
    cause: str
    fix: str


BUILD_CAUSES = [BuildCause(re.compile(p), c, x) for p, c, x in (
    (r"(c\+\+|g\+\+|gcc|cc): (command )?not found|-cc: not found",
     "there is no C/C++ compiler", "install one: `sudo apt install build-essential` (conda: `conda install gxx_linux-64`)"),
    (r"cannot find -l(curand|cudart|cublas)",
     "the linker cannot find the CUDA libraries (libcurand/libcudart) where torch's build looks",
     "point CUDA_HOME at the CUDA toolkit torch was built with and make its libraries visible - `export "
     "CUDA_HOME=/usr/local/cuda LIBRARY_PATH=$CUDA_HOME/lib64:$LIBRARY_PATH LD_LIBRARY_PATH=$CUDA_HOME/lib64:"
     "$LD_LIBRARY_PATH`, or link it where the build looks: `ln -s $CUDA_HOME/lib64/libcurand.so "
     "$(python -c 'import torch, os; print(os.path.dirname(torch.__file__))')/lib/`"),
    (r"nvcc fatal\s*: Value 'c\+\+17' is not defined",
     "the nvcc on PATH is older than CUDA 11 and has no C++17",
     "install the CUDA toolkit matching torch (`python -c 'import torch; print(torch.version.cuda)'`) and use its "
     "nvcc: `export CUDA_HOME=/usr/local/cuda-<that version> PATH=$CUDA_HOME/bin:$PATH`"),
    (r"unsupported GNU version|gcc versions later than|host compiler version",
     "the host gcc is newer than this nvcc supports",
     "build with a gcc this CUDA supports: `export CC=gcc-11 CXX=g++-11` (CUDA 11.8 supports gcc <= 11)"),
    (r"Your compiler \(c\+\+ [0-4]\.|ABI-incompatible|unrecognized command.line option .-std=c\+\+17",
     "the C++ compiler is too old (C++17 and torch's ABI need gcc >= 9)",
     "install gcc >= 9 (`sudo apt install g++-11` or `conda install gxx_linux-64=11`) and `export CC=gcc-11 CXX=g++-11`"),
    (r"(cuda_profiler_api|cuda_runtime|cusolverDn|cublas_v2|curand)\.h: No such file",
     "the CUDA headers are missing: only the CUDA runtime is installed, not the toolkit",
     "install the CUDA toolkit (nvcc and headers) matching torch and `export CUDA_HOME=/usr/local/cuda-<version>`"),
    (r"CUDA_HOME does not exist|MissingCUDAException|nvcc: (command )?not found|No such file or directory: '[^']*nvcc'",
     "nvcc is missing (CUDA_HOME unset or pointing at no toolkit)",
     "install the CUDA toolkit matching torch and `export CUDA_HOME=/usr/local/cuda-<version> PATH=$CUDA_HOME/bin:$PATH`"),
    (r"libaio|async_io requires",
     "the libaio development files (libaio.so and headers) are missing",
     "`sudo apt install libaio-dev` (RHEL: `sudo yum install libaio-devel`), or point CFLAGS=-I<dir>/include and "
     "LDFLAGS=-L<dir>/lib at a libaio built from source"),
    (r"Installed CUDA version (\S+) does not match the version torch was compiled with",
     "the CUDA toolkit and torch's CUDA differ", "use the toolkit matching torch.version.cuda for CUDA_HOME"),
)]


def find_op(f: Found) -> Optional[str]:
    for pattern in OP_NAME:
        for match in reversed(f.log.all(pattern)):
            return OP_OF_OBJECT.get(match.group(1), match.group(1))
    return None


def diagnose_op_build(f: Found) -> Diagnosis:
    op = find_op(f)
    d = Diagnosis("op_build", f"DeepSpeed's {op or 'CUDA/C++'} op failed to build (JIT extension)", f.line)
    cause = next((c for c in BUILD_CAUSES if f.log.has(c.pattern)), None)
    prebuild = (f"prebuild it when installing DeepSpeed so nothing compiles at run time: `{BUILD_ENV.get(op, 'DS_BUILD_OPS')}=1 "
                f"pip install deepspeed=={TRAINER_DEEPSPEED} --no-cache-dir --force-reinstall`, then `ds_report` "
                f"shows it installed")
    if cause is not None:
        d.proposal = Proposal(f"fix the build: {cause.fix}", [], f"{cause.cause}; rerun (it compiles once into "
                                                                  f"~/.cache/torch_extensions), or {prebuild}")
    else:
        d.proposal = Proposal("fix the build toolchain", [], f"the compiler output above the failure names the "
                              f"missing piece (compiler too old, CUDA_HOME/nvcc missing); `ds_report` lists what can "
                              f"build; or {prebuild}")
    fallback = _without_op(f, op)
    if fallback is not None:
        d.then.append(fallback)
    return d


def _without_op(f: Found, op: Optional[str]) -> Optional[Proposal]:
    """The same run without the op that failed to build, where the config allows it."""
    r = f.resolved
    if op == "cpu_adam" and dsc.offload_optimizer_device(r.ds) != "none" and dsc.forces_ds_cpu_optimizer(r.ds):
        return Proposal("or run torch's AdamW on the CPU (fallback)", dsc.torch_adam_on_cpu_overrides(),
                        "lets the offloaded optimizer run without the compiled extension; the CPU step is 5-7x "
                        "slower than DeepSpeedCPUAdam, so fix the build when you can")
    if op == "fused_adam" and dsc.offload_optimizer_device(r.ds) == "none":
        return Proposal("or use torch's Adam instead of FusedAdam (fallback)",
                        [dsc.set_override("optimizer.params.torch_adam", True)],
                        "DeepSpeed's Adam type then runs torch.optim.AdamW on the GPU: no extension to build, a "
                        "little slower")
    if op == "async_io" and "nvme" in (dsc.offload_optimizer_device(r.ds), dsc.offload_param_device(r.ds)):
        return _nvme_to_cpu(f)
    return None


def _nvme_to_cpu(f: Found) -> Optional[Proposal]:
    r = f.resolved
    to_cpu = lambda device: "cpu" if device == "nvme" else device  # noqa: E731
    new = dsc.base_config(3, to_cpu(dsc.offload_optimizer_device(r.ds)), to_cpu(dsc.offload_param_device(r.ds)))
    overrides = dsc.zero_overrides(r.ds, new)
    plan = planned(f.resolves(overrides))
    fits = "" if plan is None else f" (planner: {plan.cpu_bytes_per_node / 1e9:.0f} GB host RAM per node)"
    return Proposal("or offload to CPU instead of NVMe", overrides,
                    f"no async_io (libaio) needed when the states live in host RAM{fits}")


# --- launching: ranks, ssh ------------------------------------------------------------------------------------

def diagnose_triad(f: Found) -> Diagnosis:
    r, hw = f.resolved, f.resolved.config.hardware
    if f.match is None:  # the numbers wrapped past what the recogniser joins
        return Diagnosis("batch_triad", "batch-size triad: train_batch_size != micro x accumulation x world size",
                         f.line, advice=["run `python -m trainer show PRESET` for the triad the trainer solves"])
    total, micro, accum, world = (int(x) for x in f.match.groups())
    if world == 1 and r.world_size > 1:
        return _not_distributed(f, total)
    d = Diagnosis("batch_triad", f"batch-size triad: {total} != {micro} x {accum} x {world} (world size {world})",
                  f.line)
    overrides = []
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


def _not_distributed(f: Found, total: int) -> Diagnosis:
    r = f.resolved
    d = Diagnosis("not_distributed", f"the ranks never joined one process group: DeepSpeed saw world size 1, preset "
                                     f"{r.config.name} needs {r.world_size} ranks", f.line)
    d.proposal = Proposal(f"launch the {r.world_size} ranks with a launcher that sets up torch.distributed", [],
                          "world size 1 with train_batch_size built for several ranks means each process ran alone "
                          "(started by mpirun/srun or plain python without RANK/WORLD_SIZE/MASTER_ADDR, or the "
                          "DeepSpeed config was checked before the process group existed); training on one GPU is "
                          "not the fix. Start the ranks with the command below")
    d.advice += [
        "under mpirun/srun run `python -m trainer launch --preset P --nnodes N --node-rank $NODE_RANK --master-addr "
        "HEAD` once per node (it sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or export those from "
        "OMPI_COMM_WORLD_* / SLURM_* before starting python",
        "in your own script, call deepspeed.init_distributed() (or build TrainingArguments) before anything creates "
        "the DeepSpeed config or enters zero.Init: until then DeepSpeed reads world size 1",
    ]
    return d


SSH_HOST = [re.compile(p) for p in (r"host=(\S+) was not reachable", r"ssh -o PasswordAuthentication=no (\S+) hostname",
                                    r"^(\S+): ssh exited with exit code", r"^(\S+?): .*Permission denied")]


def diagnose_ssh(f: Found) -> Diagnosis:
    host = next((m.group(1) for p in SSH_HOST for m in f.log.all(p)), "HOST")
    host = host.split(":")[-1].strip() or "HOST"
    r = f.resolved
    d = Diagnosis("ssh_launch", f"the DeepSpeed launcher could not ssh to {host}", f.line)
    d.proposal = Proposal(f"set up passwordless ssh to {host}: ssh-copy-id {host}", [],
                          f"the launcher reaches every hostfile node (pdsh, localhost included) by ssh without a "
                          f"password: `ssh-keygen -t ed25519 -N '' -f ~/.ssh/id_ed25519` once, `ssh-copy-id {host}` "
                          f"for each node, check with `ssh -o PasswordAuthentication=no {host} hostname`, and install "
                          f"pdsh on every node")
    d.advice.append("or start each node yourself, no ssh needed: on node i run `python -m trainer launch --preset "
                    f"{r.config.name} --nnodes {r.config.hardware.nodes} --node-rank i --master-addr NODE0` (or the "
                    "same torchrun line on every node)")
    if r.config.hardware.nodes == 1:
        d.advice.append("on a single node no ssh is needed: run without --hostfile (and without --autotuning, which "
                        "launches through pdsh)")
    return d


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


# --- known DeepSpeed regressions -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Regression:
    pattern: re.Pattern
    broken: str
    pin: str
    source: str


REGRESSIONS = [Regression(re.compile(p), b, v, s) for p, b, v, s in (
    (r"object has no attribute 'ds_grads_remaining'", "0.16.5 (ZeRO-3 backward hooks; still seen in 0.17.6)",
     "0.16.4", "deepspeedai/DeepSpeed#7203, #7615"),
    (r"'DeepSpeedZeRoOffload' object has no attribute '_register_hooks_recursively'",
     "0.16.x (the ZeRO-3 offload API the calling code expects changed after 0.15.4)", "0.15.4", "om-ai-lab/VLM-R1#32"),
)]
LOG_VERSION = re.compile(r"(?:DeepSpeed (?:info: )?version[=:]\s*|deepspeed==|DeepSpeed version:\s*)(\d+\.\d+\.\d+)",
                         re.IGNORECASE)


def find_regression(log) -> Optional[tuple[int, Regression]]:
    for regression in REGRESSIONS:
        index = log.first(regression.pattern)
        if index is not None:
            return index, regression
    return None


def diagnose_version(f: Found) -> Diagnosis:
    _, regression = find_regression(f.log)
    version = next((m.group(1) for m in f.log.all(LOG_VERSION)), None)
    d = Diagnosis("ds_version", f"a known DeepSpeed regression ({'DeepSpeed ' + version + ', ' if version else ''}"
                                f"broken in {regression.broken})", f.line)
    d.proposal = Proposal(f"pin DeepSpeed: pip install 'deepspeed=={regression.pin}'", [],
                          f"the code path in this traceback breaks in {regression.broken}; {regression.pin} is the "
                          f"release the thread confirms working ({regression.source})")
    d.advice.append(f"this trainer pins and is tested on DeepSpeed {TRAINER_DEEPSPEED}: if the trainer itself hit "
                    f"this, reinstall its pin (`pip install deepspeed=={TRAINER_DEEPSPEED}`) and report it")
    return d
