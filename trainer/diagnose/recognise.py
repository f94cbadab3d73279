"""The recognisers: a table of (failure, how to find its evidence line, handler), most specific first.

| failure           | recognised by                                                 | next change                       |
|-------------------|---------------------------------------------------------------|-----------------------------------|
| ssh_launch        | the launcher's ssh check / pdsh failing on a hostfile node    | passwordless ssh (exact steps)    |
| version           | a row of classes/versions.yaml: signature, the run's versions | the fixed release or the good pin |
| jit_lock          | a rank waiting on a JIT build's lock file (FileBaton, py-spy) | remove the stale lock             |
| launch_args       | argparse's unrecognized arguments (--local_rank: launcher's)  | the script accepts it             |
| devices_ignored   | DeepSpeed's runner ignoring CUDA_VISIBLE_DEVICES for a slot flag | --include host:ids         |
| no_slot           | the runner's "No slot 'N' specified on host" (--include, CUDA_VISIBLE_DEVICES) | --include host:ids, unset the variable |
| port_in_use       | the rendezvous port cannot be bound (in use, privileged)      | another --master_port             |
| cuda_toolkit      | nvcc too old for the GPU, toolkit vs torch, no kernel image   | the matching toolkit / wheel      |
| zero3_device_map  | ZeRO-3 with device_map / low_cpu_mem_usage in from_pretrained | load without them (zero.Init)     |
| zero3_load        | a full state dict loaded into torch.Size([0]) placeholders    | load under zero.Init              |
| zero3_placeholder | an operand of size 0 against the model's width                | by phase: register/leaf, or no ZeRO-3 for that step |
| stage3_save       | 16-bit weights not gathered at save time                      | gather on save / zero_to_fp32     |
| ckpt_topology     | a ZeRO checkpoint loaded on another data-parallel size        | the elastic (universal) resume    |
| shared_tensors    | tensors that share storage refused at a save (safetensors; transformers' undeclared ties) | save without it / untie |
| parent_missing    | torch.save's "Parent directory X does not exist" (a script argument, read from its argparse) | a directory there |
| offload_optimizer | ZeRO-Offload with a client optimizer                          | DeepSpeedCPUAdam                  |
| sequence_parallel | a traceback from a Ulysses precondition's site (classes/sequence.py) | that precondition's fix  |
| nvme_aio          | "buffer nbytes != file bytes", an aio assertion               | check the NVMe path, CPU offload  |
| load/cuda/init_oom | CUDA OOM, by the phase of its traceback (phases.py)          | the cheapest change that fits     |
| shm               | /dev/shm exhausted: bus error, exit -7, NCCL's shm segment    | a larger /dev/shm                 |
| no_room           | ENOSPC / EDQUOT: which writer, from the path or the frames   | that writer on a larger disk      |
| host_oom          | signal 9 as each launcher says it, a bare "Killed"            | sharded load, offload, swap       |
| fp16_loss_scale   | "Current loss scale already at minimum", overflow at 1 or 0   | bf16, or fp32 without bf16        |
| op_build          | a JIT op build failing (cpu_adam, ...), no ninja on PATH      | the toolchain fix, then fallback  |
| not_distributed   | no launcher variables; a triad at world size 1                | launch the ranks                  |
| batch_triad       | the batch triad at another world size                         | accumulation for that world       |
| rendezvous        | ranks cannot connect to the rank-0 store (errno 99, timeout), a connection error where a store or group is created | 127.0.0.1 on one node, gloo's interface, the endpoint, else head |
| pad_token         | a tokenizer without a padding token (asked to pad a batch)    | pad_token = eos_token             |
| two_devices       | tensors of one operation on two devices (which two, whose code) | one GPU per process / the pin / device= |
| quantized_placement | an 8-/4-bit model on several devices, another device, offloaded | each rank's copy on its device |
| unknown_architecture | KeyError: 'qwen2' from the auto config, "does not recognize this architecture" | the transformers that has it |
| no_gradient_graph | "does not require grad and does not have a grad_fn"           | inputs require grad / non-reentrant |
| checkpoint_recompute | non-reentrant checkpoint's "Recomputed values ... different metadata" | reentrant / ZeRO-2 under ZeRO-3 |
| fp16_trainable    | "Attempting to unscale FP16 gradients"                        | fp32 trainable weights, or bf16   |
| dtype_mismatch    | two dtypes where one was expected, read by where it was raised | the config's precision the checkpoint's / peft+bnb / one dtype |
| nan_backward      | autograd's "returned nan values" in an fp16 run               | bf16, else fp32                   |
| reduced_twice     | ZeRO's "has already been reduced. Gradient computed twice"    | checkpointing off / non-reentrant |
| token_past_embedding | srcIndex < srcSelectDimSize, "index out of range in self"  | resize the embedding to the tokenizer |
| signature         | a call its callee's release refuses (arity, keyword, missing argument) | the release that goes with it / the override's signature |
| signature         | transformers' "model_kwargs are not used by the model" (a patched or remote forward) | upgrade the patcher / the model code |
| engine_api        | a DeepSpeedEngine method (from its source) on an unwrapped model | launch under DeepSpeed, or unset its switch |
| missing_name      | "cannot import name N from P", "module P has no attribute N"  | the release that goes with it     |
| extension_abi     | a compiled extension's "undefined symbol" (built for another torch) | rebuild it against this one |
| invalid_device_ordinal | "invalid device ordinal": more ranks than visible GPUs   | ranks per node = GPUs             |
| device_unavailable | a library's "device (cuda:N) is not available" past the node's GPUs | a GPU it has (one GPU: cuda:0) |
| missing_field     | KeyError on a field the code reads from a sample              | preprocess that split like training |
| unfilled_auto     | a DeepSpeed config's "auto" values compared as strings         | explicit numbers                  |
| stated            | the final exception names keys/values/versions (stated.py)    | the change it states, or the pin  |
| nccl_network      | NCCL transport errors (socket interface, IB, system error)    | the layer's setting, NCCL_DEBUG   |
| nccl_*timeout/desync | NCCL watchdog, collective fingerprints                     | by pattern (collectives.py)       |
| nccl_network      | an error right after a communicator's setup, nothing stated   | that node count's transport test  |
| config_message    | an exception whose message says what to change (names keys)   | that change (overrides if it can) |
| jit_lock (weak)   | a log that stops while loading a JIT op                       | remove the stale lock             |
| stopped_at_init   | a log that ends in the process group's start, no error        | one fixed rendezvous port/address |
| library_bug       | a programming error or broken invariant inside a library's own code | by its installed source: upgrade, or its patch |
| unrecognised      | nothing above: exception, library, phase, versions, the plan  | what to attach to a bug report    |

A message wrapped over several lines is read in a second pass (`Log.first_wrapped`), after every class had its
chance on whole lines. An OOM or a kill before an NCCL error is the cause of the NCCL error, so memory comes before collectives; a
message that states its own fix comes after every specific class, whose advice knows more than the message.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional

from ..errors import UserError
from ..resolve import Resolved
from . import advice, collectives, memory, oserror
from . import phases
from .classes import (architecture, autograd, binaries, checkpoint, defects, devices, dtypes, engine_api, fallback, launch,
                      messages, names, network, quantized, sequence, stated, storage, toolkit, versions)
from .findings import Diagnosis, Found, Reresolve
from .logfacts import read_facts
from .logtext import Log
from .raised import final_exception

SSH = re.compile(r"(was not reachable via ssh|ssh exited with exit code 255|PasswordAuthentication=no \S+ hostname' "
                 r"returned non-zero exit status 255|ssh: connect to host \S+ port \d+: (Connection refused|No route|"
                 r"Connection timed out)|Host key verification failed|pdsh: command not found)")
ZERO3_LOAD = re.compile(r"(the shape in current model is torch\.Size\(\[0\]\)|\(which has shape torch\.Size\(\[0\]\)\))")
SAVE_SKIPPED = re.compile(r"(Did not save the model .* because `?stage3_gather_16bit_weights_on_model_save`? is False|"
                          r"Cannot get 16bit model weights because `stage3_gather_16bit_weights_on_model_save`|"
                          r"didn't save the model, since stage3_gather_16bit_weights_on_model_save=false)")
EMPTY_WEIGHTS = re.compile(r"(copying a param with shape torch\.Size\(\[0\]\)|shape torch\.Size\(\[0\]\) from checkpoint|"
                           + checkpoint.SAVED_EMPTY.pattern + ")")
NVME = re.compile(r"(buffer nbytes != file bytes|deepspeed_py_aio_handle\.cpp:\d+.*Assertion|deepspeed_aio:.*failed|"
                  r"Assertion `static_cast<long long int>\(buffer\.nbytes\(\)\) == num_file_bytes')")
LOSS_SCALE = re.compile(r"(Current loss scale already at minimum|Attempted loss scale: [01](\.0)?, reducing to [01](\.0)?\b)")
OP_BUILD = re.compile(r"(Error building extension '\w+'|Unable to JIT load the \w+ op|Unable to pre-compile \w+|"
                      r"Ninja is required to load C\+\+ extension|op must be compiled on first use, with ninja|"
                      r"'DeepSpeedCPUAdam' object has no attribute 'ds_opt_adam'|\w+\.so: cannot open shared object|"
                      r"nvcc fatal|FAILED: \w+(\.cuda)?\.(o|so)\b|fatal error: [\w/.+-]+\.h(?:pp)?: No such file or directory)")
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
    signature: tuple[re.Pattern, ...] = ()  # what the class's evidence reads like: the fallback's nearest class

    @property
    def signatures(self) -> tuple[re.Pattern, ...]:
        return getattr(self.find, "signature", ()) + self.signature + ((self.pattern,) if self.pattern else ())


def _first(pattern: re.Pattern) -> Finder:
    def find(log: Log) -> Optional[int]:
        return log.first(pattern)
    find.signature = (pattern,)
    find.wrapped = lambda log: log.first_wrapped(pattern)  # the second pass: messages wrapped over two lines
    return find


def _gpu_oom(loading: bool) -> Finder:
    def find(log: Log) -> Optional[int]:
        index = log.first(memory.GPU_OOM)
        return index if index is not None and (memory.gpu_phase(log, index) == "loading") == loading else None
    return find


def _triad(log: Log) -> Optional[int]:
    return log.first(re.compile(r"train_batch_size is not\s+equal to micro_batch_per_gpu"))


def _op_build(log: Log) -> Optional[int]:
    """An op build failing: the line naming the cause (the linker, nvcc, a missing compiler) is the evidence,
    else the build's FAILED line, else the error raised after it."""
    in_torch = next((i for i in [log.first(toolkit.COMPILER_ERROR)] if i is not None and
                     toolkit.TORCH_SOURCES.search(log.line(i))), None)
    if not (log.has(OP_BUILD) or log.has(BUILDING) and log.has(BUILD_STOPPED) or in_torch is not None):
        return None
    found = {c.cause: i for c in toolkit.BUILD_CAUSES for i in [log.first(c.pattern)] if i is not None}
    header = log.first(toolkit.MISSING_HEADER)
    if header is not None:
        found["a missing header"] = header
    # ds_report's libaio warning is printed in healthy runs too: it is the cause only when nothing else is
    causes = [i for cause, i in found.items() if "libaio" not in cause] or list(found.values())
    if in_torch is not None and not causes:  # a compiler error inside torch's headers: the toolchain
        return in_torch
    return min(causes) if causes else log.first(BUILD_STOPPED) if log.has(BUILD_STOPPED) else log.first(OP_BUILD)


def _weak_op(log: Log) -> Optional[int]:
    """ds_report's "async_io requires the dev libaio" warning table is printed by healthy runs: the cause only when
    the log ends in no exception, or in one about the op."""
    index = log.first(OP_WEAK)
    if index is None:
        return None
    raised = final_exception(log)
    return index if raised is None or re.search(r"(aio|AsyncIO|async_io|libaio)", raised.headline) else None


def _save(log: Log) -> Optional[int]:
    return log.first(SAVE_SKIPPED) if log.has(SAVE_SKIPPED) else log.first(EMPTY_WEIGHTS)


RECOGNISERS: list[Recogniser] = [
    Recogniser("ssh_launch", _first(SSH), launch.diagnose_ssh),
    Recogniser("version", lambda log: None, versions.diagnose),  # found with the run's versions: see diagnose()
    Recogniser("jit_lock", _first(toolkit.LOCK_WAIT), toolkit.diagnose_jit_lock),
    Recogniser("launch_args", launch.find_unrecognized, launch.diagnose_launch_args,
               signature=(launch.UNRECOGNIZED, launch.LOCAL_RANK)),
    Recogniser("port_in_use", _first(launch.PORT_IN_USE), launch.diagnose_port),
    Recogniser("devices_ignored", _first(launch.DEVICES_IGNORED), launch.diagnose_devices_ignored,
               pattern=launch.DEVICES_IGNORED),
    Recogniser("no_slot", _first(launch.NO_SLOT), launch.diagnose_no_slot),
    Recogniser("cuda_toolkit", _first(toolkit.CUDA_TOOLKIT), toolkit.diagnose_cuda_toolkit),
    Recogniser("zero3_device_map", _first(checkpoint.DEVICE_MAP), checkpoint.diagnose_device_map),
    Recogniser("zero3_load", _first(ZERO3_LOAD), checkpoint.diagnose_zero3_load),
    Recogniser("zero3_placeholder", _first(checkpoint.EMPTY_OPERAND), checkpoint.diagnose_empty_operand),
    Recogniser("stage3_save", _save, checkpoint.diagnose_save, signature=(SAVE_SKIPPED, EMPTY_WEIGHTS)),
    Recogniser("ckpt_topology", _first(checkpoint.TOPOLOGY), checkpoint.diagnose_topology),
    Recogniser("shared_tensors", _first(checkpoint.SHARED_TENSORS), checkpoint.diagnose_shared_tensors),
    Recogniser("parent_missing", _first(checkpoint.PARENT_MISSING), checkpoint.diagnose_parent_missing),
    Recogniser("offload_optimizer", _first(messages.CLIENT_OPTIMIZER), messages.diagnose_client_optimizer),
    Recogniser("sequence_parallel", sequence.find, sequence.diagnose),
    Recogniser("nvme_aio", _first(NVME), advice.diagnose_nvme),
    Recogniser("load_oom", _gpu_oom(loading=True), memory.diagnose_load_oom, signature=(memory.GPU_OOM,)),
    Recogniser("cuda_oom", _gpu_oom(loading=False), memory.diagnose_gpu_oom, signature=(memory.GPU_OOM,)),
    Recogniser("shm", _first(launch.SHM), launch.diagnose_shm),
    Recogniser("no_room", storage.find, storage.diagnose, signature=(oserror.WORDS,)),
    Recogniser("host_oom", _first(memory.HOST_KILL), memory.diagnose_host_oom),
    Recogniser("fp16_loss_scale", _first(LOSS_SCALE), advice.diagnose_loss_scale),
    Recogniser("op_build", _op_build, toolkit.diagnose_op_build, signature=(OP_BUILD, BUILD_STOPPED)),
    Recogniser("not_distributed", _first(launch.NO_LAUNCHER), launch.diagnose_no_launcher),
    Recogniser("batch_triad", _triad, launch.diagnose_triad, TRIAD),
    Recogniser("rendezvous", launch.find_rendezvous, launch.diagnose_rendezvous),  # after any failure it follows
    Recogniser("pad_token", _first(messages.NO_PAD_TOKEN), messages.diagnose_pad_token),
    Recogniser("two_devices", _first(devices.TWO_DEVICES), devices.diagnose),
    Recogniser("quantized_placement", _first(quantized.PLACEMENT), quantized.diagnose),
    Recogniser("unknown_architecture", architecture.find, architecture.diagnose, signature=(architecture.UNKNOWN_ARCH,)),
    Recogniser("no_gradient_graph", autograd.find_no_graph, autograd.diagnose_no_graph),
    Recogniser("checkpoint_recompute", _first(autograd.RECOMPUTED), autograd.diagnose_recomputed),
    Recogniser("token_past_embedding", _first(autograd.PAST_EMBEDDING), autograd.diagnose_past_embedding),
    Recogniser("reduced_twice", _first(autograd.REDUCED_TWICE), autograd.diagnose_reduced_twice),
    Recogniser("fp16_trainable", _first(autograd.FP16_TRAINABLE), autograd.diagnose_fp16_trainable),
    Recogniser("dtype_mismatch", dtypes.find_mismatch, dtypes.diagnose_mismatch, signature=(dtypes.DTYPE_MISMATCH,)),
    Recogniser("nan_backward", dtypes.find_nan_backward, dtypes.diagnose_nan_backward),
    Recogniser("engine_api", engine_api.find, engine_api.diagnose),
    Recogniser("missing_name", names.find, names.diagnose, signature=(names.MISSING_NAME,)),
    Recogniser("signature", names.find_signature, names.diagnose_signature, signature=(names.SIGNATURE,)),
    Recogniser("signature", _first(names.UNUSED_KWARGS), names.diagnose_unused_kwargs),
    Recogniser("extension_abi", _first(binaries.UNDEFINED_SYMBOL), binaries.diagnose_undefined_symbol),
    Recogniser("invalid_device_ordinal", _first(binaries.INVALID_ORDINAL), binaries.diagnose_invalid_ordinal),
    Recogniser("device_unavailable", _first(binaries.DEVICE_UNAVAILABLE), binaries.diagnose_device_unavailable),
    Recogniser("missing_field", binaries.find_missing_field, binaries.diagnose_missing_field,
               signature=(binaries.KEY_ERROR, binaries.FIELD_READ)),
    Recogniser("unfilled_auto", stated.find_unfilled_auto, stated.diagnose_unfilled_auto,
               signature=(stated.AUTO_FAILED,)),
    Recogniser("stated", stated.find, stated.diagnose),  # a message naming keys, values, versions: what it states
    Recogniser("nccl_network", _first(network.NCCL_FAILURE), network.diagnose_network),
    Recogniser("nccl", collectives.find_nccl, collectives.diagnose_nccl,
               signature=(collectives.NCCL_TIMEOUT, collectives.MISMATCH)),
    Recogniser("nccl_network", network.find_at_communicator, network.diagnose_at_communicator),
    Recogniser("config_message", messages.find_message, messages.diagnose_message, signature=(messages.INSTRUCTION,)),
    Recogniser("op_build", _weak_op, toolkit.diagnose_op_build),
    Recogniser("jit_lock", toolkit.find_stopped_at_op_loading, toolkit.diagnose_jit_lock),
    Recogniser("stopped_at_init", launch.find_stopped_at_init, launch.diagnose_stopped_at_init,
               signature=(launch.INIT_LINE,)),
    Recogniser("library_bug", defects.find, defects.diagnose),
]


def run_versions(text: str, recorded: Optional[dict] = None) -> dict[str, str]:
    """The versions the run had: what the log prints, else what its run directory recorded."""
    return {**(recorded or {}), **versions.log_versions(text)}


def diagnose(r: Resolved, text: str, reresolve: Optional[Reresolve] = None,
             recorded_versions: Optional[dict] = None) -> Diagnosis:
    """The first recogniser that finds its evidence in `text` diagnoses it against the resolved preset; with
    none, the fallback still says what failed, where, and what to report."""
    log = Log.of(text)
    seen = run_versions(log.ends(), recorded_versions)
    facts = read_facts(log)
    reresolve = _remembered(reresolve) if reresolve else None
    for recogniser, index in _hits(log, seen):
        match = recogniser.pattern.search(log.joined(index)) if recogniser.pattern else None
        d = recogniser.handler(Found(r, log, index, match, reresolve, seen, facts))
        return _described(log, _launched_like(log, d), index, facts)
    index = fallback.failure_line(log) or 0
    d = fallback.diagnose_unknown(Found(r, log, index, None, reresolve, seen, facts))
    d.nearest = nearest_class(log)
    if d.nearest:
        d.advice.insert(0, f"nearest known class: {d.nearest[0]} (confidence {d.nearest[1]:.2f}, not enough to act on)")
    return _described(log, d, index, facts)


def _described(log: Log, d: Diagnosis, index: int, facts) -> Diagnosis:
    """The diagnosis with the log's structure: its final exception and raising site, the phase, the facts."""
    d.raised, d.facts = final_exception(log), facts
    frames = list(d.raised.frames) if d.raised else []
    d.phase = phases.phase_of_frames(frames) or phases.phase(log, d.raised.index if d.raised else index)
    return d


WORD = re.compile(r"[A-Za-z][a-z]{3,}(?:_[a-z]+)*")
COMMON = {"error", "with", "from", "that", "this", "none", "true", "false", "failed", "version", "process", "info",
          "warn", "rank", "torch", "cuda"}


def nearest_class(log: Log) -> Optional[tuple[str, float]]:
    """The class whose evidence patterns share the most words with the log's failure (its final exception and
    the lines before it), and a confidence: half the share of the class's words seen (at most 0.5, since the
    class's own evidence did not match), when any word is shared."""
    raised = final_exception(log)
    if raised is not None:  # the exception and where it was raised speak; a ds_report table before it does not
        text = " ".join([raised.type, raised.message] + [f"{fr.file} {fr.func} {fr.code}" for fr in raised.frames])
    else:
        text = log.before(fallback.failure_line(log) or 0, 30)
    seen = {w.lower() for w in WORD.findall(text)}
    best: Optional[tuple[str, float]] = None
    for recogniser in RECOGNISERS:
        words = {w.lower() for p in recogniser.signatures for w in WORD.findall(p.pattern)} - COMMON
        if not words:
            continue
        score = round(len(words & seen) / min(len(words), 6), 2)  # a long alternation needs only a few of its words
        if score > 0 and (best is None or score > best[1]):
            best = (recogniser.failure, min(score, 1.0) / 2)
    return best


def _remembered(reresolve: Reresolve) -> Reresolve:
    """The OOM ladder prices the same configs more than once (alone, then stacked): resolve each only once."""
    done: dict[tuple, object] = {}

    def resolved_with(extra: list[str]):
        key = tuple(extra)
        if key not in done:
            try:
                done[key] = reresolve(extra)
            except UserError as err:  # remembered too: the same overrides fail the same way
                done[key] = err
        if isinstance(done[key], UserError):
            raise done[key]
        return done[key]
    return resolved_with


def _find_version(log: Log, seen: dict[str, str]) -> Optional[int]:
    found = versions.find(log, seen)
    return found[0] if found else None


def _launched_like(log: Log, d: Diagnosis) -> Diagnosis:
    if log.has(TORCHRUN):
        d.launcher = "torchrun"  # rerun the way the failed run was started
    return d


def _hits(log: Log, seen: dict):
    """(recogniser, evidence line) in the table's order: every recogniser on the log's lines first, then - when
    none found its evidence on a line - the ones that read a message a terminal or a paste wrapped over two lines,
    so that a wrapped match never outranks a class whose evidence is whole on one line."""
    for recogniser in RECOGNISERS:
        index = _find_version(log, seen) if recogniser.failure == "version" else recogniser.find(log)
        if index is not None:
            yield recogniser, index
            return
    for recogniser in RECOGNISERS:
        second = getattr(recogniser.find, "wrapped", None)
        index = second(log) if second else None
        if index is not None:
            yield recogniser, index
            return
