"""The recognisers: a table of (failure, how to find its evidence line, handler), most specific first.

| failure              | recognised by                                                | next change                          |
|----------------------|--------------------------------------------------------------|--------------------------------------|
| ssh_launch           | the launcher's ssh check / pdsh failing on a hostfile node   | passwordless ssh (the exact steps)   |
| ds_version           | the error signature of a known DeepSpeed regression          | the version to pin                   |
| zero3_load           | "the shape in current model is torch.Size([0])"              | load under zero.Init / from_pretrained |
| stage3_save          | "Did not save the model ...", ZeRO-3 weights of shape [0]    | gather 16-bit weights on save        |
| nvme_aio             | "buffer nbytes != file bytes", an aio assertion              | check the NVMe path, then CPU offload |
| load_oom             | CUDA OOM in from_pretrained / zero.Init                      | stage 3, then parameter offload      |
| init_oom / cuda_oom  | CUDA OOM in deepspeed.initialize / a step / no traceback     | the OOM ladder for that phase        |
| host_oom             | signal 9 as each launcher says it, a bare "Killed"           | sharded load, offload out of host RAM, swap |
| fp16_loss_scale      | "Current loss scale already at minimum", overflow at 1 or 0  | bf16, or fp32 without bf16           |
| op_build             | a JIT op build failing (cpu_adam, fused_adam, async_io, ...) | the toolchain fix, then a fallback   |
| not_distributed /    | "Check batch related parameters ... world_size"              | launch the ranks / accumulation for  |
|   batch_triad        |                                                              |   the launched world size            |
| nccl_desync / nccl_barrier_timeout / nccl_timeout | NCCL watchdog, collective fingerprints | by pattern (see collectives.py) |

An OOM or a kill before an NCCL timeout is the cause of the timeout, so memory comes before collectives.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

from ..resolve import Resolved
from . import advice, collectives, memory
from .findings import Diagnosis, Found, Reresolve
from .logtext import Log

SSH = re.compile(r"(was not reachable via ssh|ssh exited with exit code 255|PasswordAuthentication=no \S+ hostname' "
                 r"returned non-zero exit status 255|ssh: connect to host \S+ port \d+: (Connection refused|No route|"
                 r"Connection timed out)|Host key verification failed|pdsh: command not found)")
ZERO3_LOAD = re.compile(r"the shape in current model is torch\.Size\(\[0\]\)")
SAVE_SKIPPED = re.compile(r"(Did not save the model .* because `?stage3_gather_16bit_weights_on_model_save`? is False|"
                          r"Cannot get 16bit model weights because `stage3_gather_16bit_weights_on_model_save`|"
                          r"didn't save the model, since stage3_gather_16bit_weights_on_model_save=false)")
EMPTY_WEIGHTS = re.compile(r"(copying a param with shape torch\.Size\(\[0\]\)|shape torch\.Size\(\[0\]\) from checkpoint)")
NVME = re.compile(r"(buffer nbytes != file bytes|deepspeed_py_aio_handle\.cpp:\d+.*Assertion|deepspeed_aio:.*failed|"
                  r"Assertion `static_cast<long long int>\(buffer\.nbytes\(\)\) == num_file_bytes')")
LOSS_SCALE = re.compile(r"(Current loss scale already at minimum|Attempted loss scale: [01](\.0)?, reducing to [01](\.0)?\b)")
OP_BUILD = re.compile(r"(Error building extension '\w+'|Unable to JIT load the \w+ op|Unable to pre-compile \w+|"
                      r"'DeepSpeedCPUAdam' object has no attribute 'ds_opt_adam'|\w+\.so: cannot open shared object|"
                      r"nvcc fatal|FAILED: \w+(\.cuda)?\.(o|so)\b)")
OP_WEAK = re.compile(r"\basync_io requires the")  # ds_report prints it in healthy runs too: only when nothing else
TRIAD = re.compile(r"train_batch_size is not\s+equal to micro_batch_per_gpu \* gradient_acc_step \* world_size\s*"
                   r"(\d+) != (\d+) \*\s*(\d+) \* (\d+)")
BUILDING = re.compile(r"Building extension module \w+")
BUILD_STOPPED = re.compile(r"(FAILED: \S+|ninja: build stopped)")
TORCHRUN = re.compile(r"(torch\.distributed\.elastic|torchrun)")

Finder = Callable[[Log], Optional[int]]


@dataclass(frozen=True)
class Recogniser:
    failure: str
    find: Finder
    handler: Callable[[Found], Diagnosis]
    pattern: Optional[re.Pattern] = None  # whose match the handler reads (groups)


def _first(pattern: re.Pattern) -> Finder:
    return lambda log: log.first(pattern)


def _gpu_oom(phases: tuple[str, ...]) -> Finder:
    def find(log: Log) -> Optional[int]:
        index = log.first(memory.GPU_OOM)
        return index if index is not None and memory.gpu_phase(log, index) in phases else None
    return find


def _triad(log: Log) -> Optional[int]:
    return log.first(re.compile(r"train_batch_size is not\s+equal to micro_batch_per_gpu"))


def _regression(log: Log) -> Optional[int]:
    found = advice.find_regression(log)
    return found[0] if found else None


def _op_build(log: Log) -> Optional[int]:
    """An op build failing: the line naming the cause (the linker, nvcc, a missing compiler) is the evidence,
    else the build's FAILED line, else the error raised after it."""
    if not (log.has(OP_BUILD) or log.has(BUILDING) and log.has(BUILD_STOPPED)):
        return None
    found = {c.cause: i for c in advice.BUILD_CAUSES for i in [log.first(c.pattern)] if i is not None}
    # ds_report's libaio warning is printed in healthy runs too: it is the cause only when nothing else is
    causes = [i for cause, i in found.items() if "libaio" not in cause] or list(found.values())
    return min(causes) if causes else log.first(BUILD_STOPPED) if log.has(BUILD_STOPPED) else log.first(OP_BUILD)


RECOGNISERS: list[Recogniser] = [
    Recogniser("ssh_launch", _first(SSH), advice.diagnose_ssh),
    Recogniser("ds_version", _regression, advice.diagnose_version),
    Recogniser("zero3_load", _first(ZERO3_LOAD), advice.diagnose_zero3_load),
    Recogniser("stage3_save", lambda log: log.first(SAVE_SKIPPED) if log.has(SAVE_SKIPPED) else log.first(EMPTY_WEIGHTS),
               advice.diagnose_save),
    Recogniser("nvme_aio", _first(NVME), advice.diagnose_nvme),
    Recogniser("load_oom", _gpu_oom(("loading",)), memory.diagnose_load_oom),
    Recogniser("cuda_oom", _gpu_oom(("init", "step", "backward", "forward", "unknown")), memory.diagnose_gpu_oom),
    Recogniser("host_oom", _first(memory.HOST_KILL), memory.diagnose_host_oom),
    Recogniser("fp16_loss_scale", _first(LOSS_SCALE), advice.diagnose_loss_scale),
    Recogniser("op_build", _op_build, advice.diagnose_op_build),
    Recogniser("batch_triad", _triad, advice.diagnose_triad, TRIAD),
    Recogniser("nccl", collectives.find_nccl, collectives.diagnose_nccl),
    Recogniser("op_build", _first(OP_WEAK), advice.diagnose_op_build),
]

KNOWN = ("CUDA/host OOM, fp16 loss scale, ZeRO-3 save/load, op builds, NCCL timeouts, batch triad, ssh, NVMe "
         "swap, known DeepSpeed regressions")


def diagnose(r: Resolved, text: str, reresolve: Optional[Reresolve] = None) -> Diagnosis:
    """The first recogniser that finds its evidence in `text` diagnoses it against the resolved preset."""
    log = Log.of(text)
    for recogniser in RECOGNISERS:
        index = recogniser.find(log)
        if index is None:
            continue
        match = recogniser.pattern.search(log.joined(index)) if recogniser.pattern else None
        d = recogniser.handler(Found(r, log, index, match, reresolve))
        if log.has(TORCHRUN):
            d.launcher = "torchrun"  # rerun the way the failed run was started
        return d
    return Diagnosis("unrecognised", "not recognised", log.summary_line(), advice=[
        f"none of the known failures ({KNOWN}) matched; the last exception line is shown above"])
