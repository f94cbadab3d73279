"""The doctor is linear in the log (issue 38, item 7): a log whose lines or blocks repeat back to back (the same OOM
line from every step, the same warning and traceback per step) is read with each repeated block once; it used to be
quadratic in repeated matching lines (2,000 lines 2.9 s, 200,000 lines killed at 120 s).

The cases are drawn (blocks, repeat counts, the real logs of tests/logs/real) with fixed seeds."""
from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from trainer.diagnose.doctor import diagnose
from trainer.diagnose.logtext import REPEAT_BLOCK_LINES, collapse_repeats
from trainer.presets import load_preset, with_overrides
from trainer.resolve import resolve

REAL = Path(__file__).resolve().parent / "logs" / "real"
OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
       "79.35 GiB of which 1.19 GiB is free.")


def drawn_log(rng: random.Random) -> list[str]:
    """Blocks of random lines (from a small alphabet, so lines recur), each repeated a drawn number of times."""
    words = [f"line {c}" for c in "abcdefg"]
    lines: list[str] = []
    for _ in range(rng.randint(1, 12)):
        block = [rng.choice(words) for _ in range(rng.randint(1, REPEAT_BLOCK_LINES + 4))]
        lines += block * rng.choice([1, 1, 2, 3, 9])
    return lines


def accounted(collapsed: tuple[list[str], list]) -> int:
    """The input lines a collapsed log stands for: each kept line, plus each dropped block's lines x times."""
    kept, dropped = collapsed
    return len(kept) + sum(period * times for _, period, times in dropped)


def test_collapsing_keeps_every_line_once_and_accounts_for_the_rest():
    rng = random.Random(7)
    for _ in range(60):
        lines = drawn_log(rng)
        collapsed = collapse_repeats(lines)
        assert accounted(collapsed) == len(lines)
        kept, dropped = collapsed
        assert list(dict.fromkeys(kept)) == list(dict.fromkeys(lines))  # every line, in first-seen order
        expanded = []  # the dropped repeats put back, in order: the log as it was
        for i, line in enumerate(kept):
            expanded.append(line)
            for _, period, times in (d for d in dropped if d[0] == i):
                expanded += expanded[len(expanded) - period:] * times
        assert expanded == lines


def test_a_block_repeated_back_to_back_is_kept_once():
    rng = random.Random(8)
    for _ in range(40):
        block = [f"{rng.random()}" for _ in range(rng.randint(1, REPEAT_BLOCK_LINES))]
        times = rng.randint(2, 300)
        kept, dropped = collapse_repeats(["start"] + block * times + ["end"])
        assert kept == ["start", *block, "end"] and dropped == [(len(block), len(block), times - 1)]


def resolved(overrides=()):
    return resolve(load_preset("7b_8xa100", list(overrides)))


@pytest.mark.slow
def test_a_real_log_repeated_is_diagnosed_as_the_log_once():
    """Each real log of tests/logs/real, its failing block repeated: the same failure class as the log once."""
    rng = random.Random(9)
    for path in rng.sample(sorted(REAL.glob("*.log")), 4):
        lines = path.read_text().split("\n")
        cut = rng.randint(max(0, len(lines) - 40), len(lines) - 1)
        repeated = "\n".join(lines[:cut] + lines[cut:] * rng.randint(20, 400))
        once = diagnose(resolved(), "\n".join(lines))
        assert diagnose(resolved(), repeated).failure == once.failure, path.name


@pytest.mark.slow
def test_doctor_answers_200000_repeated_oom_lines_in_seconds():
    """The issue's case, through the whole diagnosis (the ladder included), timed in CPU seconds (the machine is
    shared): it was killed at 120 s."""
    rng = random.Random(10)
    step_block = [f"[rank{r}]: {OOM}" for r in range(rng.choice([1, 2, 8]))]
    text = "\n".join(["loading model", *step_block * (200_000 // len(step_block))])
    start = time.process_time()
    d = diagnose(resolved(), text, lambda extra: resolved(with_overrides([], extra)))
    assert d.failure == "cuda_oom"
    assert time.process_time() - start < 20
