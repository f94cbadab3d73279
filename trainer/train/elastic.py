"""Resuming on another topology: a checkpoint of N ranks continued on M, or at another ZeRO stage.

A checkpoint records the layout it was saved with (its trainer_state.json keeps the resolved config, whose
`derived` block names world size, data-parallel size, AutoTP size and ZeRO stage). When the run resuming it has
another layout, DeepSpeed's own files cannot be loaded as they are (ZeRO partitions the optimizer state by
data-parallel rank), so the checkpoint is converted once with DeepSpeed's `ds_to_universal` into
`step_N/universal/` and loaded with `checkpoint.load_universal`:

    step_00000100/                 the original, untouched (its manifest does not list universal/)
        universal.tmp/             a conversion in progress (rank 0 alone; removed when one starts again)
        universal/                 the finished conversion, renamed from universal.tmp/ when whole
            COMPLETE               its own manifest, written last: a later resume reuses it after checking it
            latest_universal       written by ds_to_universal
            step_00000100/         DeepSpeed's universal layout (zero/<param>/fp32.pt, exp_avg.pt, ...)

Living inside the checkpoint it came from, the conversion is pruned, set aside and found with it. The global
batch of the checkpoint is kept: the accumulation steps are recomputed for the new data-parallel size.
"""
from __future__ import annotations

import argparse
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from .. import ds as dsc
from .. import ranks
from ..errors import UserError
from . import integrity
from .checkpoint import COMPLETE, UNIVERSAL, fsync_dir, fsync_tree, write_json_atomic


MODEL_STATES = "mp_rank_00_model_states.pt"             # ZeRO-0/1/2: one file of module + client state
ZERO3_MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"  # ZeRO-3: rank 0's


class ElasticResumeError(UserError):
    """A checkpoint that cannot be continued on this topology, with what to do instead."""


@dataclass(frozen=True)
class Layout:
    world_size: int
    data_parallel_size: int
    autotp_size: int
    zero_stage: int
    sequence_parallel_size: int = 1  # a checkpoint from before sequence parallelism recorded none: 1
    expert_parallel_size: int = 1    # AutoEP; a checkpoint from before it recorded none: 1

    def describe(self) -> str:
        tp = f", AutoTP {self.autotp_size}" if self.autotp_size > 1 else ""
        sp = f", sequence-parallel {self.sequence_parallel_size}" if self.sequence_parallel_size > 1 else ""
        ep = f", expert-parallel {self.expert_parallel_size}" if self.expert_parallel_size > 1 else ""
        return (f"{self.world_size} rank(s) (data-parallel {self.data_parallel_size}{tp}{sp}{ep}), "
                f"ZeRO-{self.zero_stage}")


def saved_layout(saved_config: dict) -> Optional[Layout]:
    """The layout a checkpoint's trainer state recorded (None for a state without one)."""
    derived = saved_config.get("derived") or {}
    try:
        return Layout(int(derived["world_size"]), int(derived["data_parallel_size"]),
                      max(int(derived.get("autotp_size", 1)), 1), int(derived["zero_stage"]),
                      max(int(derived.get("sequence_parallel_size", 1)), 1),
                      max(int(derived.get("expert_parallel_size", 1)), 1))
    except (KeyError, TypeError, ValueError):
        return None


def current_layout(resolved) -> Layout:
    summary = resolved.summary()
    return Layout(resolved.world_size, summary["data_parallel_size"], max(summary["autotp_size"], 1),
                  summary["zero_stage"], summary["sequence_parallel_size"], summary["expert_parallel_size"])


def needs_universal(saved: Optional[Layout], now: Layout, path: Path) -> bool:
    """Whether `path` must be converted to load under `now`; a layout no conversion can bridge is an error."""
    if saved is None or saved == now:
        return False
    change = f"checkpoint {path} was saved on {saved.describe()}; this run is {now.describe()}"
    if saved.expert_parallel_size > 1 or now.expert_parallel_size > 1:
        raise _unsupported(change, "an expert-parallel run", "AutoEP",
                           "its checkpoint holds each rank's own experts under DeepSpeed's AutoEP names, which this "
                           "trainer's universal conversion does not verify",
                           f"deepspeed.expert_parallel.autoep_size={saved.expert_parallel_size}", saved.world_size)
    if saved.zero_stage == 0 and now.zero_stage == 0 and saved.autotp_size == now.autotp_size == 1:
        return False  # ZeRO-0 keeps the whole optimizer state in one file: it loads on any number of ranks
    if saved.autotp_size > 1 or now.autotp_size > 1:
        raise _unsupported(change, "an AutoTP run", "AutoTP",
                           "DeepSpeed 0.19.8's universal conversion of AutoTP checkpoints is partial and this trainer "
                           "does not verify it", f"deepspeed.tensor_parallel.autotp_size={saved.autotp_size}",
                           saved.world_size)
    if saved.sequence_parallel_size > 1 or now.sequence_parallel_size > 1:
        raise ElasticResumeError(
            f"{change}: resuming a sequence-parallel run on another layout (or switching sequence parallelism on or "
            f"off) is not supported: DeepSpeed 0.19.8 records the Ulysses group as tensor-parallel degree "
            f"{max(saved.sequence_parallel_size, now.sequence_parallel_size)} in the checkpoint, and its universal "
            f"conversion then refuses it ('model-state file count 1 does not match ... tp_degree'); resume with "
            f"deepspeed.sequence_parallel_size={saved.sequence_parallel_size} on {saved.world_size} rank(s), or "
            f"export the weights (train.export_hf) and start a new run from them")
    if saved.zero_stage == 0:
        raise ElasticResumeError(
            f"{change}: a ZeRO-0 checkpoint has no ZeRO optimizer partitions for DeepSpeed's universal conversion to "
            f"read; resume it at ZeRO-0 (--set deepspeed.zero_optimization.stage=0), on any number of ranks")
    if now.zero_stage == 0:
        raise ElasticResumeError(
            f"{change}: DeepSpeed 0.19.8 loads universal checkpoints only into a ZeRO optimizer (at ZeRO-0 the "
            f"weights would not be restored); resume at ZeRO-1, 2 or 3 (--set deepspeed.zero_optimization.stage="
            f"{saved.zero_stage})")
    return True


def _unsupported(change: str, run: str, feature: str, why: str, resume_with: str, world: int) -> ElasticResumeError:
    return ElasticResumeError(
        f"{change}: resuming {run} on another layout (or switching {feature} on or off) is not supported: {why}; "
        f"resume with {resume_with} on {world} rank(s), or export the weights (python -m trainer export / "
        f"train.export_hf) and start a new run from them")


# --- the global batch -----------------------------------------------------------------------------------

def batch_overrides(saved_config: dict, resolved, explicit: set[str], path: Path) -> tuple[list[str], Optional[str]]:
    """(`--set` items that keep the checkpoint's global batch on this topology, a notice), both empty when the
    batch is already the same. The accumulation is recomputed unless this invocation sets one other than the
    checkpoint's (`explicit`: the keys its --set items name); a global batch no accumulation keeps is an error."""
    saved_train, batch = saved_config.get("train") or {}, resolved.batch
    saved_global = saved_train.get("global_batch_size")
    if not isinstance(saved_global, int) or saved_global == batch.global_batch_size:
        return [], None
    if "train.global_batch_size" in explicit:
        return [], (f"the global batch changes from the checkpoint's {saved_global} to {batch.global_batch_size} "
                    f"sequences per step, as train.global_batch_size asks")
    micro, dp = batch.micro_batch_size, batch.data_parallel_size
    per_step = micro * dp
    why = (f"checkpoint {path} was trained with a global batch of {saved_global} sequences (micro-batch "
           f"{saved_train.get('micro_batch_size')} x accumulation {saved_train.get('grad_accum')} x data-parallel "
           f"{(saved_config.get('derived') or {}).get('data_parallel_size')})")
    if saved_global % per_step:
        fits = [m for m in range(1, micro + 1) if saved_global % (m * dp) == 0]
        raise ElasticResumeError(
            f"{why}; on data-parallel size {dp} with train.micro_batch_size={micro} no whole number of accumulation "
            f"steps gives {saved_global} ({saved_global} is not a multiple of {micro} x {dp} = {per_step}): set "
            + (f"train.micro_batch_size={fits[-1]} to keep it, or " if fits else "")
            + f"train.global_batch_size={batch.global_batch_size} to continue with another global batch on purpose")
    accum = saved_global // per_step
    named = "train.grad_accum" in explicit or "deepspeed.gradient_accumulation_steps" in explicit
    if named and batch.grad_accum != saved_train.get("grad_accum"):  # a new accumulation asked for on purpose
        raise ElasticResumeError(
            f"{why}; the train.grad_accum={batch.grad_accum} this invocation sets makes it {batch.global_batch_size}: "
            f"drop that setting (the accumulation is then recomputed to {accum}, keeping {saved_global}), or also set "
            f"train.global_batch_size={batch.global_batch_size} to change the global batch on purpose")
    notice = (f"global batch {saved_global} kept from the checkpoint: gradient accumulation {batch.grad_accum} -> "
              f"{accum} for data-parallel size {dp} x micro-batch {micro}")
    return dsc.global_batch_overrides(accum, saved_global), notice


# --- conversion ------------------------------------------------------------------------------------------

def universal_copy(path: Path, device, saved: Layout, now: Layout) -> Path:
    """Collective. The universal conversion of checkpoint `path` (made by rank 0 when there is no complete one;
    the others wait), checked against its manifest on every rank. Returns the folder to load from."""
    out = path / UNIVERSAL
    rank = ranks.rank()
    if rank == 0:
        if (out / COMPLETE).is_file():
            print(f"resume: {saved.describe()} -> {now.describe()}: reusing the universal conversion in {out}",
                  flush=True)
        else:
            print(f"resume: {saved.describe()} -> {now.describe()}: converting {path.name} to a DeepSpeed universal "
                  f"checkpoint in {out} (deepspeed.checkpoint.ds_to_universal; the original is kept)", flush=True)
            _convert(path, out)
    ranks.barrier()  # the others wait for rank 0's conversion (raise train.dist_timeout_s for very large models)
    try:
        integrity.verify_checkpoint(out, device)
    except integrity.CheckpointError as err:
        raise integrity.CheckpointError(f"{err}; remove {out} and resume again: it is converted anew from the "
                                        f"original") from None
    return out


def _convert(path: Path, out: Path) -> None:
    """Rank 0: convert into universal.tmp/, make the file names the loading stage looks for, fsync, write the
    manifest, then rename to universal/. A crash leaves only universal.tmp/, which the next attempt replaces."""
    from deepspeed.checkpoint import ds_to_universal
    tmp = path / f"{UNIVERSAL}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
    except OSError as err:
        raise ElasticResumeError(f"cannot convert checkpoint {path}: {err.strerror} writing {tmp}; copy the "
                                 f"checkpoint to a writable directory and resume that copy with --resume") from None
    target = tmp / path.name
    args = argparse.Namespace(input_folder=str(path), output_folder=str(target), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    ds_to_universal.main(args)  # single worker: no process pool under a launched rank
    _link_model_states(target)
    _bridge_optimizer_state(target / "zero" / "optimizer_state.pt")
    fsync_tree(tmp)
    write_json_atomic(tmp / COMPLETE, integrity.local_manifest(tmp, path.name))  # last: the conversion is whole
    fsync_dir(tmp)
    if out.exists():  # a conversion without COMPLETE: debris
        shutil.rmtree(out)
    os.rename(tmp, out)
    fsync_dir(path)


def _link_model_states(folder: Path) -> None:
    """DeepSpeed reads the engine's client state from `mp_rank_00_model_states.pt` at ZeRO-1/2 and from
    `zero_pp_rank_0_mp_rank_00_model_states.pt` at ZeRO-3; the converter keeps only the saving stage's name.
    Both names, one file (a hard link): a ZeRO-2 checkpoint then loads at ZeRO-3 and back."""
    for have, want in ((MODEL_STATES, ZERO3_MODEL_STATES), (ZERO3_MODEL_STATES, MODEL_STATES)):
        if (folder / have).is_file() and not (folder / want).exists():
            try:
                os.link(folder / have, folder / want)
            except OSError:
                shutil.copy2(folder / have, folder / want)



def _bridge_optimizer_state(file: Path) -> None:
    """The converter writes the optimizer's global state in the saving stage's shape, and DeepSpeed 0.19.8 reads
    it in the loading stage's: ZeRO-3 takes Adam's step from `optimizer_state_dict.state[0].step` (a ZeRO-2
    conversion lacks it: KeyError), ZeRO-1/2 require `ds_version` (a ZeRO-3 conversion lacks it). Fill in
    whichever is missing, from the conversion itself (every parameter's step.pt holds the same step)."""
    import deepspeed
    import torch
    from deepspeed.checkpoint import constants
    state = torch.load(file, map_location="cpu", weights_only=False)  # just written from a vetted checkpoint
    if constants.OPTIMIZER_STATE_DICT not in state:
        step_file = next(file.parent.glob("*/step.pt"), None)
        step = torch.load(step_file, map_location="cpu", weights_only=True) if step_file else None
        state[constants.OPTIMIZER_STATE_DICT] = {"state": {0: {"step": step}},
                                                 "param_groups": state[constants.PARAM_GROUPS]}
    state.setdefault(constants.DS_VERSION, deepspeed.__version__)
    torch.save(state, file)

# --- the whole decision ------------------------------------------------------------------------------------

def adapt(resolved, path: Optional[Path], explicit: set[str], device, reresolve) -> tuple[object, Optional[Path]]:
    """Collective. (the config for this run, the universal folder to load or None) for resuming `path` (None: a
    fresh run) on this topology. `reresolve(extra_overrides)` resolves the run again with `--set` items added."""
    from .checkpoint import read_trainer_state
    if path is None:
        return resolved, None
    _, saved_config = read_trainer_state(path)
    overrides, notice = batch_overrides(saved_config, resolved, explicit, path)
    if overrides:
        resolved = reresolve(overrides)
    if notice and ranks.rank() == 0:
        print(f"notice: {notice}", flush=True)
    saved, now = saved_layout(saved_config), current_layout(resolved)
    if not needs_universal(saved, now, path):
        if saved is not None and saved != now and ranks.rank() == 0:
            print(f"resume: {saved.describe()} -> {now.describe()}: ZeRO-0 loads as saved, no conversion", flush=True)
        return resolved, None
    return resolved, universal_copy(path, device, saved, now)
