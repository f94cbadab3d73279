"""A cache entry's name is the digest of every input that decides its bytes, in order: a list of (name, value)
pairs, each value plain JSON. Pairs rather than a dict so that an input's *role* is part of the key (the same
content named train in one run and eval in another is two inputs), and nested values are written with sorted
keys so that a mapping's order never changes a key while a list's order always does (sources in order, each
name beside its own content).
"""
from __future__ import annotations

import hashlib
import json
from typing import Any, Sequence

DIGITS = 20  # 80 bits: a collision needs ~10^12 entries


def canonical(inputs: Sequence[tuple[str, Any]]) -> str:
    """The JSON text the key is the hash of (recorded in an entry beside what it holds)."""
    names = [name for name, _ in inputs]
    if len(set(names)) != len(names):
        raise ValueError(f"a cache key's inputs are named twice: {names}")
    return json.dumps([[name, value] for name, value in inputs], sort_keys=True, allow_nan=False,
                      separators=(",", ":"))


def digest(inputs: Sequence[tuple[str, Any]]) -> str:
    return hashlib.sha256(canonical(inputs).encode()).hexdigest()[:DIGITS]
