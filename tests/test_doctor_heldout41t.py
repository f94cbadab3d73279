"""Issue 41's nineteenth held-out measurement: the doctor on 6 public threads (tests/logs/heldout41t; 8 asked for:
preference and RL training, quantized training, mixed precision, memory on consumer GPUs) collected by another
engineer without running the doctor or reading its code; the collector reported only how many logs it wrote. The
doctor ran on them once, at 41a01d6 (after what heldout41o, 41r, 41q and 41s led to), scored by the same rule as
heldout41b (test_doctor_heldout41b.verdict): 1 right, 0 partial, 0 wrong, 5 not recognised - four of them dtypes.

Then used (test_doctor_mechanisms41o.py): two dtypes read by where they met (a ZeRO-3 gather: the config's precision
against the checkpoint's; a quantized run: peft and bitsandbytes; elsewhere one dtype for the model) and NaN out of a
backward in an fp16 run (bf16, else fp32). Scored after: 5 right, 1 not recognised (a traceback cut before its
message, with nothing of the 8-bit loading in the log).
"""
from __future__ import annotations

import pytest

from test_doctor_heldout41b import LOGS, assert_a_new_set, cases_of, scored

pytestmark = pytest.mark.quick

HELD = LOGS / "heldout41t"
CASES = cases_of(HELD)


def test_the_threads_were_not_in_an_earlier_corpus():
    assert_a_new_set(HELD, CASES, 6)


def test_the_score_since_it_was_used_does_not_get_worse():
    got, count = scored(HELD, CASES)
    assert count["right"] >= 5 and count["wrong"] == 0 and count["silent"] == 0, got
