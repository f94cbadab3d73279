"""The sample-order layer: bijective, deterministic, world-size free permutations and exact mixtures."""
from __future__ import annotations

import numpy as np
import pytest

from trainer.data.order import Mixture, locate, order, permutation
from trainer.data.records import DataError


SIZES = (1, 2, 3, 7, 64, 1000, 65537, 200003)


def _full(n: int, seed: int = 0, epoch: int = 0) -> np.ndarray:
    return permutation(np.arange(n, dtype=np.int64), n, seed, epoch)


# ------------------------------------------------------------------------------------- permutation


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("epoch", (0, 1, 5))
def test_permutation_is_a_bijection(n, epoch):
    out = _full(n, seed=17, epoch=epoch)
    assert out.dtype == np.int64 and out.shape == (n,)
    assert np.array_equal(np.sort(out), np.arange(n))


@pytest.mark.parametrize("n", [s for s in SIZES if s >= 64])
def test_epochs_and_seeds_change_the_order(n):
    base = _full(n, seed=3, epoch=0)
    assert not np.array_equal(base, _full(n, seed=3, epoch=1))
    assert not np.array_equal(base, _full(n, seed=4, epoch=0))
    assert not np.array_equal(base, np.arange(n))


@pytest.mark.parametrize("n", (7, 1000, 200003))
def test_permutation_is_deterministic_and_pointwise(n):
    full = _full(n, seed=9, epoch=2)
    assert np.array_equal(full, _full(n, seed=9, epoch=2))
    # Any subset, in any shape, reads the same values as the full evaluation: no hidden state.
    picks = np.array([[n - 1, 0], [n // 2, n // 3]], dtype=np.int64)
    assert np.array_equal(permutation(picks, n, 9, 2), full[picks])


def test_permutation_edge_cases():
    assert np.array_equal(permutation(np.zeros(3, dtype=np.int64), 1, 0, 0), np.zeros(3))
    for bad_n in (0, -5):
        with pytest.raises(ValueError):
            permutation(np.array([0]), bad_n, 0, 0)
    for bad_pos in ([-1], [10], [0.5]):
        with pytest.raises(ValueError):
            permutation(np.array(bad_pos), 10, 0, 0)


def test_order_without_shuffle_is_the_identity():
    pos = np.array([5, 0, 3], dtype=np.int64)
    assert np.array_equal(order(pos, 10, 1, 2, shuffle=False), pos)
    assert np.array_equal(order(pos, 10, 1, 2, shuffle=True), permutation(pos, 10, 1, 2))


def test_permutation_mixes_large_domains():
    # Far from the identity and from a rotation: neighbours land far apart.
    n = 10 ** 8
    out = permutation(np.arange(1000, dtype=np.int64), n, 0, 0)
    assert out.min() >= 0 and out.max() < n and len(set(out.tolist())) == 1000
    assert np.median(np.abs(np.diff(out))) > n / 10


# ------------------------------------------------------------------------------- global index


@pytest.mark.parametrize("n", (1, 7, 1000))
@pytest.mark.parametrize("shuffle", (True, False))
def test_locate_visits_every_sample_once_per_epoch(n, shuffle):
    samples = locate(np.arange(3 * n, dtype=np.int64), n, seed=5, shuffle=shuffle)
    for e in range(3):
        assert np.array_equal(np.sort(samples[e * n:(e + 1) * n]), np.arange(n))
    if shuffle and n >= 64:
        assert not np.array_equal(samples[:n], samples[n:2 * n])
    if not shuffle:
        assert np.array_equal(samples, np.arange(3 * n) % n)


def test_locate_over_many_epochs_of_a_tiny_dataset():
    # 200 epochs in one call takes the one-key-row-per-element path.
    n = 3
    samples = locate(np.arange(200 * n, dtype=np.int64), n, seed=2).reshape(200, n)
    for e in (0, 63, 64, 199):
        assert np.array_equal(samples[e], permutation(np.arange(n), n, 2, e))
    assert len({tuple(row) for row in samples.tolist()}) == 6  # every order of 3 shows up


def test_locate_agrees_with_permutation_across_epoch_boundaries():
    n, g = 1000, np.array([0, 999, 1000, 2500, 1, 2999], dtype=np.int64)
    expected = [permutation(np.array([x % n]), n, 8, x // n)[0] for x in g]
    assert locate(g, n, seed=8).tolist() == expected


# ------------------------------------------------------------------------------------ mixtures


def _names(k: int) -> list[str]:
    return [f"s{i}" for i in range(k)]


@pytest.mark.parametrize("weights", ([0.7, 0.2, 0.1], [1, 1], [3, 0, 1]))
def test_mixture_proportions_match_weights(weights):
    mix = Mixture(weights, _names(len(weights)), seed=11)
    share = mix.proportions(10_000)
    total = sum(weights)
    for name, w in zip(_names(len(weights)), weights):
        assert abs(share[name] - w / total) < 0.01
    source, _ = mix.locate(np.arange(10_000, dtype=np.int64))
    counts = np.bincount(source, minlength=len(weights))
    assert [counts[i] / 10_000 for i in range(len(weights))] == list(share.values())
    for i, w in enumerate(weights):
        if w == 0:
            assert counts[i] == 0


def test_mixture_seed_decides_the_interleave():
    g = np.arange(5000, dtype=np.int64)
    a = Mixture([0.7, 0.2, 0.1], _names(3), seed=1).locate(g)
    again = Mixture([0.7, 0.2, 0.1], _names(3), seed=1).locate(g)
    other = Mixture([0.7, 0.2, 0.1], _names(3), seed=2).locate(g)
    assert np.array_equal(a[0], again[0]) and np.array_equal(a[1], again[1])
    assert not np.array_equal(a[0], other[0])


@pytest.mark.parametrize("seed", (0, 1, 2, 3, 123))
@pytest.mark.parametrize("weights", ([0.7, 0.2, 0.1], [1, 1], [3, 0, 1], [0.333, 0.5, 0.167, 0.001]))
def test_mixture_within_source_indices_are_consecutive(weights, seed):
    period = 1000
    mix = Mixture(weights, _names(len(weights)), seed=seed, period=period)
    source, within = mix.locate(np.arange(3 * period + 123, dtype=np.int64))
    for d in range(len(weights)):
        mine = within[source == d]
        assert np.array_equal(mine, np.arange(mine.size)), f"source {d} offset {mix.offset}"


def test_mixture_period_layout():
    mix = Mixture([0.7, 0.2, 0.1], _names(3), seed=0, period=1000)
    assert mix.per_period.tolist() == [700, 200, 100]
    assert mix.source_of.dtype == np.uint8 and mix.rank_in_period.dtype == np.uint32
    for d in range(3):
        assert np.array_equal(mix.rank_in_period[mix.source_of == d], np.arange(mix.per_period[d]))


def test_mixture_locate_is_pointwise():
    mix = Mixture([0.5, 0.3, 0.2], _names(3), seed=4, period=1000)
    g = np.arange(4321, dtype=np.int64)
    source, within = mix.locate(g)
    picks = np.array([4320, 0, 999, 1000, 2001], dtype=np.int64)
    s, w = mix.locate(picks)
    assert np.array_equal(s, source[picks]) and np.array_equal(w, within[picks])


@pytest.mark.parametrize("weights, index, value", [
    ([-1, 2], 0, "-1"),
    ([0, 0], 0, "0"),
    ([float("nan"), 1], 0, "nan"),
    ([1, float("inf")], 1, "inf"),
    ([1, "2"], 1, "'2'"),
])
def test_mixture_rejects_bad_weights(weights, index, value):
    with pytest.raises(DataError) as err:
        Mixture(weights, _names(len(weights)), seed=0)
    message = str(err.value)
    assert f"data.sources[{index}].weight" in message and value in message
    assert "must be >= 0 and sum to more than 0" in message


def test_mixture_rejects_mismatched_or_unsampled_sources():
    with pytest.raises(DataError, match="names"):
        Mixture([1, 1], ["a"], seed=0)
    with pytest.raises(DataError, match="distinct"):
        Mixture([1, 1], ["a", "a"], seed=0)
    with pytest.raises(DataError, match=r"data.sources\[1\].weight"):
        Mixture([1, 1e-6], ["a", "b"], seed=0, period=1000)
