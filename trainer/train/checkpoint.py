"""Checkpoints that survive crashes, exact resume, retention, and the final HF-format export.

Layout of `<output_dir>/checkpoints/`:
    latest                    text file with the newest *complete* tag (replaced atomically)
    step_00000100/            DeepSpeed's files for that step, plus
        trainer_state.json    step, consumed samples, data position, resolved config (JSON, not pickle)
        rng_rank{r}.json      python/numpy/torch RNG states of rank r, and its open log window
        COMPLETE              written last, after every rank finished and the files were flushed: the manifest
                              (every file's size and SHA-256), checked before any rank loads anything
    abandoned/<time>/         checkpoints of a history this run left (it resumed an older one): kept, never pruned

A save goes to `step_N.partial/`, is fsynced by every rank, renamed to `step_N/` by rank 0 and only
then named in `latest`. A crash (even kill -9) in the middle leaves the previous checkpoint as latest.
Each trainer_state.json names its parent checkpoint, so retention follows the run's actual history.
"""
from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from .. import ranks
from ..errors import UserError
from ..files import modes_as_umask_allows
from . import integrity
from .hooks import Hooks


COMPLETE = "COMPLETE"
UNIVERSAL = "universal"  # step_N/universal/: its conversion for another topology (trainer/train/elastic.py)
STATE_FILE = "trainer_state.json"
EXPORT_INFO = "trainer_export.json"  # in an HF export: the step it was written at


@dataclass
class TrainState:
    """What the loop needs, besides the engine's own state, to continue exactly."""
    step: int = 0                       # optimizer steps done
    consumed_samples: int = 0           # sequences seen across data-parallel ranks
    data: dict = field(default_factory=dict)   # MicroBatchLoader.state_dict(): {"samples": global samples consumed}
    bad_steps: int = 0                  # non-finite steps skipped so far
    log_window: list = field(default_factory=lambda: [0.0, 0])  # this rank's loss sum and steps since the last
                                        # scheduled log line (kept per rank in rng_rank*.json): the first line
                                        # after a resume averages the same steps as an uninterrupted run
    parent: Optional[str] = None        # the checkpoint this state continues: its tag in the same checkpoints/
                                        # directory, or its path; None for a fresh start (the run's history)
    wandb_run_id: Optional[str] = None  # the wandb run this history logs to: a resume continues (rewinds) it
    objective: Optional[dict] = None    # this rank's objective state (GRPO: the sampler's generator and the current
                                        # rollout), kept per rank in rng_rank*.json, not in trainer_state.json


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def fsync_tree(path: Path) -> None:
    for file in sorted(path.rglob("*")):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
    fsync_dir(path)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, payload) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as handle:
        json.dump(payload, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


# --- RNG state as JSON ---------------------------------------------------------------------------

def rng_state() -> dict:
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state()
    state = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_name, np_keys.tolist(), int(np_pos), int(np_has_gauss), float(np_cached)],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict) -> None:
    version, py_state, gauss = state["python"]
    random.setstate((version, tuple(py_state), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


# --- save ----------------------------------------------------------------------------------------

class NonFiniteWeights(UserError):
    """The weights hold inf/NaN: such a state is never marked COMPLETE."""


def save(engine, ckpt_dir: Path, state: TrainState, config: dict, keep_last: int,
         protect: Optional[str] = None, checksums: bool = True, hooks: Optional[Hooks] = None) -> Path:
    """Save a complete checkpoint of `state.step` on every rank; returns its directory.

    `state.parent` names the checkpoint this state continues (the previous save, or the resumed one): it
    is the run's history, which retention follows. Checkpoints of other histories (a branch abandoned by
    resuming an older checkpoint) are set aside in `abandoned/`, never deleted."""
    rank, hooks = ranks.rank(), hooks or Hooks()
    tag = tag_for(state.step)
    bad = integrity.nonfinite_weights(engine)
    if bad:
        listed = ", ".join(f"{name} ({count:,})" for name, count in list(bad.items())[:4])
        raise NonFiniteWeights(f"not saving step {state.step}: the weights hold inf/NaN values ({listed}); "
                               f"a checkpoint of them could not be resumed")
    partial_tag = f"{tag}.partial"
    final, partial = ckpt_dir / tag, ckpt_dir / partial_tag
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # debris of a crashed save
    ranks.barrier()
    from . import checkpoint_io
    writer = checkpoint_io.install(engine, checksums)  # hashes as it writes (None: another writer was chosen)
    with _naming_a_full_disk(ckpt_dir, tag):
        engine.save_checkpoint(str(ckpt_dir), tag=partial_tag, client_state=universal_info(engine), save_latest=False)
        wait_for_writer(engine)
        written = checkpoint_io.relative_entries(writer.take_written(), partial) if writer else {}
        own = {"objective": state.objective} if state.objective is not None else {}
        write_json_atomic(partial / f"rng_rank{rank}.json", {**rng_state(), "log_window": state.log_window, **own})
        if rank == 0:
            shared = {k: v for k, v in asdict(state).items() if k != "objective"}
            write_json_atomic(partial / STATE_FILE, {"trainer": shared, "config": config})
        hooks.in_save("files_written", state.step)
        ranks.barrier()
        fsync_tree(partial)  # every rank flushes what is visible to it before the switch (the writer's files: done)
        manifest = integrity.build_manifest(partial, tag, checksums, engine.device, written)  # collective
        if rank == 0:
            _commit(ckpt_dir, partial, final, manifest, state.parent,
                    before_latest=lambda: hooks.in_save("before_latest", state.step))
            prune(ckpt_dir, keep_last, protect, newest=tag)
    ranks.barrier()
    return final


def wait_for_writer(engine) -> None:
    """A decoupled checkpoint writer (train.checkpoint_writer=decoupled) returns from save_checkpoint while its
    process still writes; DeepSpeed commits it at the next step. Commit now: nothing is fsynced, hashed or called
    COMPLETE before every byte of this save is written."""
    writer = engine.checkpoint_engine
    if writer.is_decoupled() and writer.get_commit_info() is not None:
        writer.commit(writer.get_commit_info())  # waits for the writer process (DeepSpeed: 300 s, then raises)


def universal_info(engine) -> dict:
    """What DeepSpeed's ds_to_universal converter requires in a checkpoint to convert it (for resuming on
    another world size). An AutoEP engine writes its own (with its expert patterns) and refuses a client's."""
    from deepspeed.checkpoint import constants

    from .expert_export import autoep_layers
    if autoep_layers(engine.module):
        return {}
    return {constants.UNIVERSAL_CHECKPOINT_INFO: {
        constants.UNIVERSAL_CHECKPOINT_VERSION_KEY: constants.UNIVERSAL_CHECKPOINT_VERSION_VALUE}}


def _commit(ckpt_dir: Path, partial: Path, final: Path, manifest: dict, parent: Optional[str],
            before_latest=None) -> None:
    """Rank 0: set other histories aside, rename, write COMPLETE (the manifest), then point `latest`."""
    set_aside_other_branches(ckpt_dir, parent)
    if final.exists():  # an incomplete directory of the same step from an earlier, crashed attempt
        shutil.rmtree(final)
    os.rename(partial, final)
    write_json_atomic(final / COMPLETE, manifest)
    fsync_dir(final)
    fsync_dir(ckpt_dir)
    if before_latest:
        before_latest()  # a hook point: a crash here must leave a checkpoint `--resume auto` finds
    _write_text_atomic(ckpt_dir / "latest", final.name)


@contextmanager
def _naming_a_full_disk(ckpt_dir: Path, tag: str):
    """torch/DeepSpeed report a full disk as 'basic_ios::clear: iostream error' or 'PytorchStreamWriter
    failed writing file': say what happened and where."""
    try:
        yield
    except (OSError, RuntimeError) as err:
        free = shutil.disk_usage(ckpt_dir).free if ckpt_dir.exists() else None
        full = getattr(err, "errno", None) == errno.ENOSPC or (free is not None and free < 64 << 20)
        if not full:
            raise
        shutil.rmtree(ckpt_dir / f"{tag}.partial", ignore_errors=True)  # give the space back
        previous = find_resume("auto", ckpt_dir)
        raise UserError(f"no space left on {ckpt_dir} ({free / 2**20:.1f} MiB free) while saving {tag}; its "
                        f"partial files were removed. "
                        + (f"The last complete checkpoint, {previous}, is intact. " if previous else "")
                        + "Free space (or lower train.keep_last, or point train.output_dir at a larger disk) and "
                        "resume with --resume auto") from None


# --- history: which checkpoints belong to this run -----------------------------------------------

def parent_name(path: Optional[Path], ckpt_dir: Path) -> Optional[str]:
    """How a checkpoint records its parent: the tag when it lives in this run's checkpoints/, else its path."""
    if path is None:
        return None
    return path.name if path.parent.resolve() == ckpt_dir.resolve() else str(path)


def lineage(ckpt_dir: Path, parent: Optional[str]) -> list[str]:
    """Tags of the ancestors in `ckpt_dir`, newest first, following each checkpoint's recorded parent."""
    chain: list[str] = []
    while parent and "/" not in parent and parent not in chain and (ckpt_dir / parent / STATE_FILE).is_file():
        chain.append(parent)
        parent = _recorded_parent(ckpt_dir / parent)
    return chain


def set_aside_other_branches(ckpt_dir: Path, parent: Optional[str]) -> list[Path]:
    """Move complete checkpoints that are not `parent` or its ancestors to `abandoned/<time>/`: they belong
    to a history this run left (it resumed an older checkpoint, or started fresh in the same directory)."""
    ancestors = set(lineage(ckpt_dir, parent))
    others = [p for p in complete_checkpoints(ckpt_dir) if p.name not in ancestors]
    if not others:
        return []
    shelf = ckpt_dir / "abandoned" / time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    shelf.mkdir(parents=True, exist_ok=True)
    for path in others:
        os.rename(path, shelf / path.name)
    fsync_dir(ckpt_dir)
    since = f"from {parent}" if parent else "from scratch"
    print(f"checkpoints: {', '.join(p.name for p in others)} belong to another history than this run (which "
          f"continues {since}); set aside in {shelf} -- nothing was deleted; remove them when no longer needed",
          flush=True)
    return [shelf / path.name for path in others]


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoint directories, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.glob("step_*") if p.is_dir() and (p / COMPLETE).exists()]
    return sorted(found, key=lambda p: p.name)


def prune(ckpt_dir: Path, keep_last: int, protect: Optional[str] = None, newest: Optional[str] = None) -> list[Path]:
    """Keep the newest `keep_last` checkpoints of this run's history (`newest` and its ancestors); never
    `newest` itself or `protect` (the checkpoint this run resumed from, until a newer one exists).
    Without `newest`, the history is the one `latest` names."""
    newest = newest or _latest_tag(ckpt_dir)
    if newest is None:
        return []
    history = [newest] + lineage(ckpt_dir, _recorded_parent(ckpt_dir / newest))
    keep = set(history[:max(keep_last, 1)])
    if protect:
        keep.add(Path(protect).name)
    removed = [ckpt_dir / tag for tag in history if tag not in keep and (ckpt_dir / tag / COMPLETE).exists()]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def _latest_tag(ckpt_dir: Path) -> Optional[str]:
    latest = ckpt_dir / "latest"
    return latest.read_text().strip() if latest.is_file() else None


def _recorded_parent(path: Path) -> Optional[str]:
    try:
        return json.loads((path / STATE_FILE).read_text())["trainer"].get("parent")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


# --- resume --------------------------------------------------------------------------------------

def find_resume(resume: Optional[str], ckpt_dir: Path) -> Optional[Path]:
    """The checkpoint directory to resume from: None (fresh run), 'auto', or an explicit checkpoint directory.

    'auto' takes the newest complete checkpoint of the history `latest` names: `latest` itself, or a newer
    complete descendant of it (a crash between writing COMPLETE and replacing `latest` loses nothing). When
    `latest` is missing or names no complete checkpoint, the newest complete one; None when there is none."""
    if not resume:
        return None
    if resume == "auto":
        complete = complete_checkpoints(ckpt_dir)
        latest = _latest_tag(ckpt_dir)
        if latest and (ckpt_dir / latest / COMPLETE).exists():
            descendants = [p for p in complete if p.name > latest and latest in lineage(ckpt_dir, _recorded_parent(p))]
            return descendants[-1] if descendants else ckpt_dir / latest
        return complete[-1] if complete else None
    path = Path(resume)
    if (path / "latest").exists() and not (path / COMPLETE).exists():  # a checkpoints/ directory
        path = path / (path / "latest").read_text().strip()
    if not (path / COMPLETE).exists() or not (path / STATE_FILE).exists():
        raise UserError(f"train.resume={resume!r} is not a complete checkpoint: expected a directory with "
                        f"{STATE_FILE} and {COMPLETE} (e.g. <output_dir>/checkpoints/step_00000100), "
                        f"or use --resume auto")
    return path


def read_trainer_state(path: Path) -> tuple[TrainState, dict]:
    try:
        payload = json.loads((path / STATE_FILE).read_text())
        return TrainState(**payload["trainer"]), payload["config"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise UserError(f"{path / STATE_FILE} is not a trainer state this version can read ({err!r}); "
                        f"resume from another checkpoint or start fresh with --resume off") from None


def check_same_model(saved_config: dict, current_model: dict, path: Path) -> None:
    """A checkpoint of another architecture fails early with the differing fields named."""
    keys = ("name_or_path", "family", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
            "intermediate_size", "vocab_size", "tie_word_embeddings")
    saved = saved_config.get("model", {})
    diffs = [f"model.{k}: checkpoint {saved.get(k)!r} vs config {current_model.get(k)!r}"
             for k in keys if saved.get(k) != current_model.get(k)]
    if diffs:
        raise UserError(f"checkpoint {path} was trained with a different model shape: " + "; ".join(diffs))


def _is_rng_file(name: str) -> bool:
    return re.fullmatch(r"rng_rank\d+\.json", name) is not None


def _is_conversion(name: str) -> bool:
    """Files of a universal conversion (finished or interrupted): checked by its own manifest when loaded."""
    return name.split("/", 1)[0] in (UNIVERSAL, f"{UNIVERSAL}.tmp")


def verify(path: Path, device) -> None:
    """Collective, before any rank loads anything: every file matches the manifest and no file holds
    pickled code (see trainer.integrity). A damaged checkpoint names the one to resume instead."""
    try:
        warnings = integrity.verify_checkpoint(path, device, optional=_is_rng_file, elsewhere=_is_conversion)
    except integrity.CheckpointError as err:
        previous = _previous_complete(path)
        hint = (f"; the previous complete checkpoint is {previous}: resume it with --resume {previous}" if previous
                else "; no earlier complete checkpoint exists: start fresh with --resume off")
        raise integrity.CheckpointError(f"{err}{hint}") from None
    rank = ranks.rank()
    for warning in warnings:
        if rank == 0:
            print(f"warning: {path}: {warning}: those ranks start with fresh RNG states, so dropout and other "
                  f"runtime randomness differ from an uninterrupted run", flush=True)


def _previous_complete(path: Path) -> Optional[Path]:
    ancestors = [path.parent / tag for tag in lineage(path.parent, _recorded_parent(path))]
    older = [p for p in complete_checkpoints(path.parent) if p.name < path.name]
    candidates = [p for p in ancestors if (p / COMPLETE).exists()] or older[::-1]
    return candidates[0] if candidates else None


def load(engine, path: Path, ckpt_dir: Path, deepspeed_dir: Optional[Path] = None) -> TrainState:
    """Restore engine (weights, optimizer, scheduler), trainer state and this rank's RNG state; the state's
    parent is `path` as this run's `ckpt_dir` records it. `verify` must have passed on every rank first.
    `deepspeed_dir`: where DeepSpeed's files of `path` are when not in it (its universal conversion)."""
    from . import checkpoint_io
    rank = ranks.rank()
    state, _ = read_trainer_state(path)
    reader = checkpoint_io.install(engine)  # maps the files, weights-only
    try:
        with reader.loading(engine) if reader else nullcontext():  # then no tensor keeps a file of it mapped
            loaded, _ = engine.load_checkpoint(str(deepspeed_dir or path.parent), tag=path.name,
                                               load_optimizer_states=True, load_lr_scheduler_states=True)
    except FileNotFoundError as err:  # a checkpoint from before manifests, missing one of DeepSpeed's files
        previous = _previous_complete(path)
        raise integrity.CheckpointError(
            f"checkpoint {path} is incomplete: {Path(err.filename or str(err)).name} is missing"
            + (f"; resume the previous complete checkpoint with --resume {previous}" if previous else "")) from None
    if loaded is None:
        raise UserError(f"DeepSpeed could not load the checkpoint at {path}")
    rng_file = path / f"rng_rank{rank}.json"
    if rng_file.exists():
        rank_state = json.loads(rng_file.read_text())
        set_rng_state(rank_state)
        state.log_window = rank_state.get("log_window", state.log_window)  # each rank logs its own losses
        state.objective = rank_state.get("objective")  # GRPO: this rank's sampler and rollout
    state.parent = parent_name(path, ckpt_dir)
    return state


# --- HF export -----------------------------------------------------------------------------------

def export_hf(engine, tokenizer, out_dir: Path, step: int, merged_dir: Optional[Path] = None) -> Optional[Path]:
    """Write the trained model in HF format (safetensors) on rank 0; gathered from ZeRO-3 / AutoTP shards.
    Must be called on every rank (the gather is collective). LoRA runs export the adapter, and with `merged_dir`
    also base + adapter merged into one model. The export records its step (trainer_export.json)."""
    from ..model import unwrap
    rank = ranks.rank()
    state_dict = _full_state_dict(engine)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        model = unwrap(engine)
        from . import expert_export
        if expert_export.autoep_layers(model):
            model = expert_export.transformers_model(model, state_dict)
        with for_serving(model, tokenizer):
            model.save_pretrained(str(out_dir), state_dict=state_dict)
        tokenizer.save_pretrained(str(out_dir))
        verify_export(out_dir, state_dict)
        write_json_atomic(out_dir / EXPORT_INFO, {"step": step})
        modes_as_umask_allows(out_dir)
        if merged_dir is not None and (out_dir / "adapter_config.json").is_file():
            export_merged(out_dir, tokenizer, merged_dir, model)
            modes_as_umask_allows(merged_dir)
    ranks.barrier()
    return out_dir if rank == 0 else None


def export_merged(adapter_dir: Path, tokenizer, merged_dir: Path, peft_model) -> None:
    """The LoRA export merged into its base (read back from disk, so the layout of training does not matter)."""
    from ..model import load_lora_merged
    merged = load_lora_merged(str(adapter_dir), next(peft_model.parameters()).dtype)  # base named in the adapter
    with for_serving(merged, tokenizer):
        merged.save_pretrained(str(merged_dir))
    tokenizer.save_pretrained(str(merged_dir))
    verify_export(merged_dir, merged.state_dict())


SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id")


@contextmanager
def for_serving(model, tokenizer):
    """While an export is written: the config and generation config a server and plain transformers read
    (config.json, generation_config.json). Training turns the KV cache off (trainer.model.build_model) and the
    generation config was derived from that training config; an export decodes with the cache on whatever training
    used, and its special tokens are those of the tokenizer shipped beside it (a pad token, so batched generate
    needs no fallback; generation ends on EOS and on the chat template's end of turn). The switches of what a call
    returns are at their defaults (returns_as_default: training's output_router_logits for an MoE's aux loss makes
    batched generate fail in that loss, and hidden states or a dict from generate are no server's business).
    The base model's own generation defaults (sampling settings) are kept. Restored afterwards."""
    from transformers import GenerationConfig

    from ..data.chat_format import stop_token_ids
    from ..model import returns_as_default
    model = model.get_base_model() if hasattr(model, "get_base_model") else model  # inside a PEFT wrapper
    config = model.config
    tokens = {key: value for key in SPECIAL_TOKENS if (value := getattr(tokenizer, key, None)) is not None}
    serving = {"use_cache": True, **returns_as_default(config.to_dict(), type(config)().to_dict()), **tokens}
    before = ({key: getattr(config, key, None) for key in serving}, getattr(model, "generation_config", None))
    generation = before[1].to_dict() if before[1] is not None else {}
    generation = {key: value for key, value in generation.items() if not key.startswith("_")}  # _from_model_config...
    stops = stop_token_ids(tokenizer)
    ends = {"eos_token_id": stops[0] if len(stops) == 1 else stops} if stops else {}
    generation.update({**returns_as_default(generation, GenerationConfig().to_dict()), **tokens, **ends,
                       "use_cache": True})
    try:
        for key, value in serving.items():
            setattr(config, key, value)
        if before[1] is not None or model.can_generate():
            model.generation_config = GenerationConfig(**generation)
        yield
    finally:
        for key, value in before[0].items():
            setattr(config, key, value)
        if before[1] is not None:
            model.generation_config = before[1]


def verify_export(out_dir: Path, state_dict: dict) -> None:
    """Read the written safetensors headers back and check no tensor is empty or differs in shape from the
    model's. The classic ZeRO-3 failure is an export of empty (partitioned) tensors found only at inference."""
    from safetensors import safe_open
    written = {}
    for file in sorted(out_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            written.update({key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()})
    if not written:
        raise RuntimeError(f"HF export to {out_dir} wrote no safetensors files")
    expected = {key: tuple(tensor.shape) for key, tensor in state_dict.items()}
    wrong = [f"{key} {shape} (model: {expected.get(key)})" for key, shape in written.items()
             if 0 in shape or (key in expected and expected[key] != shape)]
    if wrong:
        raise RuntimeError(f"HF export to {out_dir} is incomplete: {', '.join(wrong[:5])}; a ZeRO-3/AutoTP model "
                           f"must be gathered before saving")


def _full_state_dict(engine) -> Optional[dict]:
    """Every parameter complete, on CPU, on rank 0 (None elsewhere)."""
    from . import expert_export
    rank = ranks.rank()
    if expert_export.autoep_layers(engine.module):  # DeepSpeed's consolidation refuses AutoEP under ZeRO-3
        return expert_export.hf_state_dict(engine.module, engine.zero_optimization_stage() == 3)
    if engine.zero_optimization_stage() == 3 or engine.autotp_size() > 1:
        return engine._consolidated_16bit_state_dict()  # collective; gathers ZeRO-3 and AutoTP shards
    if rank != 0:
        return None
    return {k: v.detach().cpu() for k, v in engine.module.state_dict().items()}
