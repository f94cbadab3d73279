"""Every number a user types, read one way: command-line flags (as argparse types) and config fields (the schema's
`doc(..., kind=...)`, checked by trainer.strict) share these kinds.

A kind says what the number means -- a count, a port, a seed, seconds, gigabytes, a fraction -- and so its range:
finite always; an integer where one is meant (written 8, 8.0 or 8e0, but never 8.5 or a float too large to be
exact); within int64 and a range that makes sense for what it counts. Out of range is an error that names the
flag or key, the value and the range, never a traceback further on and never a silent clamp.
"""
from __future__ import annotations

import argparse
import math
import os
import re
from dataclasses import dataclass
from typing import Optional, Union

Number = Union[int, float]

INT64_MAX = (1 << 63) - 1
EXACT = 1 << 53            # floats represent every integer up to here; 1e30 is not the integer the user meant
BIG = (1 << 31) - 1        # counts: steps, batches, tokens per sequence, ranks, nodes
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([KMGT]?)(?:i?B)?\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Kind:
    """What a number means, and so which values are valid."""
    noun: str                        # "a count", "seconds": how the range is described
    integer: bool
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False           # low < x (else low <= x)
    high_open: bool = False          # x < high (else x <= high)

    def describe(self) -> str:
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {_show(self.low)}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {_show(self.high)}")
        what = f"{self.noun}, an integer" if self.integer else self.noun
        return f"{' and '.join(parts)} ({what})"

    def problem(self, value) -> Optional[str]:
        """None when `value` (already a Python number) is valid, else what is wrong with it."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be {self.describe()}"
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be {self.describe()}; {value} is not finite"
        if self.integer and not _is_exact_integer(value):
            whole = isinstance(value, float) and value.is_integer()
            return f"must be {self.describe()}; {_show(value)} is " + (
                "too large to be an exact integer" if whole else "not a whole number")
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return f"must be {self.describe()}"
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return f"must be {self.describe()}"
        return None

    def coerce(self, value):
        """An integral float (5e8 from YAML) as the int it stands for; anything else unchanged."""
        if self.integer and isinstance(value, float) and _is_exact_integer(value):
            return int(value)
        return value

    def parse(self, text: str) -> Number:
        """A flag's text as a number of this kind, or ValueError saying why not."""
        value = parse_number(text, self.integer)
        problem = self.problem(value)
        if problem:
            raise ValueError(f"{text.strip()!r} {problem}")
        return self.coerce(value) if self.integer else float(value)

    def __call__(self, text: str) -> Number:  # argparse calls the type: exit 2 with "argument --flag: ..."
        try:
            return self.parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    @property
    def __name__(self) -> str:  # argparse names the type in some messages
        return self.noun


def parse_number(text: str, integer: bool) -> Number:
    """'8', '+8', '1_000', '5e8', '0.5', ... -> int or float; 'nan', 'inf', '', '0x10', 'ten' -> ValueError."""
    cleaned = text.strip().replace("_", "")
    if re.fullmatch(r"[+-]?[0-9]+", cleaned):
        value = int(cleaned)
        if abs(value) > INT64_MAX:
            raise ValueError(f"{text.strip()!r} is beyond a 64-bit integer")
        return value
    if re.fullmatch(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", cleaned):
        value = float(cleaned)
        if not math.isfinite(value):
            raise ValueError(f"{text.strip()!r} is too large to be a number here")
        return value
    if cleaned.lower().lstrip("+-") in ("inf", "infinity", "nan"):
        raise ValueError(f"{text.strip()!r} is not a finite number")
    raise ValueError(f"{text.strip()!r} is not {'an integer' if integer else 'a number'}")


def _is_exact_integer(value: Number) -> bool:
    if isinstance(value, int):
        return abs(value) <= INT64_MAX
    return value.is_integer() and abs(value) <= EXACT


def _show(value: Number) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        value = int(value)
    return f"{value:,}" if isinstance(value, int) and abs(value) >= 100_000 else str(value)


def parse_size(text: str, what: str, high: int) -> int:
    """'64K', '1M', '1.5G', '4096' (bytes, K/M/G/T = powers of 1024) -> bytes in [1, high], or ValueError."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"{what} {text.strip()!r}: not a size (a number of bytes with an optional K, M, G or T, "
                         f"e.g. 64K, 16M, 1G)")
    value = float(match.group(1)) * UNITS[match.group(2).upper()]
    if not math.isfinite(value) or not 1 <= value <= high:
        raise ValueError(f"{what} {text.strip()!r}: must be between 1 byte and {high / (1 << 30):,.1f} GiB")
    return int(value)


# --- the kinds --------------------------------------------------------------------------------------------
COUNT = Kind("a count", integer=True, low=1, high=BIG)
COUNT_OR_ZERO = Kind("a count, 0 = none", integer=True, low=0, high=BIG)
SEED = Kind("a seed", integer=True, low=0, high=BIG)  # numpy takes < 2**32, and each rank adds its rank
PORT = Kind("a TCP port", integer=True, low=1, high=65535)
RANK = Kind("an index", integer=True, low=0, high=BIG)
SECONDS = Kind("seconds, at most 30 days", integer=False, low=0, high=30 * 86400, low_open=True)
GRACE_SECONDS = Kind("seconds, at most 30 days", integer=False, low=0, high=30 * 86400)
WHOLE_SECONDS = Kind("seconds, at most 30 days", integer=True, low=1, high=30 * 86400)
GIGABYTES = Kind("GB, at most 1 PB", integer=False, low=0, high=1e6)
POSITIVE = Kind("a positive number", integer=False, low=0, high=1e12, low_open=True)
NONNEGATIVE = Kind("a non-negative number", integer=False, low=0, high=1e12)
FRACTION = Kind("a fraction", integer=False, low=0, high=1, high_open=True)        # [0, 1)
PROBABILITY = Kind("a probability mass", integer=False, low=0, high=1, low_open=True)  # (0, 1]
TEMPERATURE = Kind("a sampling temperature", integer=False, low=0, high=100, low_open=True)


def available_cores() -> int:
    """The cores this process may run on (a container's or taskset's share, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


# a node's ranks: 8 GPUs is usual, 72 an NVL72 domain; 100000 is a typo, not a node
RANKS_PER_NODE = Kind("ranks per node", integer=True, low=1, high=1024)
# a training sequence predicts each next token: one token has nothing to predict
SEQUENCE_TOKENS = Kind("tokens per sequence, at least 2", integer=True, low=2, high=BIG)
# worker processes: more than the cores only queue (5000 requested, 190 forked, nothing faster)
PROCESSES = Kind(f"processes, at most the {available_cores()} cores this process may use", integer=True, low=1,
                 high=available_cores())
