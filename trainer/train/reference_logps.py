"""Precomputed reference log-probs (preference.reference=precomputed): one pass of the reference model over every
pair of the prepared data before training, stored in the data cache beside the prepared data and keyed by what
decides them (the prepared data's manifest, the reference model's fingerprint, seq_len), so the reference costs
nothing during training, a resume or a second run reads them again, and another reference or other data gets its
own file.

    <data.cache_dir>/reference-logps/<key>/<source>-<split>.npy     float64 (pairs, 2): chosen, rejected

The pass is collective (every rank runs the same number of forwards, as ZeRO-3 needs); rank 0 writes each file
atomically; the samples then carry the values (trainer/data/samples.py PreferenceSamples.reference).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from .. import ranks
from .preference import sequence_logps

FOLDER = "reference-logps"


def model_fingerprint(cfg) -> dict:
    """What decides the reference's weights: its files' names, sizes and SHA-256s (pretrained), or the inline
    architecture with the init seed and std (from scratch)."""
    from ..data.fingerprint import sha256_file
    path = cfg.model.name_or_path
    if not path:
        model = {k: v for k, v in vars(cfg.model).items() if k not in ("lora", "gradient_checkpointing", "liger")}
        return {"inline": json.dumps(model, sort_keys=True, default=str), "seed": cfg.train.seed}
    root = Path(path).expanduser()
    if not root.is_dir():
        return {"hub": path}  # a hub id names its revision's files (resolved the same way by every rank)
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".safetensors", ".bin", ".json"))
    return {"files": [[str(p.relative_to(root)), p.stat().st_size, sha256_file(p)] for p in files]}


def store_dir(cfg, manifests: list[dict]) -> Path:
    from ..data.prepare import cache_dir
    key = {"data": [m.get("identity") or m["splits"] for m in manifests], "model": model_fingerprint(cfg),
           "seq_len": cfg.data.seq_len, "precision": cfg.train.precision}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]
    return cache_dir(cfg.data) / FOLDER / digest


def attach(streams: dict[str, object], directory: Path, reference: Callable, micro: int, device) -> list[str]:
    """Give every PreferenceSamples of `streams` ({"<source>-<split>": samples}) its reference log-probs: read from
    `directory`, or computed now (collectively) and written there. Returns what was computed."""
    computed = []
    for name, samples in streams.items():
        path = directory / f"{name}.npy"
        exists = torch.tensor([float(path.is_file())], device=device)
        if dist.is_initialized():  # every rank decides the same (a forward under ZeRO-3 is collective)
            dist.all_reduce(exists, op=dist.ReduceOp.MIN)
        if not bool(exists.item()):
            values = compute(samples, reference, micro, device)
            if ranks.rank() == 0:
                write_npy(path, values)
            ranks.barrier()
            computed.append(name)
        samples.reference = np.load(path)
        if samples.reference.shape != (len(samples), 2):
            raise RuntimeError(f"{path}: holds {samples.reference.shape} values for {len(samples)} pairs; delete it "
                               f"(it is recomputed)")
    return computed


@torch.no_grad()
def compute(samples, reference: Callable, micro: int, device) -> np.ndarray:
    """(pairs, 2) summed response log-probs under `reference`; the pairs are dealt to the ranks in rounds of
    micro x world size, and every rank runs every round (a rank past the end runs a filler pair)."""
    world, rank = ranks.world_size(), ranks.rank()
    total, per_round = len(samples), micro * world
    out = np.zeros((total, 2), dtype=np.float64)
    for first in range(0, total, per_round):
        ids = np.arange(first + rank * micro, first + (rank + 1) * micro) % total  # wrap: fillers repeat pairs
        batch = {k: torch.from_numpy(v).to(device) for k, v in samples.rows(ids).items() if k != "reference_logps"}
        ids_, mask, labels = (batch[k].flatten(0, 1) for k in ("input_ids", "attention_mask", "labels"))
        mine = sequence_logps(reference(ids_, mask), labels)[0].double().view(-1, 2)
        every = [torch.zeros_like(mine) for _ in range(world)]
        if dist.is_initialized():
            dist.all_gather(every, mine)
        else:
            every = [mine]
        for r, values in enumerate(every):
            start = first + r * micro
            take = max(0, min(micro, total - start))
            out[start:start + take] = values[:take].cpu().numpy()
    return out


def write_npy(path: Path, values: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as handle:
        np.save(handle, values)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
