"""The answer when no failure class matches: never just "not recognised". The doctor still reads the log -
the exception and its message, the library whose code raised it (from the frames' file paths: DeepSpeed,
transformers, torch, accelerate, NCCL, the trainer, or the user's script), the phase it happened in, the
versions the log prints or the run recorded - and adds the preset's planned memory and what to attach to a
bug report for the library that raised it.
"""
from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path
from typing import Optional

from ...plan.estimate import gb
from .. import phases
from ..findings import Diagnosis, Found, planned
from ..logtext import ERROR_WORDS, EXCEPTION, Frame, Log, bounded
from ..raised import Site, final_exception

TRACKERS = {"deepspeed": "https://github.com/deepspeedai/DeepSpeed/issues (attach `ds_report`)",
            "transformers": "https://github.com/huggingface/transformers/issues (attach `transformers env`)",
            "accelerate": "https://github.com/huggingface/accelerate/issues (attach `accelerate env`)",
            "torch": "https://github.com/pytorch/pytorch/issues (attach `python -m torch.utils.collect_env`)",
            "nccl": "https://github.com/NVIDIA/nccl/issues (attach the NCCL_DEBUG=INFO log of every rank)",
            "trainer": "this trainer's maintainers (attach `python -m trainer show PRESET` and the run's "
                       "config.resolved.yaml)"}
# What the exception type alone says, whatever raised it ({0}: the first quoted name in the message).
HINTS = [(re.compile(p), text) for p, text in (
    (r"ModuleNotFoundError|No module named", "the module '{0}' is not installed in the environment this rank ran: "
                                             "install it there (on every node), or fix the name"),
    (r"FileNotFoundError|No such file or directory", "the path '{0}' does not exist where this rank ran: a relative "
                                                     "path from another working directory, a mount missing on this "
                                                     "node, or a file not written yet"),
    (r"PermissionError|Permission denied", "'{0}' is not readable/writable by the user the ranks run as"),
    (r"ImportError: cannot import name", "'{0}' is missing from the installed version of the package it is imported "
                                         "from: the packages' versions do not go together (see the versions below)"),
)]
NCCL_LINE = re.compile(r"NCCL (WARN|INFO)")


def failure_line(log: Log) -> Optional[int]:
    """The line a report is about: the last exception, else the last error-looking line, else the last line."""
    index = log.last(EXCEPTION)
    if index is None:
        index = log.last(ERROR_WORDS)
    if index is None:
        index = next((i for i in reversed(range(len(log.lines))) if log.lines[i].strip()), None)
    return index


def raised_in(log: Log, index: int, frames: list[Frame]) -> str:
    """The library whose frame is innermost (the code that raised), from the exception's module path when the
    traceback is cut, NCCL when only NCCL's own lines speak."""
    for frame in reversed(frames):
        if frame.package:
            return frame.package
    exception = re.match(r"^(?:\[rank\d+\]:\s*)?((?:\w+\.)+)\w+", log.line(index))
    if exception and exception.group(1).split(".")[0] in TRACKERS:
        return exception.group(1).split(".")[0]
    if log.has(NCCL_LINE):
        return "nccl"
    return "your script" if frames else "unknown"


def diagnose_unknown(f: Found) -> Diagnosis:
    log, index, versions = f.log, f.index, f.versions
    exc = final_exception(log)
    frames = list(exc.frames) if exc and exc.frames else log.frames(index)
    library = raised_in(log, index, frames)
    phase = phases.phase_of_frames(frames) or phases.phase(log, index)
    exception = re.match(r"^(?:\[rank\d+\]:\s*)?([\w.]+?(?:Error|Exception|Exit|Interrupt))\b", log.line(index))
    kind = exc.name if exc else exception.group(1).rsplit(".", 1)[-1] if exception else "a failure"
    where = "" if phase == "unknown" else f" {phases.WORDS[phase]}"
    raised = f" raised in {library}" if library != "unknown" else " (the log shows no traceback)"
    d = Diagnosis("unrecognised", f"{kind}{raised}{where}", exc.headline if exc else log.line(index))
    if exc and exc.site:
        d.advice.append(f"the exception: {bounded(exc.headline)}; raised at {exc.site.short()}"
                        + (f" (`{exc.site.code}`)" if exc.site.code else "")
                        + (f", first caused by {exc.chain[0][0]}: {bounded(exc.chain[0][1], 160)}" if exc.chain else ""))
        source = raising_condition(exc.site, versions)
        if source:
            d.advice.append(source)
    if exc is None and log.last(ERROR_WORDS) is None:
        d.title = "no error in the log: the run stopped or hangs" + where
        d.advice.append(_hang(log))
    message = log.joined(index, following=2)  # "Failed to import X ...:" and, wrapped, the error it names
    hint = next((text for pattern, text in HINTS if pattern.search(message)), None)
    if hint:
        name = re.search(r"'([^']+)'", message)
        d.advice.append(hint.format(name.group(1) if name else "it names"))
    innermost = next((fr for fr in reversed(frames) if fr.package == library), frames[-1] if frames else None)
    if innermost is not None:
        d.advice.append(f"raised in {library} at {innermost.file.split('site-packages/')[-1]} ({innermost.func})"
                        + _called_from(frames))
    seen = ", ".join(f"{name} {v}" for name, v in sorted(versions.items()))
    d.advice.append(f"versions in the log: {seen} (not the doctor's machine's)" if seen else
                    "the log shows no versions: attach `ds_report` (or `pip list`) from the machine that ran it")
    shown = f.facts.as_json()
    if shown:
        d.advice.append("the log states: " + ", ".join(f"{k} {v}" for k, v in shown.items()))
    plan = planned(f.resolved)
    if plan is not None:
        d.advice.append(f"preset {f.resolved.config.name} plans {gb(plan.gpu_total)} of {gb(plan.gpu_budget)} GB per "
                        f"GPU and {gb(plan.cpu_bytes_per_node)} GB host RAM per node (`python -m trainer plan`)")
    d.advice.append("to report it: the whole log of every rank (not only rank 0's tail; NCCL_DEBUG=INFO for "
                    "distributed failures), the command line, the DeepSpeed config, `pip list` and `nvidia-smi`, to "
                    + TRACKERS.get(library, "the project that owns the script (the innermost frame of your code)"))
    return d


# several GPUs or ranks in one job, as the log states it (a launch line, a process group, a collective)
SEVERAL_GPUS = re.compile(r"(--include\s+\S+:\d+,\d+|--num_gpus[= ]?(?:[2-9]|\d\d)|--nproc_per_node[= ]?(?:[2-9]|\d\d)|"
                          r"CUDA_VISIBLE_DEVICES=\d+,\d+|init_process_group|all_reduce|all_gather|barrier\(|"
                          r"world_size[=: ]+(?:[2-9]|\d\d))")


def _hang(log: Log) -> str:
    """What is true of a log that holds no error: it stopped or hangs, and how to see where."""
    where = ("`py-spy dump --pid PID` on each rank (or `faulthandler.dump_traceback_later`) shows where each waits; "
             "the doctor reads such a dump")
    if not log.has(SEVERAL_GPUS):
        return f"the log holds no exception and no error line: the run stopped or hangs - {where}"
    return (f"the log holds no exception and no error line, and the job uses several GPUs: a hang in the first "
            f"collective is the usual case. {where}; rerun with NCCL_DEBUG=INFO (it names the transport NCCL picked "
            f"and where it stops), and test peer-to-peer with NCCL_P2P_DISABLE=1 - GPUs without working P2P (consumer "
            f"cards, VMs, IOMMU/ACS on) hang in the first all_reduce; a small all_reduce script (or nccl-tests) "
            f"reproduces it without the model")


CONDITION = re.compile(r"^\s*(if|elif|assert|while)\b")


def raising_condition(site: Site, versions: dict) -> Optional[str]:
    """The condition that raised, read from the installed package's source at the site's line, when the
    installed version is the one the log shows (else which versions differ, when the log shows one)."""
    package = site.package
    if package not in ("deepspeed", "transformers", "accelerate", "torch", "peft", "trl", "datasets"):
        return None
    try:
        here = metadata.version(package)
    except metadata.PackageNotFoundError:
        return None
    theirs = versions.get(package)
    if theirs is None:
        return None
    if theirs.split("+")[0] != here.split("+")[0]:
        return f"the raising code is {package} {theirs}'s; {here} is installed where the doctor runs, so its source " \
               f"at {site.short()} is not shown"
    relative = re.split(r"(?:site|dist)-packages[\\/]", site.file)[-1]
    path = Path(metadata.distribution(package).locate_file(relative))
    try:
        lines = path.read_text(errors="replace").split("\n")[max(0, site.line - 12):site.line]
    except OSError:
        return None
    condition = next((line.strip() for line in reversed(lines) if CONDITION.match(line)), None)
    return f"the condition that raised ({package} {here}, {site.short()}): `{bounded(condition, 200)}`" \
        if condition else None


def _called_from(frames: list[Frame]) -> str:
    user = next((fr for fr in reversed(frames) if not fr.package), None)
    return f", called from {user.file.rsplit('/', 1)[-1]} ({user.func})" if user else ""
