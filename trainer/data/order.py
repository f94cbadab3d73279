"""Sample order: which sample comes at global sample index g, as a pure function of (seed, g).

Pretraining at scale resumes on a different number of ranks (elastic resume, a lost node, a bigger
allocation), so the order must not depend on the world size, and it must not need replay: the
position to save is one integer, the global sample index, and any rank can jump straight to it.
Every lookup here is O(1) in time and memory in the number of samples; nothing materializes a
permutation of all samples, so 10^10 samples cost the same as 10^3.

- `permutation(positions, n, seed, epoch)`: a keyed Feistel network over the smallest power of 4 that
  holds n, cycle-walked into [0, n) - a bijection, evaluated only where asked.
- `locate(g, n, seed)`: global index -> sample; epoch g // n is a full permutation, no dropped tail.
- `Mixture`: global index -> (source, index in that source's own stream), with exact proportions.

Ranks then take their share of global indices (e.g. g = step * global_batch + rank_offset + i); this
module never sees ranks.
"""
from __future__ import annotations

import hashlib
import math
import numbers
from functools import lru_cache

import numpy as np

from .records import DataError


# Luby-Rackoff needs 4 rounds for a strong PRP on wide halves; on tiny domains (n < ~100, halves of a
# few bits) 4 rounds leave orders visibly non-uniform, 6 fix most of it for ~15% more time.
ROUNDS = 6

MAX_N = 2 ** 62                # both halves and the round function stay inside uint64

_C1 = np.uint64(0xBF58476D1CE4E5B9)  # splitmix64 finalizer multipliers: full avalanche on uint64
_C2 = np.uint64(0x94D049BB133111EB)


# ------------------------------------------------------------------------------------- permutation


@lru_cache(maxsize=4096)
def _round_keys(seed: int, epoch: int) -> np.ndarray:
    # blake2b, not hash(): Python salts str hashing per process, and every rank must agree.
    digest = hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=8 * ROUNDS,
                             person=b"trainer.order").digest()
    keys = np.frombuffer(digest, dtype="<u8").astype(np.uint64)
    keys.setflags(write=False)  # cached and shared: nobody may change it
    return keys


def _half_bits(n: int) -> int:
    # Half width of the smallest even-bit domain >= n: domain 4**k < 4 * n, so cycle-walking
    # takes under 4 passes on average.
    return max(1, (max(n - 1, 1).bit_length() + 1) // 2)


def _round(right: np.ndarray, key: np.ndarray | np.uint64, mask: np.uint64) -> np.ndarray:
    x = right ^ key
    x *= _C1
    x ^= x >> np.uint64(31)
    x *= _C2
    x ^= x >> np.uint64(29)
    x &= mask
    return x


def _encrypt(x: np.ndarray, keys: np.ndarray, half: int) -> np.ndarray:
    """One pass of the Feistel network over [0, 4**half); keys is (ROUNDS,) or (len(x), ROUNDS)."""
    shift, mask = np.uint64(half), np.uint64((1 << half) - 1)
    left, right = x >> shift, x & mask
    for r in range(ROUNDS):
        left ^= _round(right, keys[..., r], mask)
        left, right = right, left
    return (left << shift) | right


def _permute(pos: np.ndarray, n: int, keys: np.ndarray) -> np.ndarray:
    if n == 1:
        return np.zeros(pos.shape, dtype=np.int64)
    half = _half_bits(n)
    x = _encrypt(pos.astype(np.uint64).ravel(), keys, half)
    # Cycle-walking: re-encrypt values that fell outside [0, n). Each walk follows the cycle of the
    # bijection on the domain, so the first value back inside [0, n) is unique - still a bijection.
    todo = np.flatnonzero(x >= n)
    while todo.size:
        sub_keys = keys if keys.ndim == 1 else keys[todo]
        x[todo] = _encrypt(x[todo], sub_keys, half)
        todo = todo[x[todo] >= n]
    return x.astype(np.int64).reshape(pos.shape)


def _positions(positions: np.ndarray, n: int) -> np.ndarray:
    n = _check_n(n)
    pos = np.asarray(positions)
    if pos.dtype.kind not in "iu":
        raise ValueError(f"positions must be integers, got dtype {pos.dtype}")
    pos = pos.astype(np.int64)
    if pos.size and (pos.min() < 0 or pos.max() >= n):
        raise ValueError(f"positions must lie in [0, {n}); got values in [{pos.min()}, {pos.max()}]")
    return pos


def _check_n(n: int) -> int:
    n = int(n)
    if not 1 <= n <= MAX_N:
        raise ValueError(f"n must be in [1, 2**62], got {n}")
    return n


def permutation(positions: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """The keyed pseudo-random bijection of [0, n) for (seed, epoch), evaluated at `positions`.

    Vectorized; O(1) memory in n. Same arguments give the same result in any process or machine.
    """
    pos = _positions(positions, n)
    if int(epoch) < 0:
        raise ValueError(f"epoch must be >= 0, got {epoch}")
    return _permute(pos, int(n), _round_keys(int(seed), int(epoch)))


def order(positions: np.ndarray, n: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """`permutation` when shuffling, else the positions themselves (the identity order)."""
    if not shuffle:
        return _positions(positions, n)
    return permutation(positions, n, seed, epoch)


# ------------------------------------------------------------------------------- global index


def _global(global_index: np.ndarray) -> np.ndarray:
    g = np.asarray(global_index)
    if g.dtype.kind not in "iu":
        raise ValueError(f"global indices must be integers, got dtype {g.dtype}")
    g = g.astype(np.int64)
    if g.size and g.min() < 0:
        raise ValueError(f"global indices must be >= 0, got {g.min()}")
    return g


def locate(global_index: np.ndarray, n: int, seed: int, shuffle: bool = True) -> np.ndarray:
    """The sample at each global index: epoch g // n, position g % n, permuted for that epoch.

    Every epoch visits each of the n samples exactly once; nothing is dropped at an epoch's end.
    """
    n = _check_n(n)
    g = _global(global_index)
    epoch, pos = np.divmod(g, n)
    if not shuffle or g.size == 0:
        return pos
    first, last = int(epoch.min()), int(epoch.max())
    if last - first < 64:
        # The usual case: a batch within one epoch or across a boundary. One pass per epoch with
        # scalar keys is much faster than gathering a key row per element.
        out = np.empty_like(pos)
        for e in range(first, last + 1):
            here = epoch == e
            out[here] = _permute(pos[here], n, _round_keys(int(seed), e))
        return out
    # Many epochs at once (tiny n): one key row per element, still a single vectorized pass.
    epochs, inverse = np.unique(epoch, return_inverse=True)
    table = np.stack([_round_keys(int(seed), int(e)) for e in epochs])
    return _permute(pos, n, table[inverse.ravel()])


# ------------------------------------------------------------------------------------ mixtures


def _check_weights(weights: list[float], names: list[str]) -> np.ndarray:
    if not weights:
        raise DataError("data.sources is empty; list at least one source with a weight > 0")
    if len(names) != len(weights):
        raise DataError(f"data.sources: {len(weights)} weights but {len(names)} names; give each source "
                        f"one name and one weight")
    if len(set(names)) != len(names):
        raise DataError(f"data.sources: names {names} repeat; give each source a distinct name")
    fix = "weights must be >= 0 and sum to more than 0"
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w) or w < 0:
            raise DataError(f"data.sources[{i}].weight = {w!r} is invalid; {fix}")
    total = math.fsum(float(w) for w in weights)
    if not total > 0:
        raise DataError(f"data.sources[0].weight: all weights are 0 ({list(weights)}); {fix}")
    return np.asarray(weights, dtype=np.float64) / total


def _interleave(w: np.ndarray, period: int) -> tuple[np.ndarray, np.ndarray]:
    """(source_of, rank_in_period) for one period: sample k of source d at ideal time (k + 0.5) / w_d."""
    # Every sample with time < horizon is generated; there are >= horizon - D/2 >= period of them,
    # so the first `period` after the merge are exactly the first `period` of the infinite schedule.
    horizon = period + len(w) + 1
    counts = [int(math.ceil(horizon * wd)) if wd > 0 else 0 for wd in w]
    source = np.repeat(np.arange(len(w)), counts)
    rank = np.concatenate([np.arange(c, dtype=np.int64) for c in counts])
    times = (rank + 0.5) / w[source]  # w[source] > 0: weight-0 sources generate nothing
    # Stable: equal times keep concatenation order, i.e. the lower source index goes first.
    first = np.argsort(times, kind="stable")[:period]
    dtype = np.uint8 if len(w) <= 256 else np.uint16
    return source[first].astype(dtype), rank[first].astype(np.uint32)


class Mixture:
    """Global sample index -> (source, index within that source's own stream), for weighted sources.

    Within one period of P global samples, source d's k-th sample sits at ideal time (k + 0.5) / w_d
    (w normalized) and all sources are merged by that time, so over any prefix each source's count is
    within about one sample per period of its exact share. The schedule repeats every period.

    The seed rotates the schedule: global index g reads period slot (g + offset) mod P, with offset
    derived from the seed by blake2b (stable everywhere). Different seeds thus give different
    interleavings while the proportions stay exact. Rotation only moves the phase: with simple weights
    the schedule has a short sub-period (10 slots for [0.7, 0.2, 0.1], 2 for [1, 1]), and seeds whose
    offsets differ by a multiple of it give the same order. Each source's own stream is shuffled
    separately (e.g. with `locate`), so this only decides which source comes when.

    Within-source indices count 0, 1, 2, ... over g = 0, 1, 2, ... for every source, with no gaps or
    duplicates, whatever the offset.
    """

    def __init__(self, weights: list[float], names: list[str], seed: int, period: int = 2 ** 20):
        if int(period) < 1 or int(period) >= 2 ** 32:
            raise ValueError(f"period must be in [1, 2**32), got {period}")
        self.names, self.seed, self.period = list(names), int(seed), int(period)
        self.weights = _check_weights(list(weights), self.names)
        self.source_of, self.rank_in_period = _interleave(self.weights, self.period)
        self.per_period = np.bincount(self.source_of, minlength=len(self.weights)).astype(np.int64)
        self._check_all_sampled()
        self.offset = self._offset(self.seed, self.period)
        # Samples of each source in slots [0, offset) of period 0 are never visited (g starts at
        # offset); subtracting them makes every source's stream start at index 0.
        self._skipped = np.bincount(self.source_of[:self.offset], minlength=len(self.weights)).astype(np.int64)

    @staticmethod
    def _offset(seed: int, period: int) -> int:
        digest = hashlib.blake2b(str(seed).encode(), digest_size=8, person=b"trainer.mixture").digest()
        return int.from_bytes(digest, "little") % period

    def _check_all_sampled(self) -> None:
        # A weight below ~1/(2P) of the total rounds to zero samples per period: refuse rather than
        # silently drop a source the user asked for.
        for i, wd in enumerate(self.weights):
            if wd > 0 and self.per_period[i] == 0:
                raise DataError(f"data.sources[{i}].weight is {wd:.3g} of the total, too small to be "
                                f"sampled once in a period of {self.period} samples; raise it, set it to 0, "
                                f"or use a longer period")

    def locate(self, global_index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source index, index within that source's stream) at each global index; O(1) each."""
        g = _global(global_index)
        q, p = np.divmod(g + self.offset, self.period)
        source = self.source_of[p]
        within = q * self.per_period[source] + self.rank_in_period[p].astype(np.int64) - self._skipped[source]
        return source.astype(np.int64), within

    def counts(self, n_samples: int) -> np.ndarray:
        """How many of global samples [0, n_samples) each source gives; O(P), not O(n_samples)."""
        if int(n_samples) < 0:
            raise ValueError(f"n_samples must be >= 0, got {n_samples}")
        full, rest = divmod(int(n_samples), self.period)
        # The remainder covers slots offset .. offset + rest - 1, wrapping past the period's end.
        slots = (self.offset + np.arange(rest)) % self.period
        tail = np.bincount(self.source_of[slots], minlength=len(self.weights))
        return full * self.per_period + tail

    def proportions(self, n_samples: int) -> dict[str, float]:
        """The realised share of each source over global samples [0, n_samples)."""
        if int(n_samples) < 1:
            raise ValueError(f"n_samples must be >= 1, got {n_samples}")
        counts = self.counts(n_samples)
        return {name: float(c) / int(n_samples) for name, c in zip(self.names, counts)}
