"""Issue 41's sixteenth held-out measurement: the doctor on 3 public threads (tests/logs/heldout41r; 8 asked for, 3
with a confirmed fix in the time given: start-up, model loading, first steps, optimizer and versions) collected by
another engineer without running the doctor or reading its code; the collector reported only how many logs it wrote.
The doctor ran on them once, at 9286f1e (after what heldout41o led to), scored by the same rule as heldout41b
(test_doctor_heldout41b.verdict): 0 right, 1 partial, 1 wrong, 1 not recognised.

The wrong one: bitsandbytes' "Please run the following command to get more information:" was taken as the remedy,
cut at its colon. Then used (test_doctor_mechanisms41o.py): an instruction that only shows more is a look, with the
command it introduces; a missing name retold without its module is read from the import statement the log quotes.
Scored after: 1 right, 2 partial (bitsandbytes' look, where the thread pinned bitsandbytes 0.39.1; the gathered
16-bit save under ZeRO-3, where the thread moved to ZeRO-2).
"""
from __future__ import annotations

import pytest

from test_doctor_heldout41b import LOGS, assert_a_new_set, cases_of, scored

pytestmark = pytest.mark.quick

HELD = LOGS / "heldout41r"
CASES = cases_of(HELD)


def test_the_threads_were_not_in_an_earlier_corpus():
    assert_a_new_set(HELD, CASES, 3)


def test_the_score_since_it_was_used_does_not_get_worse():
    got, count = scored(HELD, CASES)
    assert count["right"] >= 1 and count["wrong"] == 0 and count["silent"] == 0 and count["not recognised"] == 0, got
