"""DeepSpeed's JIT-built ops, said out loud: before DeepSpeed builds or loads an op, one line naming it, whether
this environment has it built, how long a build takes on this machine class, where, and with which ninja; every
30 s while it builds, how long so far (trainer/waits.py); after, how long it took. A build's duration is kept
beside the ops (<root>/build_times.json), so the next estimate on this machine class is a measurement.

The lines come from a wrapper around DeepSpeed's OpBuilder.jit_load - the one path by which every op that is
not prebuilt into the wheel is built or loaded - so an op nobody listed is announced like the others. A missing
ninja is a named error with the fix, before DeepSpeed's bare "Unable to JIT load the <op> op due to ninja not
being installed". A SIGTERM or Ctrl-C during a build stops it at once and leaves no lock (`stopped_by_signals`).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import json
import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from . import jit_env, jit_locks, jit_reuse, waits
from .errors import UserError
from .files import write_text_atomic

HISTORY = "build_times.json"
# Seconds to build each op from nothing, measured on a 2-CPU machine (shared, loaded: the class these estimates
# were first wrong on); scaled by the waves of compiles on this machine's CPUs. Ops not listed are estimated from
# their sources (SECONDS_PER_SOURCE); either way a build measured here replaces the estimate.
REFERENCE_CPUS = 2
REFERENCE_S = {"deepspeed_shm_comm": 90.0, "cpu_adam": 180.0, "fused_adam": 120.0}
SECONDS_PER_SOURCE = {".cu": 150.0, ".cpp": 60.0, ".cc": 60.0}  # one compile on one core, torch headers included
LINK_S = 10.0


def machine_class() -> str:
    return f"{cpus()} CPUs"


def cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


@dataclass
class OpLoad:
    name: str
    directory: Path
    sources: list[str]

    @property
    def library(self) -> Path:
        return self.directory / f"{self.name}.so"

    def built_at(self) -> Optional[float]:
        try:
            return self.library.stat().st_mtime
        except OSError:
            return None

    def expected(self) -> tuple[float, str]:
        """(seconds a build takes here, on what that rests)."""
        measured = measured_seconds(self.directory.parent, self.name)
        if measured is not None:
            return measured, f"measured here, {machine_class()}"
        waves = math.ceil(max(len(self.sources), 1) / cpus())
        if self.name in REFERENCE_S:
            reference_waves = math.ceil(max(len(self.sources), 1) / REFERENCE_CPUS)
            return (REFERENCE_S[self.name] * waves / reference_waves,
                    f"measured on {REFERENCE_CPUS} CPUs; this machine has {cpus()}")
        costs = sorted((SECONDS_PER_SOURCE.get(Path(s).suffix, 60.0) for s in self.sources), reverse=True)
        seconds = sum(costs[i] for i in range(0, len(costs), max(1, cpus()))) + LINK_S
        return seconds, f"estimated: {len(self.sources)} source file(s) on {cpus()} CPUs"

    def announce(self, ninja: str, ninja_version: str) -> str:
        seconds, basis = self.expected()
        where = f"in {self.directory} ({jit_env.root_origin()}) with ninja {ninja_version} ({ninja})"
        if self.built_at() is None:
            return (f"op {self.name}: not built for this environment yet - building it now, once (expected "
                    f"{waits.duration(seconds)}: {basis}) {where}")
        return (f"op {self.name}: built before - loading it {where}; ninja rebuilds it "
                f"(~{waits.duration(seconds)}) only if its sources or flags changed")

    def still(self, elapsed: float) -> str:
        seconds, _ = self.expected()
        builder = jit_locks.builder_in(self.directory) if self.directory.is_dir() else None
        doing = f"building ({builder})" if builder else "loading"
        return (f"op {self.name}: still {doing} - {waits.duration(elapsed)} so far, ~{waits.duration(seconds)} "
                f"expected")

    def stopped(self, signum: int) -> str:
        lock = self.directory / "lock"
        left = f"its lock {lock} is still there" if lock.exists() else "no lock left"
        return (f"op {self.name}: build stopped by {signal.Signals(signum).name} - its compilers stopped, {left}; "
                f"the next run builds it again")

    def finished(self, elapsed: float, before: Optional[float]) -> str:
        after = self.built_at()
        if after is None or after == before:
            return f"op {self.name}: loaded in {waits.duration(elapsed)}"
        record_build(self.directory.parent, self.name, elapsed)
        if before is None:
            return f"op {self.name}: built in {waits.duration(elapsed)} (next runs load it in seconds)"
        return (f"op {self.name}: rebuilt in {waits.duration(elapsed)} - its build.ninja had changed (another "
                f"DeepSpeed, torch, compiler or flags than the last build in this directory)")


def read_history(root: Path) -> dict:
    try:
        data = json.loads((root / HISTORY).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def measured_seconds(root: Path, name: str) -> Optional[float]:
    """The last build of `name` measured on this machine class, if the history has a sane one."""
    entry = read_history(root).get(name)
    seconds = entry.get(machine_class()) if isinstance(entry, dict) else None
    return float(seconds) if isinstance(seconds, (int, float)) and 0 < seconds < 86400 else None


def record_build(root: Path, name: str, seconds: float) -> None:
    history = read_history(root)
    entry = history.get(name) if isinstance(history.get(name), dict) else {}
    history[name] = {**entry, machine_class(): round(seconds, 1)}
    try:
        write_text_atomic(str(root / HISTORY), json.dumps(history, indent=1, sort_keys=True) + "\n", flag=HISTORY)
    except UserError:
        pass  # an unwritable history only costs the next estimate its measurement


def op_load(builder) -> OpLoad:
    root = Path(os.environ.get(jit_env.VARIABLE) or jit_locks.extensions_root())
    return OpLoad(builder.name, root / builder.name, [str(s) for s in builder.sources()])


def announcing() -> bool:
    """One rank per node speaks (the others wait on its build's lock, which trainer/jit_locks.py reports)."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def announced(jit_load, emit: Callable[[str], None]):
    @functools.wraps(jit_load)
    def jit_load_announced(builder, verbose=True):
        op = op_load(builder)
        ninja, version = jit_env.ninja_in_use()
        if ninja is None:
            raise UserError(jit_env.missing_ninja_message(op.name))
        speaks = announcing()
        reused = jit_reuse.reuse_if_unchanged(op.directory, op.name, ninja)
        if speaks:
            emit(op.announce(ninja, version))
            if reused:
                emit(f"op {op.name}: its sources are new files with the content it was built from (a reinstalled "
                     f"environment) - reusing that build instead of rebuilding")
        before, started = op.built_at(), time.monotonic()
        try:  # on every rank: whichever takes torch's lock first builds, the announcing one or not
            with (waits.during(op.still) if speaks else contextlib.nullcontext()), stopped_by_signals():
                module = jit_load(builder, verbose)
        except BuildStopped as stop:
            emit(op.stopped(stop.signum))
            raise SystemExit(128 + stop.signum) from None
        if speaks:
            emit(op.finished(time.monotonic() - started, before))
            if op.built_at() != before or not (op.directory / jit_reuse.MANIFEST).is_file():
                jit_reuse.record(op.directory, op.name, ninja)
        return module
    jit_load_announced.announced = True
    return jit_load_announced


class BuildStopped(BaseException):
    """SIGTERM or SIGINT while this rank builds an op (a BaseException: nothing on the way out may swallow it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def stopped_by_signals():
    """While an op builds, SIGTERM/SIGINT stop the build rather than wait for it: the compilers this process started
    are stopped, then BuildStopped unwinds through torch's builder, whose `finally` removes the build's lock. Left
    to the rank's usual handlers, the build would run on (the trainer's SIGTERM handler saves at the next step) until
    the launcher's SIGKILL, which leaves the lock every later run waits on."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        stop_descendants()
        raise BuildStopped(signum)
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def stop_descendants() -> None:
    """ninja and the compilers under it (torch kills ninja on the way out, not its children)."""
    import psutil
    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(children, timeout=10)


def install(emit: Callable[[str], None]) -> None:
    """Wrap OpBuilder.jit_load (once per process) in every copy of DeepSpeed's op_builder that is importable (a
    wheel may also install it as a top-level `op_builder`), and start the watcher that prints the heartbeats."""
    for module in op_builder_modules():
        if not getattr(module.OpBuilder.jit_load, "announced", False):
            module.OpBuilder.jit_load = announced(module.OpBuilder.jit_load, emit)
    jit_locks.check_and_watch(emit)


def op_builder_modules() -> list:
    import deepspeed.ops.op_builder.builder as bundled
    found = [bundled]
    try:
        import op_builder  # DeepSpeed's accelerators prefer it when it is DeepSpeed's (it has __deepspeed__)
        if getattr(op_builder, "__deepspeed__", False):
            found.append(importlib.import_module("op_builder.builder"))
    except ImportError:
        pass
    return found
