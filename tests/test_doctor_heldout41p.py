"""Issue 41's fifteenth held-out measurement: the doctor on 3 public threads (tests/logs/heldout41p; 10 asked for,
3 with a confirmed fix in the time given: LLaMA-Factory, axolotl, TRL, PEFT, unsloth and similar repositories)
collected by another engineer, at the same time as heldout41o and without seeing it, without running the doctor or
reading its code; the collector reported only how many logs it wrote. The doctor ran on them once, at 90e5425 (the
doctor as landed at stop 48), scored by the same rule as heldout41b: 3 right, 0 partial, 0 wrong, 0 not recognised.
Nothing was built from them.
"""
from __future__ import annotations

import pytest

from test_doctor_heldout41b import LOGS, assert_a_new_set, cases_of, scored

pytestmark = pytest.mark.quick

HELD = LOGS / "heldout41p"
CASES = cases_of(HELD)


def test_the_threads_were_not_in_an_earlier_corpus():
    assert_a_new_set(HELD, CASES, 3)


def test_the_measured_score_does_not_get_worse():
    got, count = scored(HELD, CASES)
    assert count["right"] == 3 and count["wrong"] == 0, got
