"""Issue 41's seventeenth held-out measurement: the doctor on 7 public threads (tests/logs/heldout41q; 8 asked for:
checkpoint save and resume, evaluation, export and merging, data, mid-run failures) collected by another engineer
without running the doctor or reading its code; the collector reported only how many logs it wrote. One sidecar was
corrected before scoring (written in it: a V100 override on a bf16 preset gets the preset's fp16 overrides so it
resolves). The doctor ran on them once, at e4d89de (after what heldout41o and heldout41r led to), scored by the same
rule as heldout41b (test_doctor_heldout41b.verdict): 1 right, 1 partial, 0 wrong, 4 not recognised, 1 silent.

Then used (test_doctor_mechanisms41o.py): a DeepSpeed engine method (read from DeepSpeed's source) on an unwrapped
model; an OOM in FSDP's full state dict at a save; safetensors refusing tied weights; a collective timeout on one
node of PCIe GPUs tests P2P first; an operand of size 0 is a ZeRO-3 placeholder used outside a gather (by phase).
Scored after: 5 right, 1 partial, 1 not recognised (a paged optimizer's state refused by bitsandbytes' C code at a
resume, with nothing in the log that says resume or paged).
"""
from __future__ import annotations

import pytest

from test_doctor_heldout41b import LOGS, assert_a_new_set, cases_of, scored

pytestmark = pytest.mark.quick

HELD = LOGS / "heldout41q"
CASES = cases_of(HELD)


def test_the_threads_were_not_in_an_earlier_corpus():
    assert_a_new_set(HELD, CASES, 7)


def test_the_score_since_it_was_used_does_not_get_worse():
    got, count = scored(HELD, CASES)
    assert count["right"] >= 5 and count["wrong"] == 0 and count["silent"] == 0 and count["not recognised"] <= 1, got
