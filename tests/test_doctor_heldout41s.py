"""Issue 41's eighteenth held-out measurement: the doctor on 3 public threads (tests/logs/heldout41s; 8 asked for:
multi-node launching, rendezvous, distributed hangs, MoE, sequence and pipeline parallelism) collected by another
engineer without running the doctor or reading its code; the collector reported only how many logs it wrote. The
doctor ran on them once, at a521892 (after what heldout41o, 41r and 41q led to), scored by the same rule as heldout41b
(test_doctor_heldout41b.verdict): 0 right, 0 partial, 0 wrong, 3 not recognised - all three a rendezvous across
nodes, in wordings and sites the store's reading did not know.

Then used (test_doctor_mechanisms41o.py): the store read by its structure - a connection error raised where a store
or a group is created, "any network address of (host, port)", a traceback cut in a group's creation - with gloo's
own interface variable for a gloo group and torchrun's endpoint for its c10d store. Scored after: 3 right.
"""
from __future__ import annotations

import pytest

from test_doctor_heldout41b import LOGS, assert_a_new_set, cases_of, scored

pytestmark = pytest.mark.quick

HELD = LOGS / "heldout41s"
CASES = cases_of(HELD)


def test_the_threads_were_not_in_an_earlier_corpus():
    assert_a_new_set(HELD, CASES, 3)


def test_the_score_since_it_was_used_does_not_get_worse():
    got, count = scored(HELD, CASES)
    assert count["right"] == 3, got
