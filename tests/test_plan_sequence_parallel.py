"""The planner under long contexts: DeepSpeed Ulysses sequence parallelism (SP) when one sequence's activations fit
no GPU, its memory (every activation outside attention held s/sp tokens per GPU), its all-to-all, and its DeepSpeed
config (`sequence_parallel_size`, the batch triad over world / sp data-parallel ranks)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from trainer import ds as dsc
from trainer.errors import ConfigError
from trainer.plan import memory as mem
from trainer.plan.decide import make_plan
from trainer.plan.estimate import CANDIDATES, best_shot
from trainer.plan.inputs import build_inputs
from trainer.plan.report import plan_to_json
from distributed import run_cli

LONG = {"model": "8b", "gpu": "h100-80g", "gpus_per_node": 8, "seq_len": 131072}


def test_a_128k_sequence_of_an_8b_model_on_8_h100s_gets_the_smallest_sequence_parallel_size_that_fits():
    result = run_cli("plan", "--model", "8b", "--gpu", "h100-80g", "--gpus-per-node", "8", "--seq-len", "131072",
                     "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    sp = plan["sequence_parallel_size"]
    assert sp > 1 and plan["fits"] and plan["choice"]["sequence_parallel_size"] == sp
    ds = plan["deepspeed_config"]
    assert dsc.sequence_parallel_size(ds) == sp and dsc.check_keys(ds) == []
    # DeepSpeed checks its triad against world / sequence_parallel_size ranks: one SP group trains one sequence
    assert ds["train_batch_size"] == plan["choice"]["micro_batch"] * plan["choice"]["grad_accum"] * (8 // sp)
    assert plan["choice"]["global_batch"] == ds["train_batch_size"]
    assert any("Ulysses all-to-all" in note for note in plan["notes"])
    # the smallest: the chosen candidate does not fit at any smaller size
    chosen = next(c for c in CANDIDATES if c.name == plan["choice"]["name"])
    for n in (n for n in (1, 2, 4) if n < sp):
        assert not best_shot(build_inputs({**LONG, "sequence_parallel": n}), chosen, 1).fits


def test_short_sequences_plan_without_sequence_parallelism():
    plan = plan_to_json(make_plan(build_inputs({**LONG, "seq_len": 4096})))
    assert plan["sequence_parallel_size"] == 1 and "sequence_parallel_size" not in plan["deepspeed_config"]


def test_activations_per_gpu_are_divided_along_the_sequence():
    m = build_inputs(LONG).model.config
    for checkpointing in (False, True):
        whole = mem.activation_bytes(m, 8192, 1, checkpointing, "bf16", "sdpa")
        for sp in (2, 4, 8):
            part = mem.activation_bytes(m, 8192, 1, checkpointing, "bf16", "sdpa", sequence_parallel=sp)
            assert part.total * sp == whole.total and part.logits * sp == whole.logits
    # a padding mask (b, 1, s, s) is the one thing every rank of the group still holds whole
    masked = [mem.layer_activation_bytes(m, 8192, 1, "bf16", "sdpa", True, sp) for sp in (1, 2)]
    mask = 2 * 8192 * 8192
    assert masked[1] - mask == (masked[0] - mask) // 2


def test_the_all_to_all_volume_grows_with_the_shard_and_vanishes_at_one():
    m = build_inputs(LONG).model.config
    assert mem.ulysses_all_to_all_bytes(m, 131072, 1, 1) == 0
    # q, k, v and the output of s/sp tokens, (sp-1)/sp of it leaving the rank, forward and backward
    kv = (m.num_kv_heads or m.num_heads) * (m.hidden_size // m.num_heads)
    assert mem.ulysses_all_to_all_bytes(m, 131072, 1, 4) == 2 * (2 * 32768 * (2 * m.hidden_size + 2 * kv) * 3 // 4)


@pytest.mark.parametrize("sp, message", [(3, "sizes that work here: 1, 2, 4, 8"), (16, "must divide the 8 GPUs")])
def test_a_size_that_cannot_work_is_a_named_error_with_the_sizes_that_can(sp, message):
    with pytest.raises(ConfigError) as err:
        build_inputs({**LONG, "sequence_parallel": sp})
    assert "--sequence-parallel" in str(err.value) and message in str(err.value)


def test_a_fixed_size_that_does_not_fit_is_told_the_size_that_would():
    result = run_cli("plan", "--model", "8b", "--gpu", "h100-80g", "--gpus-per-node", "8", "--seq-len", "131072",
                     "--sequence-parallel", "2")
    assert result.returncode == 1
    best = plan_to_json(make_plan(build_inputs(LONG)))["sequence_parallel_size"]
    assert f"--sequence-parallel {best}" in result.stdout


def test_the_global_batch_counts_data_parallel_groups_not_gpus():
    inputs = dataclasses.replace(build_inputs({**LONG, "global_batch": 8}), sequence_parallel=None)
    plan = make_plan(inputs)
    sp = plan.inputs.sp
    assert sp > 1 and plan.global_batch == 8 and plan.grad_accum * plan.choice.micro_batch * (8 // sp) == 8
