"""Issue 41's twentieth held-out measurement: the doctor on 5 public threads (tests/logs/heldout41u; 8 asked for:
installation, environments, op builds and version incompatibilities) collected by another engineer without running
the doctor or reading its code; the collector reported only how many logs it wrote. The doctor ran on them once, at
48afa41 (after what heldout41o-41t led to), scored by the same rule as heldout41b (test_doctor_heldout41b.verdict):
2 right, 1 partial, 1 wrong, 1 not recognised.

The wrong one: LLaVA's own `cannot import name 'LlavaLlamaForCausalLM' from 'llava.model'` read as two releases of
llava that do not go together. Then used (test_doctor_mechanisms41o.py): a package that cannot import its own name
hid a failure inside (a compiled dependency the log names is reinstalled against the torch); an `__init__()` refusing
a keyword is the class the raising line builds (`Accelerator(`: accelerate, not transformers). Scored after: 4 right,
1 not recognised (a one-line PEFT version message whose fix was uninstalling a shadowing pip package).
"""
from __future__ import annotations

import pytest

from test_doctor_heldout41b import LOGS, assert_a_new_set, cases_of, scored

pytestmark = pytest.mark.quick

HELD = LOGS / "heldout41u"
CASES = cases_of(HELD)


def test_the_threads_were_not_in_an_earlier_corpus():
    assert_a_new_set(HELD, CASES, 5)


def test_the_score_since_it_was_used_does_not_get_worse():
    got, count = scored(HELD, CASES)
    assert count["right"] >= 4 and count["wrong"] == 0 and count["silent"] == 0, got
