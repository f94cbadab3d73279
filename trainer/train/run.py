"""The training job: `deepspeed train.py --preset NAME` ends up in `run_training`.

Read it top to bottom: `start` (resolve the config, start the ranks) -> check the resume checkpoint ->
`build` (data, model, deepspeed.initialize) -> resume -> `fit` (train/loop.py) -> HF export. Everything that can refuse
the run is checked before the run directory is written.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
import yaml

from .. import ds as dsc
from .. import provenance, ranks
from ..config import Config
from ..distributed import comm_device, seed_everything, start_distributed
from ..errors import UserError
from ..launch.fabric import report_network_env
from ..presets import blamed, load_preset, preset_path, set_keys, with_overrides
from ..options import resolve_run
from ..redact import redact
from ..resolve import Resolved, resolve
from ..run_dir import check_not_foreign, previous_run, set_aside_previous_run
from . import checkpoint, elastic, sequence_parallel
from .checkpoint import TrainState
from .evaluation import EvalSet
from .hooks import Hooks
from .loop import Outcome, fit
from .metrics import MetricsLogger, Resumed, print0
from .router import RouterWatch
from .samples import make_sampler


@dataclass
class Job:
    """What `build` makes for `fit`: the engine, the batches, and what the export and metrics need."""
    engine: Any
    tokenizer: Any
    train_batches: Any
    eval_set: EvalSet
    active_params: int   # parameters a token passes through (all of them, unless MoE): what MFU counts
    sampler: Any = None  # train.sample_prompts' generator, or None
    router: Any = None   # an MoE model's RouterWatch (router health in metrics.jsonl), or None
    objective: Any = None  # the loss of a micro-batch (train/preference.py); None: the model's own


def run_training(preset: str, overrides: list[str], rehearse: bool = False, world_size: int | None = None,
                 hooks: Hooks | None = None) -> int:
    hooks = hooks or Hooks()
    resolved = start(preset, overrides, rehearse, world_size)
    hooks.on_resolved(resolved)
    cfg, rank = resolved.config, ranks.rank()
    run_dir = Path(cfg.train.output_dir)
    # Everything that can refuse the run (config, resume checkpoint, tokenizer, data) is checked
    # before the run directory is created or anything in it is written.
    ckpt_dir = run_dir / "checkpoints"
    resume_path, resume_step = checkpoint_to_resume(cfg, ckpt_dir, rank)
    fresh = starts_afresh(run_dir, resume_path)
    if resume_step == cfg.train.max_steps:
        print0(f"resume: {resume_path} is at step {resume_step} = train.max_steps: this run is already finished; "
               f"nothing was done (raise train.max_steps to train on)", rank=rank)
        return 0
    resolved, universal_dir = elastic.adapt(resolved, resume_path, set_keys(overrides), comm_device(),
                                            lambda extra: configure(preset, with_overrides(overrides, extra), rehearse,
                                                                     world_size)[0])
    cfg = resolved.config
    record = run_record(resolved) if rank == 0 else resolved.record()  # only rank 0 writes it (git runs once)
    job = build(resolved, run_dir, hooks, record, universal=universal_dir is not None, fresh=fresh)
    state, resumed_from = resume_if_asked(job.engine, resume_path, ckpt_dir, job.train_batches, rank, universal_dir)

    metrics = MetricsLogger(cfg, run_dir, rank, job.active_params, resolved.world_size, record,
                            resumed_metrics(state, resume_path, ckpt_dir))
    if metrics.wandb_run_id:
        state.wandb_run_id = metrics.wandb_run_id  # every checkpoint names the wandb run its history logs to
    try:
        ended = fit(job.engine, job.train_batches, job.eval_set, state, resolved, metrics, ckpt_dir,
                    resumed_from, hooks, job.sampler, job.router, job.objective)
        if cfg.train.export_hf and ended is Outcome.FINISHED:
            merged = run_dir / "hf_merged" if cfg.train.export_merged and cfg.model.lora.enabled else None
            out = checkpoint.export_hf(job.engine, job.tokenizer, run_dir / "hf", state.step, merged)
            if out:
                print0(f"exported HF model to {out}", rank=rank)
                metrics.log_model(out, state.step)
    finally:
        metrics.close()
    return ended.exit_code


def start(preset: str, overrides: list[str], rehearse: bool, world_size: int | None) -> Resolved:
    """The config resolved for the ranks that are running, the process group up, seeds set, notices printed."""
    rank = start_distributed(load_preset(preset, overrides).train.dist_timeout_s)
    report_network_env(rank)
    resolved, rehearsal_notices = configure(preset, overrides, rehearse, world_size)
    seed_everything(resolved.config.train.seed, rank)
    for notice in rehearsal_notices + resolved.notices:
        print0(f"notice: {notice}", rank=rank)
    return resolved


def configure(preset: str, overrides: list[str], rehearse: bool, world_size: int | None) -> tuple[Resolved, list]:
    """The config resolved for the ranks that are running (the process group is up), and the rehearsal's notices."""
    config = load_preset(preset, overrides)
    rehearsal_notices: list[str] = []
    if rehearse:
        from .rehearse import rehearsal_config
        config, rehearsal_notices = rehearsal_config(config, dist.get_world_size(), set_keys(overrides))
    alone = None if rehearse else lambda: resolve(load_preset(preset), world_size)  # the preset without --set
    with blamed(str(preset_path(preset)), overrides, alone):
        resolved = resolve_run(config, world_size)  # train.epochs -> max_steps from the prepared data
    check_world_size(resolved)
    return resolved, rehearsal_notices


def run_record(resolved: Resolved) -> dict:
    """What config.resolved.yaml and wandb keep: the resolved record plus its provenance (trainer/provenance.py)."""
    record = resolved.record()
    world = provenance.world_layout(resolved.world_size,
                                    provenance.launcher_ranks_per_node(resolved.config.hardware.gpus_per_node),
                                    resolved.batch.data_parallel_size, resolved.summary()["autotp_size"])
    return {**record, "provenance": provenance.collect(record, world)}


def resumed_metrics(state: TrainState, path: Path | None, ckpt_dir: Path) -> Resumed | None:
    """The resume as the metrics rewind it; the checkpoint's wandb run only for a checkpoint of this run directory
    (resuming another directory's checkpoint starts a new wandb run instead of rewinding that one)."""
    if path is None:
        return None
    own = path.parent.resolve() == ckpt_dir.resolve()
    return Resumed(state.step, path.name, state.wandb_run_id if own else None)


def build(resolved: Resolved, run_dir: Path, hooks: Hooks, record: dict | None = None, universal: bool = False,
          fresh: bool = True) -> Job:
    """Tokenizer and data (checked before the run directory is written), then the model and the engine
    (`record`: what config.resolved.yaml keeps; `universal`: load a universal checkpoint, for a resume on another
    topology; `fresh`: nothing is resumed, so a previous run in the directory is set aside first)."""
    import deepspeed

    from ..data import MicroBatchLoader, apply_chat_template, build_datasets, load_tokenizer
    from ..moe import active_parameters, enable_autoep_with_installed_transformers
    from ..model import (build_model, checkpoint_offload_in_use, count_parameters, kernels_in_use, zero3_leaf_config,
                         zero3_leaves_in_use)
    cfg, rank = resolved.config, ranks.rank()
    tokenizer = apply_chat_template(load_tokenizer(cfg.model), cfg.data)  # the exported tokenizer keeps it
    check_vocab(tokenizer, cfg)
    grpo = cfg.data.task == "grpo"
    if grpo:  # prompts + answers, read and checked by every rank (small JSONL files: train/rl/prompts.py)
        from .rl.prompts import build_prompt_data
        data = build_prompt_data(cfg, tokenizer)
    else:
        data = build_datasets(cfg.data, tokenizer, cfg.train.seed)  # collective: rank 0 prepares, the ranks verify
    print0(f"data: {data.stats}", rank=rank)
    if not grpo:
        check_enough_batches(data, resolved)
    prepare_run_dir(run_dir, record or resolved.record(), rank, fresh)

    sequence_parallel.release()  # what an earlier run in this process registered (tests train several per launch)
    model, hf_ds_config = build_model(cfg, rank, len(tokenizer))
    tiled = sequence_parallel.tile_mlps(model, cfg.model.tiled_mlp)
    hooks.on_model(model)
    total_params, trainable_params = count_parameters(model)
    active = active_parameters(model, total_params)
    per_token = f", {active:,} active per token" if active != total_params else ""
    print0(f"model: {total_params:,} parameters ({trainable_params:,} trainable{per_token}); "
           f"{kernels_in_use(model, training_loss_kernel(cfg, model))}"
           f"{sequence_parallel.tiling_in_use(tiled, cfg.model)}{checkpoint_offload_in_use(cfg)}", rank=rank)
    warn_documents_attend_across(cfg, model, rank)
    if zero3_leaves_in_use(model):
        print0(f"ZeRO-3 leaf modules (gathered whole, MoE routing cannot desynchronise the ranks): "
               f"{zero3_leaves_in_use(model)}", rank=rank)
    if dsc.autoep_size(cfg.deepspeed) > 1 or dsc.expert_parallel(cfg.deepspeed).get("enabled"):
        enable_autoep_with_installed_transformers()
        print0(f"expert parallelism (DeepSpeed AutoEP): experts split over groups of "
               f"{dsc.autoep_size(cfg.deepspeed)} ranks", rank=rank)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=zero3_leaf_config(model, engine_config(cfg, universal)), mpu=sequence_parallel.register(model, cfg))
    del hf_ds_config  # transformers' ZeRO-3 hooks are only needed while the model is built
    start = dsc.scheduler_start(cfg.deepspeed, cfg.train.warmup_steps)
    if start is not None:  # step 1 applies the warmup's first lr, not DeepSpeed's "not started" (trainer/ds/auto.py)
        engine.lr_scheduler.step(start)  # a resume then loads the checkpoint's own iteration over it
    engine.config = redact(engine.config)  # DeepSpeed pickles this dict into every checkpoint (ds_config)

    dp_rank, dp_size, micro = data_parallel_rank(engine), resolved.batch.data_parallel_size, cfg.train.micro_batch_size
    if grpo:
        return grpo_job(engine, tokenizer, data, resolved, active, dp_rank, dp_size, model)
    train_batches = MicroBatchLoader(data.train, micro, dp_rank, dp_size, cfg.train.grad_accum)
    eval_set = EvalSet({stream.sources[0].name: stream for stream in data.eval}, cfg.train.eval_sequences, micro,
                       dp_rank, dp_size)
    sampler = make_sampler(tokenizer, cfg.train.sample_prompts, cfg.train.sample_max_new_tokens)
    return Job(engine, tokenizer, train_batches, eval_set, active, sampler, RouterWatch.attach(model),
               objective_of(engine, cfg, rank, data))


def grpo_job(engine, tokenizer, data, resolved: Resolved, active: int, dp_rank: int, dp_size: int, model) -> Job:
    """data.task=grpo: prompts dealt per step, the eval prompts, and the GRPO objective against its reference (none
    when grpo.beta=0; the LoRA base with the adapter disabled; else a frozen engine: train/preference.py)."""
    from .preference import adapter_disabled, reference_engine
    from .rl.objective import GrpoObjective
    from .rl.prompts import GrpoEvalSet, PromptLoader
    cfg, rank, g = resolved.config, ranks.rank(), resolved.config.grpo
    micro, accum = cfg.train.micro_batch_size, cfg.train.grad_accum
    loader = PromptLoader(len(data.train), micro // g.num_generations, accum, dp_rank, dp_size, g.num_iterations,
                          cfg.train.seed)
    eval_set = GrpoEvalSet(data.eval[:cfg.train.eval_sequences], micro, dp_size)
    if g.beta == 0:
        reference, described = None, "none (grpo.beta=0)"
    elif cfg.model.lora.enabled:
        reference, described = adapter_disabled(engine), "the base model with the LoRA adapter disabled"
    else:
        frozen = reference_engine(cfg, rank)
        reference = lambda ids, mask: frozen(input_ids=ids, attention_mask=mask).logits  # noqa: E731
        described = f"a frozen DeepSpeed engine ({dsc.frozen_reference_placement(cfg.deepspeed, False)})"
    print0(f"grpo: {g.num_generations} completions per prompt, {micro // g.num_generations} prompt(s) per "
           f"micro-batch, loss {g.loss_type}, beta {g.beta}, {g.num_iterations} iteration(s) per rollout; "
           f"reference = {described}; rewards: {', '.join(f'{r.name} x {r.weight:g}' for r in g.rewards)}", rank=rank)
    objective = GrpoObjective(engine, cfg, tokenizer, data.train, reference, accum, rank, resolved.world_size)
    return Job(engine, tokenizer, loader, eval_set, active, None, RouterWatch.attach(model), objective)


def training_loss_kernel(cfg: Config, model) -> str:
    """The loss kernel of the training forward, on the path trainer.loss_path decides for this model as built."""
    from .. import loss_path
    from ..model import liger_applied
    forward = "policy" if cfg.data.task in ("preference", "grpo") else "causal"
    path = loss_path.loss_path(forward, liger_applied(model), dsc.zero_stage(cfg.deepspeed),
                               dsc.sequence_parallel_size(cfg.deepspeed), cfg.model.tiled_logits or 0)
    return loss_path.loss_kernel(path, liger_applied(model))


def warn_documents_attend_across(cfg: Config, model, rank: int) -> None:
    """Under sequence parallelism DeepSpeed's Ulysses attention drops the attention mask (ulysses_sp.py): isolated
    documents stay apart only through flash-attn's position-id restarts in a one-sequence micro-batch; say so where
    they would not."""
    from ..model import attention_in_use
    isolated = cfg.data.task != "preference" and cfg.data.cross_document_attention is False and (
        cfg.data.task == "pretrain" or cfg.data.packing)
    flash_row = attention_in_use(model) == "flash_attention_2" and cfg.train.micro_batch_size == 1
    if isolated and dsc.sequence_parallel_size(cfg.deepspeed) > 1 and not flash_row:
        print0(f"warning: data.cross_document_attention=false under sequence parallelism: position ids restart per "
               f"document, but DeepSpeed's Ulysses attention drops the mask, so with {attention_in_use(model)} and "
               f"micro-batch {cfg.train.micro_batch_size} packed documents attend to earlier ones in their sequence; "
               f"flash_attention_2 with train.micro_batch_size=1 keeps them apart", rank=rank)


def objective_of(engine, cfg: Config, rank: int, data):
    """The loss the loop trains on: the model's own, or preference tuning's against its reference model (with
    preference.reference=precomputed, its log-probs are attached to `data`'s samples first)."""
    from .preference import make_objective, reference_engine, reference_kind
    if cfg.data.task != "preference":
        return make_objective(engine, cfg)
    kind = reference_kind(cfg)
    where = dsc.frozen_reference_placement(cfg.deepspeed, cfg.preference.reference_offload)
    described = {"adapter": "the base model with the LoRA adapter disabled",
                 "engine": f"a frozen DeepSpeed engine ({where})",
                 "precomputed": "log-probs computed once before training"}[kind]
    print0(f"preference: {cfg.preference.loss} loss, beta {cfg.preference.beta}, reference = {described}", rank=rank)
    if kind == "precomputed":
        precompute_reference(engine, cfg, rank, data)
    return make_objective(engine, cfg, reference_engine(cfg, rank) if kind == "engine" else None)


def precompute_reference(engine, cfg: Config, rank: int, data) -> None:
    """The reference's log-probs of every pair (train and eval), read from data.cache_dir or computed now by the
    adapter-disabled base (LoRA) or a temporary frozen engine, freed before training."""
    from ..data import shards
    from ..data.prepare import cache_dir
    from . import reference_logps
    from .preference import adapter_disabled, reference_engine
    cache = cache_dir(cfg.data)
    model = reference_logps.identity_of_model(cfg, cache)
    streams = {}
    for name, samples in [(f"{s.name}-train", s.samples) for s in data.train.sources] + \
            [(f"{stream.sources[0].name}-eval", stream.sources[0].samples) for stream in data.eval]:
        split_dir = samples.split.stems[0].parent  # <prepared>/<split>/00000
        manifest = shards.read_manifest(split_dir.parent)
        streams[name] = (samples, reference_logps.split_inputs(manifest, split_dir.name, model, cfg, samples.pad_id))
    if cfg.model.lora.enabled:
        reference, frozen = adapter_disabled(engine), None
    else:
        frozen = reference_engine(cfg, rank)
        reference = lambda ids, mask: frozen(input_ids=ids, attention_mask=mask).logits  # noqa: E731
    engine.eval()
    try:
        computed = reference_logps.attach(streams, cache, reference, cfg.train.micro_batch_size, engine.device,
                                          cfg.data.trust_shared_cache)
    finally:
        engine.train()
        del frozen
    print0(f"preference: reference log-probs {'computed for ' + ', '.join(computed) if computed else 'read'} "
           f"({cache / reference_logps.KIND})", rank=rank)


def engine_config(cfg: Config, universal: bool) -> dict:
    """The DeepSpeed config handed to the engine: the resolved one, with the checkpoint writer chosen and, for a
    resume on another topology, universal loading on (neither is recorded in the run's resolved config)."""
    ds = dsc.with_checkpoint_writer(cfg.deepspeed, cfg.train.checkpoint_writer)
    return dsc.with_universal_load(ds) if universal else ds


def prepare_run_dir(run_dir: Path, record: dict, rank: int, fresh: bool = True) -> None:
    """The run directory made writable and, for a fresh start, emptied of a previous run (moved whole to
    previous/<time>/, never overwritten: trainer/run_dir.py); then this invocation's config."""
    if rank == 0:
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            probe = run_dir / ".write_test"
            probe.write_text("ok")
            probe.unlink()
        except OSError as err:
            raise UserError(f"train.output_dir {str(run_dir)!r} is not writable: {err.strerror}; "
                            f"choose another directory with --set train.output_dir=PATH") from None
        moved = set_aside_previous_run(run_dir) if fresh else None
        if moved:
            print0(moved.message("train"), rank=rank)
        write_resolved_config(run_dir, record)
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


def check_world_size(resolved: Resolved) -> None:
    running = dist.get_world_size()
    if resolved.world_size != running:
        raise UserError(
            f"the config is resolved for {resolved.world_size} ranks (hardware.nodes x hardware.gpus_per_node, or "
            f"--world-size) but {running} rank(s) are running: launch {resolved.world_size} ranks (e.g. deepspeed "
            f"--num_gpus {resolved.world_size} train.py ...), or resolve for these with --world-size {running}")


def check_enough_batches(data, resolved: Resolved) -> None:
    """The train stream gives every data-parallel rank at least one micro-batch (checked before the run directory
    is written): a stream shorter than one global batch would repeat samples within a step. Eval needs only one
    sequence (the eval set is split over the ranks, whatever its size)."""
    from ..data import DataError
    cfg, dp = resolved.config, resolved.batch.data_parallel_size
    micro = cfg.train.micro_batch_size
    if len(data.train) < micro * dp:
        source = ", ".join(s.origin for s in data.train.sources)
        raise DataError(f"{source}: the train split has {len(data.train)} sequence(s) of data.seq_len="
                        f"{cfg.data.seq_len} tokens, fewer than one micro-batch (train.micro_batch_size={micro}) "
                        f"for each of {dp} data-parallel rank(s); add data or lower train.micro_batch_size or "
                        f"data.seq_len")


def check_vocab(tokenizer, cfg: Config) -> None:
    """A model built from scratch has model.vocab_size rows; a pretrained one grows its own (model.fit_embeddings)."""
    if not cfg.model.name_or_path and len(tokenizer) > cfg.model.vocab_size:
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
    checkpoint.verify(path, comm_device())  # before any file in it is read, its own trainer state included
    saved_state, saved_config = checkpoint.read_trainer_state(path)
    checkpoint.check_same_model(saved_config, dataclasses.asdict(cfg.model), path)
    if saved_state.step > cfg.train.max_steps:
        raise UserError(f"checkpoint {path} is at step {saved_state.step}, past train.max_steps={cfg.train.max_steps}: "
                        f"nothing to train and nothing was written; raise train.max_steps (e.g. --set train.max_steps="
                        f"{2 * saved_state.step}) or resume an earlier checkpoint with --resume PATH")
    newer = [p.name for p in checkpoint.complete_checkpoints(ckpt_dir) if p.name > path.name]
    if newer and path.parent.resolve() == ckpt_dir.resolve():
        print0(f"notice: resuming {path.name} although newer checkpoints exist ({', '.join(newer)}); they are set "
               f"aside in {ckpt_dir / 'abandoned'} at this run's first save, not deleted", rank=rank)
    return path, saved_state.step


def starts_afresh(run_dir: Path, resume_path: Path | None) -> bool:
    """Whether this run starts its directory afresh (it resumes nothing, or another directory's checkpoint), so a
    previous run there is set aside at the first write; a directory of someone else's files is refused here, on every
    rank, before anything is built."""
    if resume_path is not None and resume_path.parent.resolve() == (run_dir / "checkpoints").resolve():
        return False
    check_not_foreign(run_dir, previous_run(run_dir, keep_startup_files=True))
    return True


def resume_if_asked(engine, path: Path | None, ckpt_dir: Path, train_batches, rank: int,
                    universal_dir: Path | None = None):
    """(TrainState, the resumed path) -- a fresh TrainState and None without a checkpoint. `universal_dir`: the
    checkpoint's universal conversion, loaded instead of its own DeepSpeed files (another topology)."""
    if path is None:
        return TrainState(), None
    state = checkpoint.load(engine, path, ckpt_dir, universal_dir)
    train_batches.load_state_dict(state.data)
    print0(f"resume: continuing from {path} (step {state.step})", rank=rank)
    return state, str(path)


def data_parallel_rank(engine) -> int:
    """Ranks of one AutoTP or sequence-parallel group share a data-parallel rank (and so see the same batch, as
    DeepSpeed demands)."""
    if engine.autotp_size() > 1:
        return engine.get_data_parallel_rank()  # DeepSpeed's (dp, tp) mesh
    if sequence_parallel.sequence_parallel_size(engine) > 1:
        return sequence_parallel.data_parallel_rank(engine)
    return dist.get_rank()
