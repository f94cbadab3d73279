"""Failure injection for the reliability tests, through the trainer's hooks (trainer/train/hooks.py).

TRAINER_FAULTS="nan_loss@3,kill_in_save@8" names fault@step points; tests/workers/train_with_faults.py runs
`python -m trainer train` with them, so production code carries no test plumbing:

  nan_loss@N            step N's loss becomes NaN (every micro-batch, every rank)
  nan_weights@N         NaN written into the first parameter after step N (no loss check sees it)
  kill_at@N             rank 1 (rank 0 when alone) is SIGKILLed at the end of step N
  pause_at@N            every rank sleeps 5 s at the end of step N (background writers catch up: a kill is late)
  kill_in_save@N        rank 1 is SIGKILLed in save N with its files written, nothing marked COMPLETE
  kill_before_latest@N  rank 0 is SIGKILLed in save N after COMPLETE, before `latest` moves
"""
from __future__ import annotations

import os
import signal
import time

import torch

from trainer import ranks
from trainer.train.hooks import Hooks


class Faults(Hooks):
    def __init__(self, spec: str | None = None):
        spec = os.environ.get("TRAINER_FAULTS", "") if spec is None else spec
        self.points = {(name, int(step)) for name, _, step in (item.partition("@") for item in spec.split(","))
                       if step}

    def active(self, name: str, step: int) -> bool:
        return (name, step) in self.points

    def on_loss(self, loss, step: int):
        return loss * float("nan") if self.active("nan_loss", step) else loss

    def after_step(self, engine, step: int) -> None:
        if self.active("nan_weights", step):
            param = next(engine.module.parameters())
            target = param.ds_tensor if getattr(param, "ds_tensor", None) is not None else param.data  # ZeRO-3
            with torch.no_grad():
                target.view(-1)[:1024] = float("nan")

    def in_save(self, point: str, step: int) -> None:
        if point == "files_written":
            self.kill_if("kill_in_save", step)
        elif point == "before_latest":
            self.kill_if("kill_before_latest", step, victim=0)

    def end_of_step(self, step: int) -> None:
        if self.active("pause_at", step):
            time.sleep(5)
        self.kill_if("kill_at", step)

    def kill_if(self, name: str, step: int, victim: int | None = None) -> None:
        """SIGKILL this rank at the named point if it is the victim (default: rank 1, or rank 0 when alone)."""
        if victim is None:
            victim = 1 if ranks.world_size() > 1 else 0
        if ranks.rank() == victim and self.active(name, step):
            os.kill(os.getpid(), signal.SIGKILL)
