"""Precomputed reference log-probs (preference.reference=precomputed): one pass of the reference model over every
pair of the prepared data before training, stored in the cache layer (trainer/cache) so the reference costs nothing
during training, and a resume or a second run reads them again.

    <data.cache_dir>/reference-logps/<key>/values.npy     float64 (pairs, 2): chosen, rejected
    <data.cache_dir>/reference-logps/<key>/inputs.json    the inputs the key is the digest of

One entry per split of each source, keyed by content alone: the split's token bytes (the SHA-256 of every shard
file, which verification checked against the bytes before this run started), the tokenizer, the model's identity
(its forward settings and its weights and code: local files by content, a hub model by commit and blobs;
trainer/cache/weights.py) and the settings that shape a sample. A source's *name* is not an input: two runs that
give the same data under swapped names read the values of the data each name holds, and a hub ref that moves to
other weights, an edited weight file or a code file is another key.

The pass is collective (every rank runs the same number of forwards, as ZeRO-3 needs); rank 0 fills each entry (a
fresh temporary sibling renamed into place); every rank reads it back with the cache's rules (no links, owner and
mode, dtype, shape and finite values, the file named) and the same error is raised on every rank.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from .. import ranks
from ..cache import entries, keys
from ..cache.errors import CacheError
from ..cache.weights import model_identity
from ..distributed import gather_text, rank0_only, shared_problems
from .preference import sequence_logps

KIND = "reference-logps"
VALUES = "values.npy"


def identity_of_model(cfg, cache: Path) -> dict:
    """The reference's identity, found by rank 0 alone and shared: the weights are hashed once (and the hashes
    recorded, so the next start reads no weight file), and every rank keys its entries alike even where another
    node's hub cache or file system would answer otherwise."""
    found = {}
    rank0_only(lambda: found.update(identity=model_identity(cfg.model, cfg.train.seed, cache)))
    return json.loads(gather_text(json.dumps(found.get("identity"), sort_keys=True))[0])


def split_inputs(manifest: dict, split: str, model: dict, cfg, pad_id: int) -> list[tuple[str, object]]:
    """Every input that decides one split's reference log-probs, in order."""
    info = manifest["splits"][split]
    data = {"task": manifest["task"], "dtype": manifest["dtype"], "tokenizer": manifest["tokenizer"]["fingerprint"],
            "shards": [[int(e["tokens"]), int(e["documents"]), {kind: f["sha256"] for kind, f in
                                                                sorted(e["files"].items())}] for e in info["shards"]]}
    return [("kind", KIND), ("data", data), ("model", model),
            ("samples", {"seq_len": cfg.data.seq_len, "pad_id": pad_id, "precision": cfg.train.precision})]


def attach(streams: dict[str, tuple[object, list]], cache: Path, reference: Callable, micro: int, device,
           trust_others: bool = False) -> list[str]:
    """Give every PreferenceSamples of `streams` ({"<source>-<split>": (samples, inputs)}) its reference log-probs:
    read from its cache entry, or computed now (collectively) and cached. Returns the names computed."""
    computed = []
    for name, (samples, inputs) in streams.items():
        entry = cache / KIND / keys.digest(inputs)
        if not on_every_rank(os.path.lexists(entry), device):  # every rank decides the same: forwards are collective
            values = compute(samples, reference, micro, device)
            rank0_only(lambda: entries.fill(entry, lambda tmp: write_entry(tmp, values, keys.canonical(inputs))))
            computed.append(name)
        samples.reference = read_entry(entry, keys.canonical(inputs), len(samples), trust_others)
    return computed


def on_every_rank(flag: bool, device) -> bool:
    value = torch.tensor([float(flag)], device=device)
    if dist.is_initialized():
        dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def write_entry(directory: Path, values: np.ndarray, canonical_inputs: str) -> None:
    entries.write_array(directory / VALUES, values)
    entries.record_inputs(directory, canonical_inputs)


def read_entry(entry: Path, canonical_inputs: str, pairs: int, trust_others: bool) -> np.ndarray:
    """The entry's values, checked by the cache's rules on every rank; any rank's problem is every rank's error."""
    values, problems = None, entries.entry_problems(entry, trust_others)
    if not problems:
        problems = entries.inputs_problems(entry, canonical_inputs, trust_others)
    if not problems:
        try:
            values = entries.read_array(entry / VALUES, np.float64, (pairs, 2), trust_others)
        except CacheError as err:
            problems = [str(err)]
    problems = shared_problems(problems)
    if problems:
        listed = "\n".join(f"  - {p}" for p in problems)
        raise CacheError(f"the cached reference log-probs {entry} cannot be used:\n{listed}\ndelete {entry} (it is "
                         f"computed again by the next run), or use a data.cache_dir of your own")
    return values


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
