"""Signals to `python -m trainer launch` from its first instant (kept free of heavy imports: `python -m
trainer` installs `GUARD` before it imports torch, DeepSpeed or the preset machinery).

Without a handler, a SIGTERM that comes while the launch is still importing or resolving the preset is lost
as PID 1 of a container (the kernel drops signals PID 1 has no handler for: the ranks then start and run until
the SIGKILL), and elsewhere kills the launch midway. With `GUARD`:

- a signal before any rank exists (imports, preset resolution, launch.json): the launch finishes what it is
  writing, starts nothing (no rank, no deepspeed/torchrun, no sbatch) and exits 128+N. Not 0: the job did not
  run, and a Kubernetes Job that exits 0 counts as complete and is not retried. A second signal in that
  phase exits at once.
- a signal while the ranks are being started: every rank gets it, each as soon as it exists (`adopt`);
- afterwards: forwarded to every rank (supervisor.Supervisor waits for their checkpoint). A rank that gets it
  before its training loop is up has nothing to save yet and ends with 128+N.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Optional


FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# a test seam: TRAINER_LAUNCH_TEST_HOLD=<point>:<dir> makes the launch create <dir>/held at <point> and wait
# there until <dir>/release exists, so a test can send a real signal at that exact moment
TEST_HOLD = "TRAINER_LAUNCH_TEST_HOLD"


class LaunchSignals:
    def __init__(self):
        self.early: list[int] = []      # received before the first rank started: they stop the launch
        self.received: list[int] = []   # received since: every rank gets each of them
        self.children: dict[int, int] = {}  # pid -> rank (the supervisor reaps from it)
        self.starting = False
        self._sent: dict[int, int] = {}  # pid -> how many of `received` it was sent
        # launcher programs that do not pass a signal on as a preemption needs (DeepSpeed's local runner dies of
        # SIGTERM and leaves its ranks running; torchrun's agent exits 1 whatever its ranks did): their signals go
        # to the ranks under them instead, each rank as it appears
        self.through_ranks: set[int] = set()
        self._previous: dict = {}

    def install(self) -> bool:
        """Handle the forwarded signals from now on; False when already installed."""
        if self._previous:
            return False
        self._previous = {sig: signal.signal(sig, self.handle) for sig in FORWARDED}
        return True

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if not self.starting:
            self.early.append(signum)
            if len(self.early) > 1:
                print(f"launch: a second signal ({name}) before any rank started: exiting now", file=sys.stderr,
                      flush=True)
                raise SystemExit(128 + signum)
            print(f"launch: {name} received before any rank started: starting none; exiting {128 + signum} once "
                  f"what is being written is complete", file=sys.stderr, flush=True)
            return
        self.received.append(signum)
        print(f"launch: {name} received, forwarding it to {len(self._targets()) or 'the'} rank(s) and waiting for "
              f"their checkpoint", file=sys.stderr, flush=True)
        self._deliver()

    def stop_code(self) -> Optional[int]:
        """The gate right before the first rank (or deepspeed/torchrun, or sbatch) starts: 128+N when a
        signal came first (nothing is started), else None and from now on signals go to the ranks."""
        hold("before-ranks")
        self.starting = True  # set before looking: a signal from here on is forwarded, not a stop
        if self.early:
            self.starting = False
            name = signal.Signals(self.early[0]).name
            print(f"launch: stopped by {name} before any rank started: nothing was started, nothing to save "
                  f"(exit {128 + self.early[0]})", file=sys.stderr, flush=True)
            return 128 + self.early[0]
        return None

    def adopt(self, pid: int, rank: int) -> None:
        """A rank (or launcher program) just started: it gets every signal received since the gate."""
        self.children[pid] = rank
        self._deliver()

    def deliver(self) -> None:
        """Send what was received to ranks that appeared since (the supervisor calls it while it waits)."""
        if self.received and self.through_ranks:
            self._deliver()

    def _deliver(self) -> None:
        # each target is sent each received signal once, in order; a handler that runs in the middle of this
        # loop delivers what it added itself (at worst a signal is sent twice, never lost)
        for pid in self._targets():
            while self._sent.get(pid, 0) < len(self.received):
                index = self._sent.get(pid, 0)
                self._sent[pid] = index + 1
                send(pid, self.received[index])

    def _targets(self) -> list[int]:
        """Who gets a signal: each child, or for a launcher in `through_ranks` the ranks under it so far."""
        return [target for pid in list(self.children)
                for target in (ranks_under(pid) if pid in self.through_ranks else [pid])]

    @property
    def signalled(self) -> bool:
        return bool(self.received)


# The per-node launcher programs whose children are the ranks: DeepSpeed's launch.py, torchrun's agent
NODE_LAUNCHERS = ("deepspeed.launcher.launch", "torchrun", "torch.distributed.run")


def ranks_under(pid: int) -> list[int]:
    """The ranks a per-node launcher program (NODE_LAUNCHERS, named in its first words: `python -u -m MODULE`)
    started at or under `pid`."""
    import psutil
    try:
        top = psutil.Process(pid)
        under = top.children(recursive=True)
    except psutil.Error:
        return []
    launchers = set()
    for process in [top, *under]:
        try:
            if any(name in word for word in process.cmdline()[:4] for name in NODE_LAUNCHERS):
                launchers.add(process.pid)
        except psutil.Error:
            pass
    return [process.pid for process in under if process.pid not in launchers and process.ppid() in launchers]


def send(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass  # exited between the check and the signal; the supervisor reaps it


def hold(point: str) -> None:
    where, _, folder = os.environ.get(TEST_HOLD, "").partition(":")
    if where != point or not folder:
        return
    (Path(folder) / "held").touch()
    deadline = time.monotonic() + 120
    while not (Path(folder) / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.02)


GUARD = LaunchSignals()
