"""Issue 41's third held-out measurement: the doctor on 11 public threads (tests/logs/heldout41d) collected by
another engineer while the third round of mechanisms was built - the logs and their expectations were written
without running the doctor and without reading its code, and nobody building the doctor read them. The doctor ran
on them once, at commit 0c2ffd8, scored by the same rule as heldout41b (test_doctor_heldout41b.verdict): 4 right,
3 partial, 0 wrong, 4 not recognised. Each sidecar's `observed` block records that run; `scoring_note` says where a
thread's confirmation is weaker (10, 11: a maintainer's answer and a closed issue, no "it worked").

The test asserts the score does not get worse - no fewer right, no wrong, no more unrecognised, every unrecognised
log a true fallback (no proposal) - not that any miss stays a miss. Once these logs are used to build anything, say
so here: they are then no longer held out.

Used, 2026-12-07, after that measurement: its misses led to the quantized-placement and unknown-architecture
classes, the "only supports A and B" statement and the fix of a prohibition read as an instruction
(tests/test_doctor_mechanisms41c.py); 02 became right with the no-gradient-graph class, built from issue 41's own
list. After them: 9 right, 0 partial, 0 wrong, 2 not recognised. This set is no longer held out;
tests/logs/heldout41e is (test_doctor_heldout41e.py)."""
from __future__ import annotations

import pytest

from test_doctor_heldout41b import LOGS, assert_a_new_set, cases_of, scored

pytestmark = pytest.mark.quick

HELD = LOGS / "heldout41d"
CASES = cases_of(HELD)


def test_the_threads_were_not_in_an_earlier_corpus():
    assert_a_new_set(HELD, CASES, 11)


def test_the_measured_score_does_not_get_worse():
    got, count = scored(HELD, CASES)
    assert count["right"] >= 9, got  # 4 when held out; 9 after the mechanisms it led to (above)
    assert count["wrong"] == 0 and count["silent"] == 0, got
    assert count["not recognised"] <= 2, got
    assert all(got[n] == "right" for n, c in CASES.items() if c["observed"]["auto_score"] == "right"), got
