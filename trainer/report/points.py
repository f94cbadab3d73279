"""What `report` keeps of a run while it streams the file: a bounded number of points and marks per run, whatever
the run's length, so that memory and drawing time do not grow with the file.

`Series`: one metric's points by step. While its steps fit in MAX_BUCKETS buckets of one step each, every point
is kept as logged; past that the bucket width doubles (as often as needed) and each bucket keeps its first and
last point, its lowest and highest value and one non-finite point (the gap it makes in the line): a spike, a
dip and a NaN stay visible at any length, in at most 5 points a bucket. A panel is ~700 pixels wide, so 2,000
buckets still give every pixel column more than one.

`Marks`: steps marked by vertical lines (resumes, skipped steps): each distinct step while there are at most
MAX_MARKS, else merged into at most MAX_MARKS ranges of steps, each knowing how many marks it holds; more
lines than that would cover the panel and say nothing the count does not.
"""
from __future__ import annotations

import math
from typing import Optional


MAX_BUCKETS = 2000
REDUCE_AT = 20 * MAX_BUCKETS   # points held before they are reduced (a reduction keeps at most 5 a bucket)
MAX_MARKS = 40
MAX_DRAWN = 1e300              # matplotlib's tick maths overflows on an axis near float's limit (1.8e308)


class Series:
    """One metric's points; add them in any order of steps. Points are appended as they come (the cheap part of a
    million-line read) and reduced in numpy every REDUCE_AT points, and before they are read."""

    def __init__(self) -> None:
        self.shift = 0                    # a bucket is 2**shift steps wide
        self._steps: list[int] = []       # the reduced points, then the ones added since
        self._values: list[float] = []
        self._reduced = 0                 # how many of them are reduced (and counted below)
        self._counted = 0                 # points added before the last reduction
        self._nonfinite = 0               # of them: NaN or infinite
        self._huge = 0                    # finite but beyond +-MAX_DRAWN

    def add(self, step: int, value: float) -> None:
        self._steps.append(step)
        self._values.append(value)
        if len(self._steps) >= REDUCE_AT:
            self._reduce()

    def _reduce(self) -> None:
        if self._reduced == len(self._steps):
            return
        import numpy as np
        steps, values = np.array(self._steps, dtype=np.int64), np.array(self._values, dtype=np.float64)
        fresh = values[self._reduced:]
        finite = np.isfinite(fresh)
        self._counted += len(fresh)
        self._nonfinite += int(np.count_nonzero(~finite))
        self._huge += int(np.count_nonzero(np.abs(fresh[finite]) > MAX_DRAWN))
        order = np.argsort(steps, kind="stable")
        steps, values = steps[order], values[order]
        while True:
            keys = steps >> self.shift
            starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
            if len(starts) <= MAX_BUCKETS:
                break
            self.shift += 1
        picked = _bucket_points(keys, values, starts)
        self._steps, self._values = steps[picked].tolist(), values[picked].tolist()
        self._reduced = len(self._steps)

    @property
    def count(self) -> int:
        """Points added."""
        return self._counted + len(self._steps) - self._reduced

    @property
    def undrawable(self) -> tuple[int, int]:
        """(non-finite, finite but beyond +-MAX_DRAWN) points among those added."""
        self._reduce()
        return self._nonfinite, self._huge

    @property
    def steps(self) -> list[int]:
        self._reduce()
        return self._steps

    @property
    def values(self) -> list[float]:
        self._reduce()
        return self._values

    @property
    def last(self) -> Optional[float]:
        """The value at the highest step."""
        return self.values[-1] if self.values else None

    @property
    def last_step(self) -> int:
        return self.steps[-1] if self.steps else 0

    @property
    def peak(self) -> Optional[float]:
        """The highest finite value (each bucket keeps its highest)."""
        return max((v for v in self.values if math.isfinite(v)), default=None)

    @property
    def downsampled(self) -> bool:
        return self.shift > 0


def _bucket_points(keys, values, starts):
    """Indices (sorted) of the points each bucket keeps: first, last, lowest, highest, first non-finite. `keys`
    (bucket of each point) is sorted; `starts` are the buckets' first indices."""
    import numpy as np
    bucket = np.repeat(np.arange(len(starts)), np.diff(np.r_[starts, len(keys)]))
    finite = np.isfinite(values)
    low = np.lexsort((np.where(finite, values, np.inf), bucket))[starts]
    high = np.lexsort((-np.where(finite, values, -np.inf), bucket))[starts]
    gap = np.lexsort((finite, bucket))[starts]
    ends = np.r_[starts[1:], len(keys)] - 1
    return np.unique(np.concatenate([starts, ends, low[finite[low]], high[finite[high]], gap[~finite[gap]]]))


class Marks:
    """Steps to mark; add them in any order."""

    def __init__(self) -> None:
        self.width = 1
        self.ranges_by_key: dict[int, list[int]] = {}   # step // width -> [first step, last step, marks]
        self.count = 0

    def add(self, step: int) -> None:
        self.count += 1
        key = step // self.width
        held = self.ranges_by_key.get(key)
        if held is None:
            self.ranges_by_key[key] = [step, step, 1]
            if len(self.ranges_by_key) > MAX_MARKS:
                self._coarsen()
        else:
            held[0], held[1], held[2] = min(held[0], step), max(held[1], step), held[2] + 1

    def _coarsen(self) -> None:
        while len(self.ranges_by_key) > MAX_MARKS:
            self.width *= 2
            merged: dict[int, list[int]] = {}
            for key, (first, last, marks) in self.ranges_by_key.items():
                into = merged.setdefault(key // 2, [first, last, 0])
                into[0], into[1], into[2] = min(into[0], first), max(into[1], last), into[2] + marks
            self.ranges_by_key = merged

    def ranges(self) -> list[tuple[int, int, int]]:
        """(first step, last step, marks) of each drawn mark, by step."""
        return [tuple(self.ranges_by_key[key]) for key in sorted(self.ranges_by_key)]

    def steps(self) -> list[int]:
        """The marked steps, each once (the first step of a merged range)."""
        return [first for first, _, _ in self.ranges()]

    @property
    def merged(self) -> bool:
        return self.width > 1

    def __bool__(self) -> bool:
        return self.count > 0
