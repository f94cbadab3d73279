"""Issue 41's fifth and sixth rounds of held-out measurements (tests/logs/heldout41o-41x, 41y-41zd), one set a
row. Each set was collected by another engineer without running the doctor or reading its code (the collector
reported only how many logs it wrote), scored once when new by the same rule as heldout41b
(test_doctor_heldout41b.verdict), and only then read and used to build (test_doctor_mechanisms41o.py and 41y.py).
Each row says what it measured when new and what the test holds since; the tests assert the score does not get
worse, not that a miss stays a miss.
"""
from __future__ import annotations

import pytest

from test_doctor_heldout41b import assert_holds

pytestmark = pytest.mark.quick

# The measurement of each set, as written when it was made:
#
# Fourteenth held-out measurement: the doctor on 4 public threads (tests/logs/heldout41o; 10 asked for,
# 4 with a confirmed fix in the time given: DeepSpeed, accelerate, transformers and NCCL threads) collected by another
# engineer without running the doctor or reading its code; the collector reported only how many logs it wrote. The
# doctor ran on them once, at 90e5425 (the doctor as landed at stop 48), scored by the same rule as heldout41b
# (test_doctor_heldout41b.verdict): 1 right, 1 partial, 0 wrong, 1 not recognised, 1 silent.
#
# Then used: its misses were read and what they led to is in test_doctor_mechanisms41o.py (an InfiniBand completion
# error read by its number; an error right after a communicator's setup read as its transports; an fp16 collapse
# against a bf16 preset answered with the preset's bf16). Scored after: 3 right, 1 partial (the thread's fix, a
# static fp16 loss scale, only turns the abort into skipped steps - the doctor proposes bf16 on an A100 preset).
#
# Fifteenth held-out measurement: the doctor on 3 public threads (tests/logs/heldout41p; 10 asked for,
# 3 with a confirmed fix in the time given: LLaMA-Factory, axolotl, TRL, PEFT, unsloth and similar repositories)
# collected by another engineer, at the same time as heldout41o and without seeing it, without running the doctor or
# reading its code; the collector reported only how many logs it wrote. The doctor ran on them once, at 90e5425 (the
# doctor as landed at stop 48), scored by the same rule as heldout41b: 3 right, 0 partial, 0 wrong, 0 not recognised.
# Nothing was built from them.
#
# Sixteenth held-out measurement: the doctor on 3 public threads (tests/logs/heldout41r; 8 asked for, 3
# with a confirmed fix in the time given: start-up, model loading, first steps, optimizer and versions) collected by
# another engineer without running the doctor or reading its code; the collector reported only how many logs it wrote.
# The doctor ran on them once, at 9286f1e (after what heldout41o led to), scored by the same rule as heldout41b
# (test_doctor_heldout41b.verdict): 0 right, 1 partial, 1 wrong, 1 not recognised.
#
# The wrong one: bitsandbytes' "Please run the following command to get more information:" was taken as the remedy,
# cut at its colon. Then used (test_doctor_mechanisms41o.py): an instruction that only shows more is a look, with the
# command it introduces; a missing name retold without its module is read from the import statement the log quotes.
# Scored after: 1 right, 2 partial (bitsandbytes' look, where the thread pinned bitsandbytes 0.39.1; the gathered
# 16-bit save under ZeRO-3, where the thread moved to ZeRO-2).
#
# Seventeenth held-out measurement: the doctor on 7 public threads (tests/logs/heldout41q; 8 asked for:
# checkpoint save and resume, evaluation, export and merging, data, mid-run failures) collected by another engineer
# without running the doctor or reading its code; the collector reported only how many logs it wrote. One sidecar was
# corrected before scoring (written in it: a V100 override on a bf16 preset gets the preset's fp16 overrides so it
# resolves). The doctor ran on them once, at e4d89de (after what heldout41o and heldout41r led to), scored by the same
# rule as heldout41b (test_doctor_heldout41b.verdict): 1 right, 1 partial, 0 wrong, 4 not recognised, 1 silent.
#
# Then used (test_doctor_mechanisms41o.py): a DeepSpeed engine method (read from DeepSpeed's source) on an unwrapped
# model; an OOM in FSDP's full state dict at a save; safetensors refusing tied weights; a collective timeout on one
# node of PCIe GPUs tests P2P first; an operand of size 0 is a ZeRO-3 placeholder used outside a gather (by phase).
# Scored after: 5 right, 1 partial, 1 not recognised (a paged optimizer's state refused by bitsandbytes' C code at a
# resume, with nothing in the log that says resume or paged).
#
# Eighteenth held-out measurement: the doctor on 3 public threads (tests/logs/heldout41s; 8 asked for:
# multi-node launching, rendezvous, distributed hangs, MoE, sequence and pipeline parallelism) collected by another
# engineer without running the doctor or reading its code; the collector reported only how many logs it wrote. The
# doctor ran on them once, at a521892 (after what heldout41o, 41r and 41q led to), scored by the same rule as heldout41b
# (test_doctor_heldout41b.verdict): 0 right, 0 partial, 0 wrong, 3 not recognised - all three a rendezvous across
# nodes, in wordings and sites the store's reading did not know.
#
# Then used (test_doctor_mechanisms41o.py): the store read by its structure - a connection error raised where a store
# or a group is created, "any network address of (host, port)", a traceback cut in a group's creation - with gloo's
# own interface variable for a gloo group and torchrun's endpoint for its c10d store. Scored after: 3 right.
#
# Nineteenth held-out measurement: the doctor on 6 public threads (tests/logs/heldout41t; 8 asked for:
# preference and RL training, quantized training, mixed precision, memory on consumer GPUs) collected by another
# engineer without running the doctor or reading its code; the collector reported only how many logs it wrote. The
# doctor ran on them once, at 41a01d6 (after what heldout41o, 41r, 41q and 41s led to), scored by the same rule as
# heldout41b (test_doctor_heldout41b.verdict): 1 right, 0 partial, 0 wrong, 5 not recognised - four of them dtypes.
#
# Then used (test_doctor_mechanisms41o.py): two dtypes read by where they met (a ZeRO-3 gather: the config's precision
# against the checkpoint's; a quantized run: peft and bitsandbytes; elsewhere one dtype for the model) and NaN out of a
# backward in an fp16 run (bf16, else fp32). Scored after: 5 right, 1 not recognised (a traceback cut before its
# message, with nothing of the 8-bit loading in the log).
#
# Twentieth held-out measurement: the doctor on 5 public threads (tests/logs/heldout41u; 8 asked for:
# installation, environments, op builds and version incompatibilities) collected by another engineer without running
# the doctor or reading its code; the collector reported only how many logs it wrote. The doctor ran on them once, at
# 48afa41 (after what heldout41o-41t led to), scored by the same rule as heldout41b (test_doctor_heldout41b.verdict):
# 2 right, 1 partial, 1 wrong, 1 not recognised.
#
# The wrong one: LLaVA's own `cannot import name 'LlavaLlamaForCausalLM' from 'llava.model'` read as two releases of
# llava that do not go together. Then used (test_doctor_mechanisms41o.py): a package that cannot import its own name
# hid a failure inside (a compiled dependency the log names is reinstalled against the torch); an `__init__()` refusing
# a keyword is the class the raising line builds (`Accelerator(`: accelerate, not transformers). Scored after: 4 right,
# 1 not recognised (a one-line PEFT version message whose fix was uninstalling a shadowing pip package).
#
# Twenty-first held-out measurement: the doctor on 1 public thread (tests/logs/heldout41v; 8 asked for:
# DeepSpeed configuration in full fine-tuning and pretraining; 1 with a confirmed fix in the time given) collected by
# another engineer, beside heldout41u, without running the doctor or reading its code. The doctor ran on it once, at
# 48afa41, scored by the same rule as heldout41b: 0 right, 1 partial (the batch triad made to agree, where the thread's
# fix was a global batch divisible by micro-batch x world size). Then used: a global batch that no accumulation reaches
# is said to be not divisible, with the divisor. Scored after: 1 right.
#
# Twenty-second and twenty-third held-out measurements: the doctor on 2 and 2 public threads (tests/logs/heldout41w:
# any phase, repositories not used before; tests/logs/heldout41x: DeepSpeed's own and HF threads about DeepSpeed; 8
# asked for each, 2 found with a confirmed fix in the time given), collected side by side by two engineers without
# running the doctor or reading its code. The doctor ran on them once, at f5f9626 (after what heldout41o-41v led to):
# heldout41w 0 right, 2 not recognised; heldout41x 1 right, 1 partial. Then used (test_doctor_mechanisms41o.py): a
# signature message wrapped over two lines is read whole; a missing CUDA header is the CUDA toolkit of torch's
# version. Scored after: heldout41w 1 right, 1 not recognised (one line, a rename of HF's tmp-checkpoint-N on a shared
# file system, whose fix was save_on_each_node=False); heldout41x 2 right.
#
# Twenty-fourth and twenty-fifth held-out measurements: the doctor on 5 and 2 public threads (tests/logs/heldout41y:
# DeepSpeed's own runtime - ZeRO, checkpoint conversion, config validation, the launcher; tests/logs/heldout41z:
# fine-tuning stacks - TRL, PEFT, LLaMA-Factory, accelerate; 5-8 asked for each) collected side by side by two
# engineers without running the doctor or reading its code. The doctor ran on them once, at 0df1ba6 (the doctor as
# landed at stop 49), scored by the same rule as heldout41b: heldout41y 0 right, 1 partial, 0 wrong, 4 not recognised;
# heldout41z 1 right, 1 partial. Seven logs: 1 right, 2 partial, 0 wrong, 4 not recognised.
#
# Then used (test_doctor_mechanisms41y.py): a broken invariant inside a library's own code (IndexError, a bare
# assert, an index past a tensor's end) read against the installed release's source - the same line still there
# (its patch, or the release before) or changed (the installed release); a DeepSpeed script run from a checkpoint or a
# copy found by its file and function; a line quoted without its frame found by its rarest name; a key one DeepSpeed
# section refuses that belongs to another (remove it there, no upgrade); ZeRO's "gradient computed twice" with
# reentrant checkpointing; DeepSpeed's runner's "No slot" (--include, CUDA_VISIBLE_DEVICES); a device past the node's
# GPUs, whose stated remedy (one process fewer) would leave a one-GPU node none. Scored after: heldout41y 4 right,
# 1 partial (a ZeRO-3 coordinator line that DeepSpeed 0.19.8 changed: upgrade, where the thread went back to 0.15.3);
# heldout41z 2 right.
#
# Twenty-sixth and twenty-seventh held-out measurements: the doctor on 2 and 5 public threads (tests/logs/heldout41za:
# failures in the middle or at the end of a run - saving, resuming, exporting and converting; tests/logs/heldout41zb:
# memory, kernels and performance - Liger, triton, fused optimizers, kernel images), collected side by side by two
# engineers without running the doctor or reading its code. The doctor ran on them once, at 7c03f33 (after what
# heldout41y and 41z led to): heldout41za 0 right, 2 not recognised; heldout41zb 2 right, 1 partial, 2 not
# recognised. Seven logs: 2 right, 1 partial, 0 wrong, 4 not recognised.
#
# Then used (test_doctor_mechanisms41y.py): a line pasted as Markdown inline code is read without its backticks;
# transformers' own refusal of storage its config does not declare tied (remove the sharing, else no safetensors); a
# keyword transformers passes that a patched forward lacks (upgrade the patching package the log names); torch.save's
# "Parent directory X does not exist" read against the argparse of the installed script the log runs (zero_to_fp32.py's
# output_dir). Scored after: heldout41za 1 right, 1 partial (an output directory, where the thread pinned DeepSpeed
# 0.15.2); heldout41zb 3 right, 1 partial, 1 not recognised (triton's PY_SSIZE_T_CLEAN, fixed by torch 2.5 with triton
# 3.1).
#
# Twenty-eighth and twenty-ninth held-out measurements: the doctor on 1 and 2 public threads (tests/logs/heldout41zc:
# launching and distributed setup; tests/logs/heldout41zd: model loading, tokenizers and data; 4-8 asked for each, in
# 20 minutes), collected side by side by two engineers without running the doctor or reading its code. The doctor ran
# on them once, at ea3ed16 (the doctor as at eaf2250, after what heldout41y-41zb led to): heldout41zc 1 right;
# heldout41zd 1 right, 1 not recognised (a Trainer's "max_steps has to be specified" for a dataset without __len__).
# Nothing was built from them: they are held out for the next round.
SETS = [  # (set, threads, right at least, not recognised at most); none wrong or silent
    ("heldout41o", 4, 3, 0),
    ("heldout41p", 3, 3, 0),
    ("heldout41r", 3, 1, 0),
    ("heldout41q", 7, 5, 1),
    ("heldout41s", 3, 3, 0),
    ("heldout41t", 6, 5, 1),
    ("heldout41u", 5, 4, 1),
    ("heldout41v", 1, 1, 0),
    ("heldout41w", 2, 1, 1),
    ("heldout41x", 2, 2, 0),
    ("heldout41y", 5, 4, 0),
    ("heldout41z", 2, 2, 0),
    ("heldout41za", 2, 1, 0),
    ("heldout41zb", 5, 3, 1),
    ("heldout41zc", 1, 1, 0),
    ("heldout41zd", 2, 1, 1),
]


@pytest.mark.parametrize("held, threads, right, not_recognised", SETS, ids=[row[0] for row in SETS])
def test_a_new_set_whose_score_does_not_get_worse(held, threads, right, not_recognised):
    assert_holds(held, threads, right, not_recognised)
