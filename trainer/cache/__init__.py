"""One cache layer for everything the trainer computes once and reads again: prepared data (trainer/data/prepare.py)
and the DPO reference log-probs (trainer/train/reference_logps.py), and any later cache.

    <data.cache_dir>/<kind>/<key>/          one entry: a directory filled once (entries.fill), then only read

- keys.py      the key: a digest of every input in order, as named (name, value) pairs: source content together
               with the name it is read under, the model's weights identity, the tokenizer, the task settings;
- contents.py  files by content (SHA-256), remembered by stat, so a source or a model is hashed once;
- weights.py   a model's identity: settings, and its weights and code (local files, or the hub commit and blobs);
- entries.py   the rules every entry follows: filled through an exclusive temporary sibling, no links, this user's
               and not writable by every user, arrays checked for dtype, shape and finite values with the file named.
"""
from __future__ import annotations

from .errors import CacheError

__all__ = ["CacheError"]
