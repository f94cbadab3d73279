"""The training job: `deepspeed train.py --preset NAME` ends up in `run_training`, and `fit` is the loop.

Read it top to bottom: resolve the config -> start the ranks -> data -> model -> deepspeed.initialize
-> resume -> fit (step, log, eval, save) -> final checkpoint -> HF export.
"""
from __future__ import annotations

import dataclasses
import enum
import math
import os
import random
import socket
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml

from . import checkpoint, ranks
from .checkpoint import TrainState
from .config import Config
from .errors import UserError
from . import ds_config as dsc
from .guards import Faults, LossScaleWatch, StepGuard, StopSignal, any_rank
from .hardware import GPUS
from .metrics import MetricsLogger, peak_memory_gb, print0, redact
from .presets import load_preset
from .resolve import Resolved, resolve


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


def run_training(preset: str, overrides: list[str], rehearse: bool = False, world_size: int | None = None) -> int:
    config = load_preset(preset, overrides)
    rank = start_distributed(config.train.dist_timeout_s)
    rehearsal_notices: list[str] = []
    if rehearse:
        from .rehearse import rehearsal_config
        config, rehearsal_notices = rehearsal_config(config, dist.get_world_size())
    resolved = resolve(config, world_size)
    check_world_size(resolved)
    cfg = resolved.config
    run_dir = Path(cfg.train.output_dir)
    seed_everything(cfg.train.seed, rank)
    for notice in rehearsal_notices + resolved.notices:
        print0(f"notice: {notice}", rank=rank)
    # Everything that can refuse the run (config, resume checkpoint, tokenizer, data) is checked
    # before the run directory is created or anything in it is written.
    ckpt_dir = run_dir / "checkpoints"
    resume_path, resume_step = checkpoint_to_resume(cfg, ckpt_dir, rank)
    if resume_step == cfg.train.max_steps:
        print0(f"resume: {resume_path} is at step {resume_step} = train.max_steps: this run is already finished; "
               f"nothing was done (raise train.max_steps to train on)", rank=rank)
        return 0

    from .data import MicroBatchLoader, build_datasets, load_tokenizer
    tokenizer = load_tokenizer(cfg.model)
    check_vocab(tokenizer, cfg)
    data = rank0_first(lambda: build_datasets(cfg.data, tokenizer, cfg.train.seed))
    print0(f"data: {data.stats}", rank=rank)
    check_enough_batches(data, resolved)
    prepare_run_dir(run_dir, resolved, rank)

    import deepspeed
    from .model import build_model, count_parameters
    model, hf_ds_config = build_model(cfg, rank)
    total_params, trainable_params = count_parameters(model)
    print0(f"model: {total_params:,} parameters ({trainable_params:,} trainable)", rank=rank)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=cfg.deepspeed)
    del hf_ds_config  # transformers' ZeRO-3 hooks are only needed while the model is built
    engine.config = redact(engine.config)  # DeepSpeed pickles this dict into every checkpoint (ds_config)

    dp_rank, dp_size = data_parallel_rank(engine), resolved.batch.data_parallel_size
    train_batches = MicroBatchLoader(data.train, cfg.train.micro_batch_size, dp_rank, dp_size, cfg.train.seed)
    eval_batches = MicroBatchLoader(data.eval, cfg.train.micro_batch_size, dp_rank, dp_size, cfg.train.seed,
                                    shuffle=False)

    state, resumed_from = resume_if_asked(engine, resume_path, ckpt_dir, train_batches, rank)

    metrics = MetricsLogger(cfg, run_dir, rank, total_params, resolved.world_size, config_dict(resolved))
    try:
        ended = fit(engine, train_batches, eval_batches, state, resolved, metrics, ckpt_dir, resumed_from)
        if cfg.train.export_hf and ended is Outcome.FINISHED:
            out = checkpoint.export_hf(engine, tokenizer, run_dir / "hf")
            if out:
                print0(f"exported HF model to {out}", rank=rank)
    finally:
        metrics.close()
    return ended.exit_code


def fit(engine, train_batches, eval_batches, state: TrainState, resolved: Resolved, metrics: MetricsLogger,
        ckpt_dir: Path, resumed_from: str | None) -> Outcome:
    """Train until max_steps (or stop_after, a stop signal, or too many bad steps); returns why it ended."""
    cfg = resolved.config
    train, accum = cfg.train, cfg.train.grad_accum
    rank = ranks.rank()
    tokens_per_step = resolved.tokens_per_step
    batches = iter(train_batches)
    stop, guard, faults = StopSignal(), StepGuard(train.max_bad_steps, train.spike_ratio, train.spike_window), Faults()
    scale_watch = LossScaleWatch(dsc.fp16_min_loss_scale(cfg.deepspeed), train.min_loss_scale_hits)
    metrics.start_progress(state.step, train.max_steps)
    window_start = time.perf_counter()
    window_loss, window_steps = state.log_window  # a resume continues the log window it was saved in
    last_step = min(train.max_steps, state.step + train.stop_after) if train.stop_after else train.max_steps
    ended = Outcome.FINISHED if last_step == train.max_steps else Outcome.STOPPED_AFTER

    engine.train()  # evaluate() switches back to train mode when it is done
    while state.step < last_step:
        position = train_batches.state_dict()  # where this step's data starts, for spike reports
        step_loss = torch.zeros((), device=engine.device)
        for _ in range(accum):  # DeepSpeed applies the optimizer at the accumulation boundary
            batch = to_device(next(batches), engine.device)
            loss = faults.nan_loss(engine(**batch).loss, state.step + 1)
            engine.backward(loss)
            engine.step()
            step_loss += loss.detach().float()
        state.step += 1
        state.consumed_samples += resolved.batch.global_batch_size
        state.data = train_batches.state_dict()
        metrics.advance()

        # one small all-reduce per step: did any rank see a non-finite loss, or a stop signal?
        nonfinite, stop_requested = any_rank([~torch.isfinite(step_loss), stop.requested], engine.device)
        loss_value = float("nan") if nonfinite else step_loss.item() / accum
        if guard.check(loss_value, grad_norm(engine), engine.was_step_applied()):
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
            advice = scale_watch.advice(engine.optimizer.cur_scale, GPUS[cfg.hardware.gpu].bf16)
            if advice:
                print0(f"warning: {advice}", rank=rank)

        scheduled_log = state.step % cfg.logging.log_every == 0
        if window_steps and (scheduled_log or state.step == last_step):
            elapsed = time.perf_counter() - window_start
            metrics.log({"step": state.step,
                         "loss": mean_across_ranks(window_loss / window_steps, engine.device),
                         "lr": engine.get_lr()[0],
                         "grad_norm": grad_norm(engine),
                         **loss_scale(engine),
                         **metrics.throughput(tokens_per_step * window_steps, elapsed, window_steps),
                         "peak_mem_gb": peak_memory_gb()})
            if scheduled_log:  # an unscheduled last line leaves the window open for the resumed run
                window_start, window_steps, window_loss = time.perf_counter(), 0, 0.0

        if stop_requested:
            ended = Outcome.SIGNALLED
        if (train.eval_every and state.step % train.eval_every == 0) or state.step == train.max_steps:
            eval_loss = evaluate(engine, eval_batches, train.eval_batches)
            metrics.log({"step": state.step, "eval_loss": eval_loss, "eval_ppl": math.exp(min(eval_loss, 50))})

        stopping = ended in (Outcome.SIGNALLED, Outcome.BAD_STEPS)
        save_now = stopping and not (stop_requested and train.on_signal == "exit")
        faults.poison_weights(engine, state.step)
        if (train.save_every and state.step % train.save_every == 0) or state.step == last_step or save_now:
            state.log_window = [window_loss, window_steps]
            try:
                saved_at = checkpoint.save(engine, ckpt_dir, state, config_dict(resolved), train.keep_last,
                                           protect=resumed_from, checksums=train.checkpoint_checksums, faults=faults)
            except checkpoint.NonFiniteWeights as err:
                last = checkpoint.find_resume("auto", ckpt_dir)
                print0(f"stopping: {err}; " + (f"resume the last complete checkpoint with --resume {last}" if last
                       else "no complete checkpoint exists") + " and lower train.lr or check the data", rank=rank)
                stop.restore()
                return Outcome.CORRUPTED
            state.parent = saved_at.name  # the next checkpoint continues this one
            resumed_from = None  # a newer checkpoint exists now; the old one may be pruned later
        faults.kill_if("kill_at", state.step, rank)
        if stopping:
            saved = "checkpoint saved" if save_now else "no checkpoint (train.on_signal=exit)"
            why = f"signal ({stop.name or 'another rank'})" if ended is Outcome.SIGNALLED else ended.label
            print0(f"stopped at step {state.step} ({why}); {saved}; resume with --resume auto", rank=rank)
            break
    stop.restore()
    return ended


@torch.no_grad()
def evaluate(engine, eval_batches, max_batches: int) -> float:
    """Mean token-level loss over the same first eval micro-batches of every rank, every time."""
    engine.eval()
    eval_batches.load_state_dict({"epoch": 0, "batches_in_epoch": 0})
    total, count = torch.zeros(()), torch.zeros(())
    for index, batch in enumerate(eval_batches):
        if index >= min(max_batches, eval_batches.batches_per_epoch()):
            break
        batch = to_device(batch, engine.device)
        loss = engine(**batch).loss.float().cpu()
        tokens = (batch["labels"][:, 1:] != -100).sum().cpu()  # the model shifts labels by one
        total += loss * tokens
        count += tokens
    engine.train()
    pair = torch.stack([total, count]).to(engine.device)
    if dist.is_initialized():
        dist.all_reduce(pair)
    return float(pair[0] / pair[1].clamp(min=1))


# --- small helpers ---------------------------------------------------------------------------------

def start_distributed(timeout_s: int = 1800) -> int:
    """deepspeed.init_distributed under a launcher; a one-rank group for a plain `python` run. Each rank
    binds its accelerator first, so collectives before deepspeed.initialize use the right device."""
    import datetime
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    if get_accelerator().device_name() != "cpu":
        get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
    remove_shm_buffer()  # a stale one of a crashed job on this port would be read by the peers before reset
    timeout = datetime.timedelta(seconds=timeout_s)
    # DeepSpeed builds its data/model-parallel groups with new_group(timeout=None), which takes torch's
    # default (30 min gloo, 10 min NCCL), not the world group's: set the default itself, so every
    # collective of the run (ZeRO's gradient reduction included) gives up after train.dist_timeout_s.
    from torch.distributed import distributed_c10d
    distributed_c10d.default_pg_timeout = distributed_c10d.default_pg_nccl_timeout = timeout
    deepspeed.init_distributed(timeout=timeout)
    return dist.get_rank()


def end_distributed(succeeded: bool = True) -> None:
    """After a successful run: wait for every rank, remove this rank's shared-memory buffer, and tear the
    process group down before the interpreter exits."""
    if not dist.is_initialized():
        return
    if succeeded:
        dist.barrier()  # no peer still reads this rank's buffer
        remove_shm_buffer()
    dist.destroy_process_group()


def shm_buffer_path() -> Path:
    """DeepSpeed's CPU shared-memory all-reduce buffer of this rank (69 MB in /dev/shm), which DeepSpeed
    0.19.8 never unlinks (its shm.cpp names it uid_addr_port_rank): every CPU job would leave one per rank."""
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{os.environ.get('RANK', '0')}")
    return Path("/dev/shm") / name


def remove_shm_buffer() -> None:
    try:
        shm_buffer_path().unlink()
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        pass


def comm_device():
    """The device collectives run on before the engine exists (CPU under gloo, this rank's GPU under NCCL)."""
    from deepspeed.accelerator import get_accelerator
    return torch.device(get_accelerator().current_device_name())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def seed_everything(seed: int, rank: int) -> None:
    """Dropout and other runtime randomness differ per rank; init and data order have their own seeds."""
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)


def prepare_run_dir(run_dir: Path, resolved: Resolved, rank: int) -> None:
    if rank == 0:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            probe = run_dir / ".write_test"
            probe.write_text("ok")
            probe.unlink()
        except OSError as err:
            raise UserError(f"train.output_dir {str(run_dir)!r} is not writable: {err.strerror}; "
                            f"choose another directory with --set train.output_dir=PATH") from None
        write_resolved_config(run_dir, config_dict(resolved))
    ranks.barrier()


def write_resolved_config(run_dir: Path, config: dict) -> Path:
    """`config.resolved.yaml` is this invocation's config; every invocation's is kept in `configs/`
    (0001.yaml, 0002.yaml, ...), so a resume with other settings does not rewrite the run's history."""
    text = yaml.safe_dump(config, sort_keys=False)
    history = run_dir / "configs"
    history.mkdir(exist_ok=True)
    number = 1 + max((int(p.stem) for p in history.glob("[0-9]*.yaml") if p.stem.isdigit()), default=0)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    (history / f"{number:04d}.yaml").write_text(f"# invocation {number}, started {started}\n{text}")
    (run_dir / "config.resolved.yaml").write_text(text)
    return history / f"{number:04d}.yaml"


def config_dict(resolved: Resolved) -> dict:
    return redact(resolved.document())


def rank0_first(build):
    """Run `build` on rank 0 first, then on the others: a data error is reported once, by rank 0, while the
    others wait (the launcher then stops them), and a hub dataset is downloaded once into the cache."""
    if ranks.rank() != 0:
        ranks.barrier()
    result = build()
    if ranks.rank() == 0:
        ranks.barrier()
    return result


def check_world_size(resolved: Resolved) -> None:
    running = dist.get_world_size()
    if resolved.world_size != running:
        raise UserError(
            f"the config is resolved for {resolved.world_size} ranks (hardware.nodes x hardware.gpus_per_node, or "
            f"--world-size) but {running} rank(s) are running: launch {resolved.world_size} ranks (e.g. deepspeed "
            f"--num_gpus {resolved.world_size} train.py ...), or resolve for these with --world-size {running}")


def check_enough_batches(data, resolved: Resolved) -> None:
    """Each split gives every data-parallel rank at least one micro-batch (else MicroBatchLoader would
    refuse it later, after the run directory exists)."""
    from .data import DataError
    cfg, dp = resolved.config, resolved.batch.data_parallel_size
    micro = cfg.train.micro_batch_size
    for name, split in (("train", data.train), ("eval", data.eval)):
        if len(split) < micro * dp:
            source = cfg.data.eval_source if name == "eval" and cfg.data.eval_source else cfg.data.source
            raise DataError(f"{source}: the {name} split has {len(split)} sequence(s) of data.seq_len="
                            f"{cfg.data.seq_len} tokens, fewer than one micro-batch (train.micro_batch_size={micro}) "
                            f"for each of {dp} data-parallel rank(s); add data or lower train.micro_batch_size or "
                            f"data.seq_len" + (" (or raise data.eval_fraction)" if name == "eval" else ""))


def check_vocab(tokenizer, cfg: Config) -> None:
    if len(tokenizer) > cfg.model.vocab_size:
        raise UserError(f"the tokenizer has {len(tokenizer)} tokens but model.vocab_size is {cfg.model.vocab_size}: "
                        f"raise model.vocab_size or use the model's own tokenizer")


def checkpoint_to_resume(cfg: Config, ckpt_dir: Path, rank: int) -> tuple[Path | None, int]:
    """The checkpoint to resume from (None: a fresh run) and its step; checked to be complete, intact, free
    of foreign pickled objects (on every rank, before any rank loads anything), of this model shape, and
    not past train.max_steps."""
    path = checkpoint.find_resume(cfg.train.resume, ckpt_dir)
    if path is None:
        if cfg.train.resume == "auto":
            print0(f"resume: no complete checkpoint in {ckpt_dir}, starting fresh", rank=rank)
        return None, 0
    saved_state, saved_config = checkpoint.read_trainer_state(path)
    checkpoint.check_same_model(saved_config, dataclasses.asdict(cfg.model), path)
    if saved_state.step > cfg.train.max_steps:
        raise UserError(f"checkpoint {path} is at step {saved_state.step}, past train.max_steps={cfg.train.max_steps}: "
                        f"nothing to train and nothing was written; raise train.max_steps (e.g. --set train.max_steps="
                        f"{2 * saved_state.step}) or resume an earlier checkpoint with --resume PATH")
    checkpoint.verify(path, comm_device())
    newer = [p.name for p in checkpoint.complete_checkpoints(ckpt_dir) if p.name > path.name]
    if newer and path.parent.resolve() == ckpt_dir.resolve():
        print0(f"notice: resuming {path.name} although newer checkpoints exist ({', '.join(newer)}); they are set "
               f"aside in {ckpt_dir / 'abandoned'} at this run's first save, not deleted", rank=rank)
    return path, saved_state.step


def resume_if_asked(engine, path: Path | None, ckpt_dir: Path, train_batches, rank: int):
    """(TrainState, the resumed path) -- a fresh TrainState and None without a checkpoint."""
    if path is None:
        return TrainState(), None
    state = checkpoint.load(engine, path, ckpt_dir)
    train_batches.load_state_dict(state.data)
    print0(f"resume: continuing from {path} (step {state.step})", rank=rank)
    return state, str(path)


def data_parallel_rank(engine) -> int:
    """Ranks of one AutoTP group share a data-parallel rank (and so see the same batch, as DeepSpeed demands)."""
    if engine.autotp_size() > 1:
        return engine.get_data_parallel_rank()  # DeepSpeed's (dp, tp) mesh
    return dist.get_rank()


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def mean_across_ranks(value: float, device) -> float:
    value = torch.tensor(value, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)


def grad_norm(engine) -> float | None:
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


def loss_scale(engine) -> dict:
    if not engine.fp16_enabled():
        return {}
    return {"loss_scale": float(engine.optimizer.cur_scale)}

