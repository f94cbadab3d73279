"""The loop: `fit` trains until max_steps (or stop_after, a stop signal, too many bad steps) and says why it
ended; each step is forward/backward/step per micro-batch, guards, logging, eval and checkpoints in that order.
"""
from __future__ import annotations

import enum
import time
from pathlib import Path

import torch
import torch.distributed as dist

from .. import ds as dsc
from .. import hardware, ranks
from ..resolve import Resolved
from . import checkpoint
from .checkpoint import TrainState
from .evaluation import EvalSet, evaluate_engine, first_evaluation
from .guards import LossScaleWatch, StepGuard, StopSignal, any_rank
from .hooks import Hooks
from .metrics import MetricsLogger, peak_memory_gb, print0
from .router import RouterWatch, router_metrics
from .preference import Objective


class Outcome(enum.Enum):
    """Why `fit` ended (label, exit code). A preempted run exits 0: it saved its work."""
    FINISHED = ("finished", 0)           # train.max_steps reached
    STOPPED_AFTER = ("stop_after", 0)    # train.stop_after steps done this invocation; checkpoint saved
    SIGNALLED = ("signal", 0)            # SIGTERM/SIGINT: checkpoint saved (unless train.on_signal=exit)
    BAD_STEPS = ("bad_steps", 3)         # train.max_bad_steps non-finite steps in a row; last good state saved
    CORRUPTED = ("corrupted", 3)         # non-finite weights: nothing saved, resume the last checkpoint

    @property
    def label(self) -> str:
        return self.value[0]

    @property
    def exit_code(self) -> int:
        return self.value[1]


def fit(engine, train_batches, eval_set: EvalSet, state: TrainState, resolved: Resolved, metrics: MetricsLogger,
        ckpt_dir: Path, resumed_from: str | None, hooks: Hooks | None = None, sampler=None,
        router: RouterWatch | None = None, objective: Objective | None = None) -> Outcome:
    """Train until max_steps (or stop_after, a stop signal, or too many bad steps); returns why it ended.
    `objective(batch)` is the loss of a micro-batch (the model's own, or preference tuning's: train/preference.py)."""
    cfg = resolved.config
    train, accum = cfg.train, cfg.train.grad_accum
    rank = ranks.rank()
    tokens_per_step = resolved.tokens_per_step
    batches = iter(train_batches)
    hooks = hooks or Hooks()
    objective = objective or Objective(engine)
    if state.objective is not None:  # resumed: this rank's objective state (GRPO: sampler, rollout) as saved
        objective.load_state_dict(state.objective)
    stop, guard = StopSignal(), StepGuard(train.max_bad_steps, train.spike_ratio, train.spike_window)
    scale_watch = LossScaleWatch(dsc.fp16_min_loss_scale(cfg.deepspeed), train.min_loss_scale_hits)
    metrics.start_progress(state.step, train.max_steps)
    window_start = time.perf_counter()
    window_loss, window_steps = state.log_window  # a resume continues the log window it was saved in
    last_step = min(train.max_steps, state.step + train.stop_after) if train.stop_after else train.max_steps
    ended = Outcome.FINISHED if last_step == train.max_steps else Outcome.STOPPED_AFTER

    engine.train()  # evaluate() switches back to train mode when it is done
    loop_start, first_step, evaluated = time.perf_counter(), state.step, False
    while state.step < last_step:
        position = train_batches.state_dict()  # where this step's data starts, for spike reports
        step_loss = torch.zeros((), device=engine.device)
        applied_lr, own_norm = engine.get_lr()[0], None  # the scheduler moves on inside engine.step()
        for micro in range(accum):  # DeepSpeed applies the optimizer at the accumulation boundary
            batch = next(batches)
            hooks.on_batch(batch, state.step + 1)
            batch = to_device(batch, engine.device)
            loss = hooks.on_loss(objective(batch), state.step + 1)
            engine.backward(loss)
            if micro == accum - 1:
                own_norm = norm_deepspeed_drops(engine)
            engine.step()
            step_loss += loss.detach().float()
        state.step += 1
        state.consumed_samples += resolved.batch.global_batch_size
        state.data = train_batches.state_dict()
        metrics.advance()
        hooks.after_step(engine, state.step)

        # one small all-reduce per step: did any rank see a non-finite loss, or a stop signal?
        nonfinite, stop_requested = any_rank([~torch.isfinite(step_loss), stop.requested], engine.device)
        loss_value = float("nan") if nonfinite else step_loss.item() / accum
        if guard.check(loss_value, grad_norm(engine, own_norm), engine.was_step_applied()):
            state.bad_steps += 1
            metrics.log({"step": state.step, "skipped_step": True, "bad_steps_in_a_row": guard.consecutive_bad})
            if nonfinite and engine.was_step_applied():  # no overflow check (ZeRO-0 fp32): weights are now bad
                print0(f"stopping: a non-finite update was applied at step {state.step} (ZeRO stage 0 has no "
                       f"overflow check); not saving; resume from the last checkpoint with --resume auto", rank=rank)
                stop.restore()
                return Outcome.CORRUPTED
            if guard.exhausted:
                print0(f"stopping: {guard.consecutive_bad} non-finite steps in a row (train.max_bad_steps); "
                       f"the last good state is saved at step {state.step}", rank=rank)
                ended = Outcome.BAD_STEPS
        else:
            window_loss += loss_value
            window_steps += 1
            average = guard.spike(loss_value)
            if average is not None:
                print0(f"warning: loss spike at step {state.step}: {loss_value:.4g} > {train.spike_ratio} x moving "
                       f"average {average:.4g}; data position {position}", rank=rank)
                metrics.log({"step": state.step, "loss_spike": loss_value, "data_position": position})

        if engine.fp16_enabled():
            advice = scale_watch.advice(engine.optimizer.cur_scale, hardware.gpu(cfg.hardware.gpu).bf16)
            if advice:
                print0(f"warning: {advice}", rank=rank)

        scheduled_log = state.step % cfg.logging.log_every == 0
        if window_steps and (scheduled_log or state.step == last_step):
            elapsed = time.perf_counter() - window_start
            metrics.log({"step": state.step,
                         "loss": mean_across_ranks(window_loss / window_steps, engine.device),
                         "lr": applied_lr,
                         "grad_norm": grad_norm(engine, own_norm),
                         **loss_scale(engine),
                         **metrics.throughput(tokens_per_step * window_steps, elapsed, window_steps),
                         **router_metrics(router, engine.device),  # MoE: aux loss, expert shares; collective
                         "peak_mem_gb": peak_memory_gb(),
                         **objective.metrics(engine.device)})
            if scheduled_log:  # an unscheduled last line leaves the window open for the resumed run
                window_start, window_steps, window_loss = time.perf_counter(), 0, 0.0

        if stop_requested:
            ended = Outcome.SIGNALLED
        if (train.eval_every and state.step % train.eval_every == 0) or state.step == train.max_steps:
            if evaluated:
                metrics.log({"step": state.step, **evaluate_engine(engine, eval_set, objective)})
            else:
                per_micro = (time.perf_counter() - loop_start) / ((state.step - first_step) * accum)
                metrics.log({"step": state.step, **first_evaluation(engine, eval_set, state.step, per_micro, rank,
                                                                     objective)})
                evaluated = True
            if sampler is not None:  # train.sample_prompts: every rank generates (ZeRO-3 gathers in forward)
                metrics.log_samples(state.step, sampler(engine))

        stopping = ended in (Outcome.SIGNALLED, Outcome.BAD_STEPS)
        save_now = stopping and not (stop_requested and train.on_signal == "exit")
        if (train.save_every and state.step % train.save_every == 0) or state.step == last_step or save_now:
            state.log_window = [window_loss, window_steps]
            state.objective = objective.state_dict()
            try:
                saved_at = checkpoint.save(engine, ckpt_dir, state, resolved.record(), train.keep_last,
                                           protect=resumed_from, checksums=train.checkpoint_checksums, hooks=hooks)
            except checkpoint.NonFiniteWeights as err:
                last = checkpoint.find_resume("auto", ckpt_dir)
                print0(f"stopping: {err}; " + (f"resume the last complete checkpoint with --resume {last}" if last
                       else "no complete checkpoint exists") + " and lower train.lr or check the data", rank=rank)
                stop.restore()
                return Outcome.CORRUPTED
            state.parent = saved_at.name  # the next checkpoint continues this one
            metrics.checkpointed(state.step)
            resumed_from = None  # a newer checkpoint exists now; the old one may be pruned later
        hooks.end_of_step(state.step)
        if stopping:
            saved = "checkpoint saved" if save_now else "no checkpoint (train.on_signal=exit)"
            why = f"signal ({stop.name or 'another rank'})" if ended is Outcome.SIGNALLED else ended.label
            print0(f"stopped at step {state.step} ({why}); {saved}; resume with --resume auto", rank=rank)
            break
    stop.restore()
    if ended is Outcome.STOPPED_AFTER:  # not finished, and nothing went wrong: say so, and how to go on
        print0(f"stopped at step {state.step} of {train.max_steps} (train.stop_after={train.stop_after} steps this "
               f"invocation); checkpoint saved: {ckpt_dir / checkpoint.tag_for(state.step)}; continue with the same "
               f"command and --resume auto", rank=rank)
    return ended


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def mean_across_ranks(value: float, device) -> float:
    value = torch.tensor(value, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)


def grad_norm(engine, own_norm: float | None = None) -> float | None:
    """The step's gradient norm before clipping: DeepSpeed's, or the loop's own where DeepSpeed keeps none."""
    norm = engine.get_global_grad_norm()
    return own_norm if norm is None else float(norm)


def norm_deepspeed_drops(engine) -> float | None:
    """The gradient norm at the accumulation boundary (gradients reduced, not yet clipped or stepped) when DeepSpeed
    will not keep one: ZeRO-0 with a plain torch optimizer (fp32) clips with torch's norm and drops it
    (engine._take_model_step reads `_global_grad_norm` only from its own optimizer wrappers). None otherwise."""
    if hasattr(engine.optimizer, "_global_grad_norm"):
        return None
    from deepspeed.runtime.utils import get_global_norm_of_tensors
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    return float(get_global_norm_of_tensors(grads, mpu=engine.mpu)) if grads else None


def loss_scale(engine) -> dict:
    if not engine.fp16_enabled():
        return {}
    return {"loss_scale": float(engine.optimizer.cur_scale)}
