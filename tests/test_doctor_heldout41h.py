"""Issue 41's seventh held-out measurement: the doctor on 8 public threads (tests/logs/heldout41h) collected by
another engineer while the mechanisms after heldout41g were built - the logs and their expectations were written
without running the doctor and without reading its code, and nobody building the doctor read them before it ran
(the collector reported only file names and sources). The doctor ran on them once, at commit 9d03cec, scored by the
same rule as heldout41b (test_doctor_heldout41b.verdict): 1 right, 3 partial, 0 wrong, 4 not recognised. Each
sidecar's `observed` block records that run; `scoring_note` says where a confirmation is weaker (01, 02, 04, 07),
a traceback cut (02, 03), or a log is not a trainer's (05: nccl-tests under mpirun; 08: torchft's coordinator).

The test asserts the score does not get worse - no wrong, no more unrecognised, every unrecognised log a true
fallback (no proposal) - not that any miss stays a miss. Once these logs are used to build anything, say so here:
they are then no longer held out.

Used, 2026-12-07, after that measurement: its misses led to mechanisms tested on drawn cases in
test_doctor_mechanisms41f.py - a call whose signature changed between the caller's and the callee's releases (06,
07: an override a library now calls with more arguments gets them), one interface name exported to nodes that name
it differently (05), fp16 trainable weights under a loss scaler (04), weights a framework loaded into ZeRO-3's
placeholders go to stage 2 when the planner fits it (03), the option that loads with its own device_map (02). Since:
6 right, 2 partial (04: the thread pinned PEFT; 06: the caller is not in the log). No longer held out.
"""
from __future__ import annotations

import pytest

from test_doctor_heldout41b import LOGS, assert_a_new_set, cases_of, scored

pytestmark = pytest.mark.quick

HELD = LOGS / "heldout41h"
CASES = cases_of(HELD)


def test_the_threads_were_not_in_an_earlier_corpus():
    assert_a_new_set(HELD, CASES, 8)


def test_the_measured_score_does_not_get_worse():
    got, count = scored(HELD, CASES)
    assert count["right"] >= 6 and count["right"] + count["partial"] == 8, got  # 1 right when held out
    assert count["wrong"] == 0 and count["silent"] == 0, got
    assert all(got[n] == "right" for n, c in CASES.items() if c["observed"]["auto_score"] == "right"), got
