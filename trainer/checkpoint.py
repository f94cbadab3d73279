"""Checkpoints that survive crashes, exact resume, retention, and the final HF-format export.

Layout of `<output_dir>/checkpoints/`:
    latest                    text file with the newest *complete* tag (replaced atomically)
    step_00000100/            DeepSpeed's files for that step, plus
        trainer_state.json    step, consumed samples, data position, resolved config (JSON, not pickle)
        rng_rank{r}.json      python/numpy/torch RNG states of rank r
        COMPLETE              written last, after every rank finished and the files were flushed

A save goes to `step_N.partial/`, is fsynced by every rank, renamed to `step_N/` by rank 0 and only
then named in `latest`. A crash (even kill -9) in the middle leaves the previous checkpoint as latest.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from .errors import UserError

COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.json"


@dataclass
class TrainState:
    """What the loop needs, besides the engine's own state, to continue exactly."""
    step: int = 0                       # optimizer steps done
    consumed_samples: int = 0           # sequences seen across data-parallel ranks
    data: dict = field(default_factory=dict)   # MicroBatchLoader.state_dict()
    bad_steps: int = 0                  # non-finite steps skipped so far


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _fsync_tree(path: Path) -> None:
    for file in sorted(path.rglob("*")):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
    _fsync_dir(path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json_atomic(path: Path, payload) -> None:
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
    _fsync_dir(path.parent)


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

def save(engine, ckpt_dir: Path, state: TrainState, config: dict, keep_last: int,
         protect: Optional[str] = None, faults=None) -> Path:
    """Save a complete checkpoint of `state.step` on every rank; returns its directory."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    tag = tag_for(state.step)
    partial_tag = f"{tag}.partial"
    final = ckpt_dir / tag
    if rank == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(ckpt_dir / partial_tag, ignore_errors=True)  # debris of a crashed save
    _barrier()
    engine.save_checkpoint(str(ckpt_dir), tag=partial_tag, client_state={}, save_latest=False)
    partial = ckpt_dir / partial_tag
    _write_json_atomic(partial / f"rng_rank{rank}.json", rng_state())
    if rank == 0:
        _write_json_atomic(partial / STATE_FILE, {"trainer": asdict(state), "config": config})
    if faults is not None:
        faults.kill_if("kill_in_save", state.step, rank)  # tests: a rank dies with the files half written
    _barrier()
    _fsync_tree(partial)  # every rank flushes what is visible to it before the switch
    _barrier()
    if rank == 0:
        if final.exists():  # a checkpoint of the same step from an earlier attempt
            shutil.rmtree(final)
        os.rename(partial, final)
        (final / COMPLETE).write_text(tag + "\n")
        _fsync_dir(final)
        _fsync_dir(ckpt_dir)
        _write_text_atomic(ckpt_dir / "latest", tag)
        prune(ckpt_dir, keep_last, protect)
    _barrier()
    return final


def complete_checkpoints(ckpt_dir: Path) -> list[Path]:
    """Complete checkpoint directories, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.glob("step_*") if p.is_dir() and (p / COMPLETE).exists()]
    return sorted(found, key=lambda p: p.name)


def prune(ckpt_dir: Path, keep_last: int, protect: Optional[str] = None) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints; never the newest or `protect` (the
    checkpoint this run resumed from, until a newer one exists)."""
    complete = complete_checkpoints(ckpt_dir)
    keep = {p.name for p in complete[-keep_last:]}
    if protect:
        keep.add(Path(protect).name)
    removed = [p for p in complete if p.name not in keep]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


# --- resume --------------------------------------------------------------------------------------

def find_resume(resume: Optional[str], ckpt_dir: Path) -> Optional[Path]:
    """The checkpoint directory to resume from: None (fresh run), 'auto' (newest complete in this run's
    checkpoints/, or fresh if none), or an explicit checkpoint directory."""
    if not resume:
        return None
    if resume == "auto":
        latest = ckpt_dir / "latest"
        if latest.exists():
            candidate = ckpt_dir / latest.read_text().strip()
            if (candidate / COMPLETE).exists():
                return candidate
        complete = complete_checkpoints(ckpt_dir)
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


def _deepspeed_state_classes() -> list:
    """The classes DeepSpeed 0.19.8 pickles into its checkpoints besides tensors and containers."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def vet_pickles(path: Path, rank: int) -> None:
    """DeepSpeed loads its checkpoint files with torch.load(weights_only=False): a crafted file would run
    code. So each rank first opens the files it will read with weights_only=True (mmap: tensor data is not
    read), allowing only DeepSpeed's own state classes; anything else is refused with a clear error."""
    files = [f for f in sorted(path.glob("*.pt")) if f.name.startswith("mp_rank_") or f"pp_rank_{rank}_" in f.name]
    with torch.serialization.safe_globals(_deepspeed_state_classes()):
        for file in files:
            try:
                torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            except Exception as err:  # torch raises UnpicklingError/RuntimeError naming the offending global
                found = re.search(r"GLOBAL ([\w.]+)", str(err))
                reason = f"Unsupported global {found.group(1)}" if found else str(err).splitlines()[0]
                raise UserError(f"refusing to load {file}: it holds objects a weights-only load does not allow "
                                f"({reason[:300]}). Only load checkpoints you trust.") from None


def load(engine, path: Path) -> TrainState:
    """Restore engine (weights, optimizer, scheduler), trainer state and this rank's RNG state."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    state, _ = read_trainer_state(path)
    vet_pickles(path, rank)
    loaded, _ = engine.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=True,
                                       load_lr_scheduler_states=True)
    if loaded is None:
        raise UserError(f"DeepSpeed could not load the checkpoint at {path}")
    rng_file = path / f"rng_rank{rank}.json"
    if rng_file.exists():
        set_rng_state(json.loads(rng_file.read_text()))
    return state


# --- HF export -----------------------------------------------------------------------------------

def export_hf(engine, tokenizer, out_dir: Path) -> Optional[Path]:
    """Write the trained model in HF format (safetensors) on rank 0; gathered from ZeRO-3 / AutoTP shards.
    Must be called on every rank (the gather is collective). LoRA runs export the adapter."""
    from .model import unwrap
    rank = dist.get_rank() if dist.is_initialized() else 0
    state_dict = _full_state_dict(engine)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        model = unwrap(engine)
        model.save_pretrained(str(out_dir), state_dict=state_dict)
        tokenizer.save_pretrained(str(out_dir))
        verify_export(out_dir, state_dict)
    _barrier()
    return out_dir if rank == 0 else None


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
    rank = dist.get_rank() if dist.is_initialized() else 0
    if engine.zero_optimization_stage() == 3 or engine.autotp_size() > 1:
        return engine._consolidated_16bit_state_dict()  # collective; gathers ZeRO-3 and AutoTP shards
    if rank != 0:
        return None
    return {k: v.detach().cpu() for k, v in engine.module.state_dict().items()}
