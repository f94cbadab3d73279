"""Where a benchmark, a test or a fork can watch or change a run without patching the trainer.

    class Timer(Hooks):
        def after_step(self, engine, step):
            times.append(time.perf_counter())

    run_training("tiny_cpu", [], hooks=Timer())

Every method is a no-op by default, so a subclass overrides only what it needs. `scripts/bench.py` times
steps with `after_step`; the reliability tests inject crashes and NaNs with them (tests/faults.py).
"""
from __future__ import annotations


class Hooks:
    def on_resolved(self, resolved) -> None:
        """The resolved config, before anything is built (the benchmark checks it is the exported JSON)."""

    def on_model(self, model) -> None:
        """The model as built, before `deepspeed.initialize` wraps it."""

    def on_batch(self, batch: dict, step: int) -> None:
        """Each micro-batch of optimizer step `step` (1-based) as the loader gave it (CPU tensors), before forward."""

    def on_loss(self, loss, step: int):
        """Each micro-batch's loss of optimizer step `step` (1-based), before backward; returns the loss used."""
        return loss

    def after_step(self, engine, step: int) -> None:
        """Right after optimizer step `step` and its bookkeeping, before the guards, logging, eval and save."""

    def in_save(self, point: str, step: int) -> None:
        """Inside the save of step `step`: at "files_written" (every rank, nothing marked COMPLETE yet) and at
        "before_latest" (rank 0, COMPLETE written, `latest` not yet moved)."""

    def end_of_step(self, step: int) -> None:
        """After step `step`'s eval and checkpoint, before the next step begins."""
