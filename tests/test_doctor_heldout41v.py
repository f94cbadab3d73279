"""Issue 41's twenty-first held-out measurement: the doctor on 1 public thread (tests/logs/heldout41v; 8 asked for:
DeepSpeed configuration in full fine-tuning and pretraining; 1 with a confirmed fix in the time given) collected by
another engineer, beside heldout41u, without running the doctor or reading its code. The doctor ran on it once, at
48afa41, scored by the same rule as heldout41b: 0 right, 1 partial (the batch triad made to agree, where the thread's
fix was a global batch divisible by micro-batch x world size). Then used: a global batch that no accumulation reaches
is said to be not divisible, with the divisor. Scored after: 1 right.
"""
from __future__ import annotations

import pytest

from test_doctor_heldout41b import LOGS, assert_a_new_set, cases_of, scored

pytestmark = pytest.mark.quick

HELD = LOGS / "heldout41v"
CASES = cases_of(HELD)


def test_the_thread_was_not_in_an_earlier_corpus():
    assert_a_new_set(HELD, CASES, 1)


def test_the_score_since_it_was_used_does_not_get_worse():
    got, count = scored(HELD, CASES)
    assert count["right"] == 1, got
