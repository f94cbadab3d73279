"""Issue 41's fourteenth held-out measurement: the doctor on 4 public threads (tests/logs/heldout41o; 10 asked for,
4 with a confirmed fix in the time given: DeepSpeed, accelerate, transformers and NCCL threads) collected by another
engineer without running the doctor or reading its code; the collector reported only how many logs it wrote. The
doctor ran on them once, at 90e5425 (the doctor as landed at stop 48), scored by the same rule as heldout41b
(test_doctor_heldout41b.verdict): 1 right, 1 partial, 0 wrong, 1 not recognised, 1 silent.

Then used: its misses were read and what they led to is in test_doctor_mechanisms41o.py (an InfiniBand completion
error read by its number; an error right after a communicator's setup read as its transports; an fp16 collapse
against a bf16 preset answered with the preset's bf16). Scored after: 3 right, 1 partial (the thread's fix, a
static fp16 loss scale, only turns the abort into skipped steps - the doctor proposes bf16 on an A100 preset).
"""
from __future__ import annotations

import pytest

from test_doctor_heldout41b import LOGS, assert_a_new_set, cases_of, scored

pytestmark = pytest.mark.quick

HELD = LOGS / "heldout41o"
CASES = cases_of(HELD)


def test_the_threads_were_not_in_an_earlier_corpus():
    assert_a_new_set(HELD, CASES, 4)


def test_the_score_since_it_was_used_does_not_get_worse():
    got, count = scored(HELD, CASES)
    assert count["right"] >= 3 and count["wrong"] == 0 and count["silent"] == 0 and count["not recognised"] == 0, got
