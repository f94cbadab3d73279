"""One complete state dict from a checkpoint of this trainer, whatever its layout.

  ZeRO-1/2/3            DeepSpeed's own `zero_to_fp32` (the fp32 master weights, merged over the ranks)
  ZeRO-0                the module weights in mp_rank_00_model_states.pt
  AutoTP x ZeRO-0/1/2   each tensor-parallel rank's slice (its model states, or zero_to_fp32 on that rank's files),
                        concatenated along the dimension AutoTP split; which dimension is read off the shapes:
                        the slice is the full shape but along one axis
  AutoTP x ZeRO-3       refused with the way out (the HF export): ZeRO-3 partitions the slices again
  AutoEP (expert_parallel)  refused with the way out (the HF export): each rank saved its own experts under
                        DeepSpeed's AutoEP names, which zero_to_fp32 refuses and transformers does not know

The checkpoint is verified first (train/integrity.py: manifest, no pickled code) on every rank, because
DeepSpeed's loaders use torch.load(weights_only=False).
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from .. import ds as dsc
from ..distributed import comm_device
from ..errors import UserError
from ..train import checkpoint, integrity


def consolidated_state_dict(path: Path, ds: dict, expected: dict[str, tuple],
                            verified: bool = False) -> dict[str, torch.Tensor]:
    """Full tensors by parameter name; `expected` is the architecture's name -> full shape. `verified`: the caller
    verified `path` already (infer/source.py does, before it reads the tokenizer)."""
    if not verified:
        checkpoint.verify(path, comm_device())
    if dsc.autoep_size(ds) > 1 or dsc.expert_parallel(ds).get("enabled"):
        raise UserError(f"--model {path}: a checkpoint of an expert-parallel run (DeepSpeed AutoEP), whose experts "
                        f"each rank saved under AutoEP's own names (DeepSpeed 0.19.8's zero_to_fp32 refuses it); use "
                        f"the run's HF export (its hf/ directory: every expert gathered into transformers' layout), "
                        f"or resume the checkpoint with the same autoep_size and export")
    tp = max(_tp_ranks(path), 1)
    if tp == 1:
        return _one_slice(path, dsc.zero_stage(ds))
    if dsc.zero_stage(ds) == 3:
        # ZeRO-3 partitions AutoTP's slices again, over every rank, and zero_to_fp32 (0.19.8) cannot undo both
        raise UserError(f"--model {path}: an AutoTP x ZeRO-3 checkpoint, which DeepSpeed 0.19.8's zero_to_fp32 "
                        f"cannot consolidate; use the run's HF export (its hf/ directory, gathered by the engine "
                        f"itself at the end of training), or resume the checkpoint on its own layout and export")
    root = Path(tempfile.mkdtemp(prefix="tp_views_"))
    try:
        slices = [_one_slice(view, dsc.zero_stage(ds)) for view in _tp_views(path, tp, root)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {name: merge_slices(name, [s[name] for s in slices], expected.get(name)) for name in slices[0]}


def _tp_ranks(path: Path) -> int:
    ranks = {int(m.group(1)) for f in os.listdir(path) if (m := re.search(r"mp_rank_(\d+)_model_states\.pt$", f))}
    return len(ranks)


def _one_slice(path: Path, stage: int) -> dict[str, torch.Tensor]:
    if stage == 0 or not list(path.glob("*optim_states.pt")):
        model_file = path / "mp_rank_00_model_states.pt"
        with torch.serialization.safe_globals(integrity.deepspeed_state_classes()):
            states = torch.load(model_file, map_location="cpu", weights_only=True)
        return {k: v for k, v in states["module"].items()}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    return get_fp32_state_dict_from_zero_checkpoint(str(path.parent), tag=path.name)


def _tp_views(path: Path, tp: int, root: Path) -> list[Path]:
    """For each tensor-parallel rank t, a directory (under `root`) of links to that rank's files, named as rank
    0's (mp_rank_0t -> mp_rank_00), which is what DeepSpeed's single-slice loaders look for."""
    views = []
    for t in range(tp):
        view = root / f"tp{t}" / path.name
        view.mkdir(parents=True)
        suffix = f"mp_rank_{t:02d}_"
        for name in os.listdir(path):
            if suffix in name:
                os.symlink(path / name, view / name.replace(suffix, "mp_rank_00_"))
        views.append(view)
    return views


def merge_slices(name: str, slices: list[torch.Tensor], full: tuple | None) -> torch.Tensor:
    """The tensor-parallel slices of one tensor as the full tensor: replicated tensors are taken once, split ones
    are concatenated along the one axis where the slices are narrower than the full shape."""
    first = slices[0]
    if full is None or tuple(first.shape) == tuple(full):
        return first
    axes = [d for d in range(first.dim()) if first.shape[d] != full[d]]
    if len(axes) != 1 or sum(s.shape[axes[0]] for s in slices) != full[axes[0]]:
        raise UserError(f"{name}: tensor-parallel slices {[tuple(s.shape) for s in slices]} do not make its full "
                        f"shape {tuple(full)}; the checkpoint is not of this architecture")
    return torch.cat(slices, dim=axes[0])
