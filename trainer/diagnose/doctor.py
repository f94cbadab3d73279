"""`python -m trainer doctor PRESET LOG`: recognise why a run failed and propose the next change.

The log (or traceback file, as pasted: CRLF, progress bars, `[rankN]:` prefixes) is matched against the
recognisers of `recognise.py`, most specific first; the proposal is a list of `--set` overrides for the same
preset, or the exact step when the fix is outside the config (a toolchain, ssh, a version pin, preparing the
data), with the reason. The current config is read through `trainer.ds` accessors, so rungs already taken
are skipped. The rerun line comes from the one launch-command builder (`trainer.launch.command`), for the
world size the run had, so the trainer accepts it.

`--json` prints: recognised, failure (and the same as class), title, evidence, phase, exception {type, message,
rank, chain, site {file, function, line, code}}, raising_site, nearest {class, confidence} (unrecognised logs),
facts (what the log states: GPU, memory, world size, nodes, container, exported variables), proposal {step,
overrides, reason}, then, advice, memory, command.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
from typing import Optional

from .. import paths
from .. import ds as dsc
from ..errors import UserError
from ..launch.command import command_for
from ..options import add_preset_arguments, load_and_resolve
from ..plan.estimate import gb, plan_for_resolved
from ..presets import load_preset, with_overrides
from ..resolve import Resolved, resolve
from .classes.versions import record_versions
from .findings import Diagnosis, Proposal, first_error_line
from .logtext import bounded, read_log
from .recognise import diagnose

__all__ = ["diagnose", "doctor", "doctor_arguments", "rerun_command"]


def doctor_arguments(parser: argparse.ArgumentParser) -> None:
    add_preset_arguments(parser)
    parser.add_argument("log", type=paths.input_file("log file"), help="the failed run's log or traceback file")
    parser.add_argument("--json", action="store_true", help="print the diagnosis as JSON")
    parser.add_argument("--run-dir", type=paths.input_dir("run directory"), help="the failed run's directory, for the versions its config.resolved.yaml "
                                          "recorded (default: the log's directory, when it holds one)")


def doctor(args) -> int:
    log = read_log(args.log)
    resolved = load_and_resolve(args)
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout when imported
        recorded = record_versions(os.path.join(args.run_dir, "log") if args.run_dir else args.log)
        d = diagnose(resolved, log.text, lambda extra: _resolve(args, extra), recorded)
        memory = memory_effect(args, resolved, d.proposal)
        command = rerun_command(args, resolved, d) if d.proposal else None
    if args.json:
        print(json.dumps(diagnosis_json(d, memory, command), indent=2))
    else:
        print_diagnosis(args, resolved, d, memory, command)
    return 0 if d.recognised else 1


def _resolve(args, extra: list[str]) -> Resolved:
    return resolve(load_preset(args.preset, with_overrides(args.overrides, extra)), args.world_size)


def memory_effect(args, resolved: Resolved, proposal: Optional[Proposal]) -> Optional[str]:
    """The planner's per-GPU estimate now and after the proposed change (when both resolve); a change the
    OOM ladder priced carries its own (calibrated with the log)."""
    if proposal is not None and proposal.estimate:
        return proposal.estimate
    if proposal is None or not proposal.overrides or resolved.config.hardware.gpu == "cpu":
        return None
    try:
        before = plan_for_resolved(resolved)
    except UserError:
        return None
    try:
        after = plan_for_resolved(_resolve(args, proposal.overrides))
    except UserError:
        return f"planner: now {gb(before.gpu_total)} GB per GPU of {gb(before.gpu_budget)}"
    return (f"planner: {gb(before.gpu_total)} -> {gb(after.gpu_total)} GB per GPU "
            f"(budget {gb(before.gpu_budget)}; host {gb(after.cpu_bytes_per_node)} GB per node after)")


def rerun_command(args, resolved: Resolved, d: Diagnosis) -> str:
    """The launch line for the preset with the proposed change, for the world size the run had, started the
    way the failed run was (deepspeed's runner, or torchrun), with --world-size and every override carried
    over. When the changed config does not resolve on this machine (an NVMe path that exists only on the
    cluster), the line is laid out from the run's config and says so."""
    overrides = with_overrides(args.overrides, d.proposal.overrides)
    launch = dict(world_size=args.world_size, launcher=d.launcher, env=d.proposal.env,
                  master_port=d.proposal.master_port, train_args=d.proposal.train_args)
    try:
        changed = _resolve(args, d.proposal.overrides)  # offload may change: --bind_cores_to_rank with it
    except UserError as err:
        return f"{command_for(resolved, args.preset, overrides, **launch)}  # not resolved here: {first_error_line(err)}"
    return command_for(changed, args.preset, overrides, **launch)


def diagnosis_json(d: Diagnosis, memory: Optional[str], command: Optional[str]) -> dict:
    raised = d.raised.as_json() if d.raised else None
    return {"recognised": d.recognised, "failure": d.failure, "class": d.failure, "title": d.title,
            "evidence": d.evidence, "phase": d.phase, "exception": raised,
            "raising_site": raised.get("site") if raised else None,
            "nearest": {"class": d.nearest[0], "confidence": d.nearest[1]} if d.nearest else None,
            "facts": d.facts.as_json() if d.facts else {},
            "proposal": d.proposal.as_json() if d.proposal else None, "then": [p.as_json() for p in d.then],
            "advice": d.advice, "memory": memory, "command": command}


def _sets(overrides: list[str]) -> str:
    return " ".join(f"--set {shlex.quote(o)}" for o in overrides)


def print_diagnosis(args, r: Resolved, d: Diagnosis, memory: Optional[str], command: Optional[str]) -> None:
    print(f"doctor: {r.config.name} (world {r.world_size}, ZeRO-{dsc.zero_stage(r.ds)}, "
          f"offload {dsc.offload_optimizer_device(r.ds)}/{dsc.offload_param_device(r.ds)}, "
          f"micro {r.batch.micro_batch_size} x accum {r.batch.grad_accum}, checkpointing "
          f"{'on' if r.config.model.gradient_checkpointing else 'off'}, {dsc.precision(r.ds)}) + {args.log}")
    print(f"{'recognised' if d.recognised else 'NOT RECOGNISED'}: {d.title}")
    print(f"  evidence: {d.evidence}")
    if d.raised:
        site = f" at {d.raised.site.short()}" if d.raised.site else ""
        print(f"  raised: {bounded(d.raised.headline)}{site}" + (f" (rank {d.raised.rank})" if d.raised.rank is not None
                                                               else "") + f"; phase: {d.phase}")
    if d.facts and d.facts.as_json():
        print("  the log states: " + ", ".join(f"{key} {value}" for key, value in d.facts.as_json().items()))
    if d.proposal:
        print(f"next change ({d.proposal.step}):")
        if d.proposal.overrides:
            print(f"  {_sets(d.proposal.overrides)}")
        print(f"  reason: {d.proposal.reason}")
        if memory:
            print(f"  {memory}")
        print(f"  rerun: {command}")
    for p in d.then:
        print(f"if that is not enough: {p.step}: {_sets(p.overrides) or p.reason}"
              + (f" ({p.estimate})" if p.estimate else ""))
    for line in d.advice:
        print(f"advice: {line}")
