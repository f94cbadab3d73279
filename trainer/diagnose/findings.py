"""What the doctor finds: a diagnosis, the changes it proposes, and what each handler is given."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Optional

from .. import hardware
from ..errors import UserError
from ..plan.estimate import plan_for_resolved
from ..resolve import Resolved
from .logfacts import LogFacts
from .logtext import Log, bounded
from .raised import Raised

Reresolve = Callable[[list[str]], Resolved]  # the same preset with extra --set overrides, resolved


@dataclass(frozen=True)
class Proposal:
    """One next change: `--set` overrides the trainer accepts, or (overrides empty) a step outside the config
    - a command to run first, a package to install. The rerun line takes `env` as a prefix (NCCL_DEBUG=INFO),
    `master_port` as the rendezvous port and `train_args` after the preset (`--resume auto`); `estimate` is
    the planner's per-GPU memory before and after the change, when the change is priced."""
    step: str
    overrides: list[str]
    reason: str
    env: tuple[tuple[str, str], ...] = ()
    master_port: Optional[int] = None
    train_args: tuple[str, ...] = ()
    estimate: Optional[str] = None

    def as_json(self) -> dict:
        out = {"step": self.step, "overrides": list(self.overrides), "reason": self.reason}
        if self.env:  # the variables the rerun line sets before the launcher
            out["env"] = [list(item) for item in self.env]
        return {**out, "estimate": self.estimate} if self.estimate else out


@dataclass
class Diagnosis:
    failure: str
    title: str
    evidence: str
    proposal: Optional[Proposal] = None
    then: list[Proposal] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    launcher: str = "deepspeed"  # how the rerun line starts the ranks (torchrun when the failed run used it)
    raised: Optional[Raised] = None  # the log's final exception, its raising site and chain (raised.py)
    phase: str = "unknown"  # phases.py's name for where the run was
    facts: Optional[LogFacts] = None  # what the log states about the run (logfacts.py)
    nearest: Optional[tuple[str, float]] = None  # unrecognised: the closest class and how close (0..1)

    def __post_init__(self):
        self.evidence = bounded(self.evidence)

    @property
    def recognised(self) -> bool:
        return self.failure != "unrecognised"


@dataclass(frozen=True)
class Found:
    """A recogniser's hit: the log, the evidence line's index and its regex match, the config it is judged
    against (`reresolve` re-resolves the preset with more overrides, when the caller can) and the versions
    the run had."""
    resolved: Resolved
    log: Log
    index: int
    match: Optional[re.Match]
    reresolve: Optional[Reresolve] = None
    versions: dict = field(default_factory=dict)  # package -> version, as the log prints it or the run recorded
    facts: LogFacts = field(default_factory=LogFacts)  # what the log states: GPU, world, nodes, exports

    @property
    def line(self) -> str:
        return self.log.line(self.index)

    @property
    def gpu(self) -> hardware.Gpu:
        """The GPU the log names (torch's device name), else the preset's."""
        return hardware.gpu_of_device(self.facts.gpu) or hardware.gpu(self.resolved.config.hardware.gpu)

    @property
    def nodes(self) -> int:
        """The nodes the log shows, else the preset's."""
        return self.facts.nodes or self.resolved.config.hardware.nodes

    def resolves(self, overrides: list[str]) -> Optional[Resolved]:
        """The preset with `overrides`, or None when it does not resolve on this machine (or cannot be checked)."""
        if self.reresolve is None:
            return None
        try:
            return self.reresolve(overrides)
        except UserError:
            return None


def planned(resolved: Optional[Resolved]):
    """The planner's estimate for a resolved config, or None (CPU ranks, a model the planner cannot size)."""
    if resolved is None or resolved.config.hardware.gpu == "cpu":
        return None
    try:
        return plan_for_resolved(resolved)
    except UserError:
        return None


def first_error_line(err: Exception) -> str:
    lines = [line.strip(" -") for line in str(err).splitlines() if line.strip()]
    return lines[1] if len(lines) > 1 and lines[0].endswith(":") else lines[0]
