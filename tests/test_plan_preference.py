"""`plan --task dpo` / `dpo-lora`: the reference model priced for each way it can run, pairs doubling the sequences
of a micro-batch, the JSON naming the reference, and bad combinations as named errors. Numbers are derived here
from the architecture (Llama-2-7B: 6,738,415,616 parameters, the largest module the 32000 x 4096 embedding), not
read back from the planner. Fast: no ranks; two CLI subprocesses."""
from __future__ import annotations

import json

import pytest

from distributed import run_cli
from trainer.errors import ConfigError
from trainer.plan.estimate import CANDIDATES, estimate
from trainer.plan.inputs import build_inputs

P = 6_738_415_616            # Llama-2-7B parameters
LL = 32000 * 4096            # its largest module: the embedding (and the untied LM head)
GPUS = 8
BF16 = 2
# One forward without grad over a pair (2 sequences of 2048 tokens), bf16, MHA (no k/v expansion), padding mask:
# one layer's tensors s.b.(20h + 4h_kv + 8I + 4a + 8) + the bf16 mask e.b.s.s, and the logits kept in bf16 and
# upcast with their log-softmax in fp32, (2 + 8).s.b.V
TOKENS = 2048 * 2
ONE_LAYER = TOKENS * (20 * 4096 + 4 * 4096 + 8 * 11008 + 4 * 32 + 8) + BF16 * 2 * 2048 * 2048
FORWARD = ONE_LAYER + (BF16 + 8) * TOKENS * 32000


def candidate(name: str):
    return next(c for c in CANDIDATES if c.name == name)


def shot(task: str, reference: str, name: str, micro: int = 1, gpus: int = GPUS, checkpointing: bool = False):
    inputs = build_inputs({"model": "7b", "gpu": "a100-80g", "gpus_per_node": gpus, "task": task,
                           "reference": reference})
    return estimate(inputs, candidate(name), micro, checkpointing)


def test_a_frozen_engine_adds_its_16_bit_weights_sharded_like_zero3_inference():
    for stage in ("zero3", "zero3_cpu_optimizer"):
        assert shot("dpo", "engine", stage).reference == BF16 * P // GPUS + BF16 * LL + FORWARD
    assert shot("dpo", "engine", "zero2").reference == BF16 * P + FORWARD  # a whole copy below stage 3
    offloaded = shot("dpo", "engine", "zero3_cpu_offload")
    assert offloaded.reference == BF16 * LL + FORWARD  # on the CPU, one module gathered at a time
    alone = estimate(build_inputs({"model": "7b", "gpu": "a100-80g", "gpus_per_node": GPUS, "task": "full"}),
                     candidate("zero3_cpu_offload"), 1, False)
    assert offloaded.cpu_bytes_per_node - alone.cpu_bytes_per_node == int(BF16 * P * 1.5)  # DeepSpeed's 1.5x


def test_the_lora_base_as_reference_costs_only_a_forward():
    lora = shot("dpo-lora", "adapter", "zero2")
    assert lora.reference == FORWARD
    assert lora.gpu_total - lora.reference == shot("dpo-lora", "precomputed", "zero2").gpu_total


def test_precomputed_costs_nothing_while_training_and_prices_its_one_time_pass():
    engine, pre = shot("dpo", "engine", "zero3"), shot("dpo", "precomputed", "zero3")
    assert pre.reference == 0 and pre.gpu_total == engine.gpu_total - engine.reference
    states = pre.states.params + pre.states.gradients + pre.states.optimizer
    assert pre.precompute_pass == states + pre.buffers + BF16 * P // GPUS + BF16 * LL + FORWARD
    assert shot("dpo", "engine", "zero3").precompute_pass == 0


def test_a_micro_batch_of_pairs_holds_twice_the_sequences():
    pairs = shot("dpo", "precomputed", "zero2", micro=2)
    sequences = estimate(build_inputs({"model": "7b", "gpu": "a100-80g", "gpus_per_node": GPUS, "task": "full"}),
                         candidate("zero2"), 4, False)
    # the same 4 sequences, each batch with a padding mask (a fine-tune's SFT batches carry one too)
    assert pairs.activations.logits == sequences.activations.logits == 12 * 4 * 2048 * 32000
    assert pairs.activations.layers == sequences.activations.layers


@pytest.mark.slow
def test_plan_json_names_the_reference_and_says_why():
    proc = run_cli("plan", "--model", "7b", "--gpu", "a100-80g", "--gpus-per-node", "8", "--task", "dpo", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = json.loads(proc.stdout)
    assert plan["task"] == "dpo" and plan["reference"] in ("engine", "precomputed") and plan["sequences_per_sample"] == 2
    live = plan["choice"]["gpu_bytes"]["reference"]
    assert live == 0 if plan["reference"] == "precomputed" else live > BF16 * P  # a whole copy at ZeRO-2
    notes = " ".join(plan["notes"])
    assert "reference engine:" in notes and "reference precomputed:" in notes and "reference ->" in notes
    proc = run_cli("plan", "--model", "7b", "--gpu", "rtx4090", "--task", "dpo-lora", "--json")
    lora = json.loads(proc.stdout)
    assert lora["reference"] == "adapter" and lora["fits"]
    assert lora["choice"]["gpu_bytes"]["reference"] == FORWARD * lora["choice"]["micro_batch"]  # linear in pairs


@pytest.mark.parametrize("values, message", [
    ({"task": "dpo", "reference": "adapter"}, "needs LoRA: use --task dpo-lora"),
    ({"task": "full", "reference": "engine"}, "the reference model belongs to preference tuning"),
    ({"task": "dpo", "reference": "frozen"}, "--reference: 'frozen' is not one of auto, adapter, engine, precomputed"),
])
def test_reference_that_cannot_be_is_a_named_error(values, message):
    with pytest.raises(ConfigError, match=message):
        build_inputs({"model": "7b", "gpu": "a100-80g", **values})


def test_the_launch_line_runs_the_reference_the_plan_priced():
    """`plan --task dpo` keeps a frozen engine (71.0 GB per GPU with it); its launch line copies 7b_dpo_8xa100, whose
    reference is precomputed, and must set the engine back, or it runs (and lint prices) another config (57.3 GB)."""
    from trainer.plan.decide import make_plan
    from trainer.plan.estimate import gb, plan_for_resolved
    from trainer.presets import load_preset
    from trainer.resolve import resolve
    plan = make_plan(build_inputs({"model": "7b", "gpu": "a100-80g", "gpus_per_node": GPUS, "task": "dpo"}))
    assert plan.inputs.reference == "engine" and plan.preset == "7b_dpo_8xa100"
    launched = resolve(load_preset(plan.preset, plan.preset_overrides))
    assert launched.config.preference.reference == "engine"
    assert gb(plan_for_resolved(launched).gpu_total) == gb(plan.choice.gpu_total) == "71.0"
