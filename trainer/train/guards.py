"""What keeps a long run honest: preemption signals, non-finite steps, loss spikes, fp16 loss-scale collapse.

- `StopSignal`: SIGTERM/SIGINT (what Slurm and Kubernetes send before a kill) asks every rank to
  finish the current step, save a checkpoint and exit 0. A second signal exits at once, even from inside
  a blocked collective (a watchdog thread acts on it). Signals
  within `SAME_SIGNAL_S` of the first count as the same request, because launchers forward the
  signal they received to ranks that already got it from the scheduler (deepspeed's launcher does).
- `StepGuard`: a step whose loss or gradient norm is not finite is skipped (ZeRO and the bf16/fp16
  optimizers discard a step whose gradient norm is inf/NaN; the guard makes sure that happened) and
  counted; after `train.max_bad_steps` in a row the run stops with a message. A loss above
  `train.spike_ratio` x its moving average is logged with the step and the data position.
"""
from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from collections import deque

import torch
import torch.distributed as dist


SAME_SIGNAL_S = 5.0


class StopSignal:
    """SIGTERM/SIGINT policy, decided on a watchdog thread so it holds while the main thread waits in C.

    Python runs signal handlers only between bytecodes of the main thread; a rank blocked in a collective
    (a peer died or hangs) would never see the second signal. `signal.set_wakeup_fd` makes the C-level
    handler write the signal number to a pipe at once; the watchdog thread reads it and applies the
    policy: the first signal asks for a checkpoint-and-exit, a second one more than SAME_SIGNAL_S later
    exits the process immediately, wherever the main thread is."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested_at: float | None = None
        self.name = ""
        self._previous = {sig: signal.signal(sig, _ignore_in_python) for sig in self.SIGNALS}
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)  # set_wakeup_fd demands it
        self._previous_wakeup = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._watchdog = threading.Thread(target=self._watch, name="stop-signal-watchdog", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        while True:
            try:
                data = os.read(self._read_fd, 64)
            except OSError:
                return
            if not data:  # restore() closed the write end
                os.close(self._read_fd)
                return
            for signum in data:
                if signum in self.SIGNALS:
                    self._handle(signum)

    def _handle(self, signum: int) -> None:
        now = time.monotonic()
        if self.requested_at is not None and now - self.requested_at > SAME_SIGNAL_S:
            print(f"second {signal.Signals(signum).name}: exiting now without a checkpoint", file=sys.stderr,
                  flush=True)
            os._exit(128 + signum)  # collectives may be blocked: no cleanup that could hang
        if self.requested_at is None:
            self.requested_at, self.name = now, signal.Signals(signum).name
            print(f"{self.name} received: finishing this step, saving a checkpoint, then exiting "
                  f"(send it again after {SAME_SIGNAL_S:.0f}s to exit at once)", file=sys.stderr, flush=True)

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def restore(self) -> None:
        signal.set_wakeup_fd(self._previous_wakeup)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        os.close(self._write_fd)  # the watchdog reads EOF and ends
        self._watchdog.join(timeout=5)


def _ignore_in_python(signum, frame):
    """The watchdog thread acts on the signal; a Python-level handler must exist so the default action
    (terminate) does not happen."""


def any_rank(flags: list, device) -> list[bool]:
    """Element-wise OR of per-rank flags (bools or 0-d device tensors): one small all-reduce and one
    device-to-host copy decide for everyone."""
    tensor = torch.stack([torch.as_tensor(f, device=device).float().reshape(()) for f in flags])
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [bool(v) for v in tensor.tolist()]


class StepGuard:
    def __init__(self, max_bad_steps: int, spike_ratio: float, spike_window: int):
        self.max_bad_steps, self.spike_ratio = max_bad_steps, spike_ratio
        self.recent = deque(maxlen=spike_window)
        self.consecutive_bad = 0

    def check(self, loss: float, grad_norm: float | None, step_applied: bool) -> bool:
        """True when the step was bad (non-finite loss or gradient norm, or no update applied)."""
        bad = not math.isfinite(loss) or (grad_norm is not None and not math.isfinite(grad_norm)) or not step_applied
        self.consecutive_bad = self.consecutive_bad + 1 if bad else 0
        return bad

    @property
    def exhausted(self) -> bool:
        return self.consecutive_bad >= self.max_bad_steps

    def spike(self, loss: float) -> float | None:
        """The moving average the loss spiked above, or None; finite losses feed the average."""
        if not math.isfinite(loss):
            return None
        average = sum(self.recent) / len(self.recent) if self.recent else None
        self.recent.append(loss)
        warm = len(self.recent) >= min(10, self.recent.maxlen)
        if self.spike_ratio and average and warm and loss > self.spike_ratio * average:
            return average
        return None



class LossScaleWatch:
    """fp16: a loss scale stuck at min_loss_scale means gradients overflow at every scale; say what to do."""

    def __init__(self, min_loss_scale: float, hits_to_report: int):
        self.min_loss_scale, self.hits_to_report, self.hits = min_loss_scale, hits_to_report, 0

    def advice(self, scale: float, gpu_has_bf16: bool) -> str | None:
        self.hits = self.hits + 1 if scale <= self.min_loss_scale else 0
        if self.hits != self.hits_to_report:
            return None
        fix = ("switch to bf16 (--set train.precision=bf16 with a bf16 block; no loss scaling needed)" if gpu_has_bf16
               else "raise deepspeed.fp16.min_loss_scale, lower the lr, or check the data at the spike")
        return (f"fp16 loss scale has been at min_loss_scale={self.min_loss_scale:g} for {self.hits} steps: "
                f"gradients overflow at every scale. Next step: {fix} (python -m trainer doctor explains more)")
