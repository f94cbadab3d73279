"""Activation checkpoint offload (DeepSpeed's activation_checkpointing.cpu_checkpointing, ALST's "checkpoint offload
to CPU"): what DeepSpeed's offload engine moves to host memory is what the planner counts, the gradients do not
change, and the planner turns it on only when nothing fits without it, in a launch line that resolves to the
same estimate. Training with it under sequence parallelism: tests/test_sequence_parallel.py."""
from __future__ import annotations

import json
import os
import shlex
import sys

import pytest

from trainer import ds as dsc
from trainer.config import ModelConfig
from trainer.plan import memory as mem
from trainer.plan.decide import make_plan
from trainer.plan.estimate import plan_for_resolved
from trainer.plan.inputs import build_inputs
from trainer.presets import load_preset
from trainer.resolve import resolve
from distributed import REPO, ensure_ops_built, new_port
from processes import run_group

# Llama-3.1-8B's architecture with room for millions of positions (a longer context is a rope-scaling change, not a
# memory question), as scripts/plan_long_context.py plans it
LLAMA_8B = {"hidden_size": 4096, "num_layers": 32, "num_heads": 32, "num_kv_heads": 8, "intermediate_size": 14336,
            "vocab_size": 128256, "max_position_embeddings": 1 << 25}
MILLIONS = {"model": LLAMA_8B, "gpu": "h100-80g", "gpus_per_node": 8, "seq_len": 2 * 1024 * 1024}


@pytest.mark.slow
@pytest.mark.parametrize("layers, micro, seq", [(4, 2, 32), (3, 1, 48)])
def test_deepspeed_offloads_what_the_planner_counts_and_the_gradients_do_not_change(layers, micro, seq):
    ensure_ops_built()
    env = {**os.environ, "PYTHONPATH": str(REPO), "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(new_port())}
    proc = run_group([sys.executable, "tests/workers/checkpoint_offload.py", str(layers), str(micro), str(seq)],
                     cwd=REPO, env=env, timeout=300, merge=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    model = ModelConfig(hidden_size=64, num_layers=layers, num_heads=4, intermediate_size=128, vocab_size=256)
    counted = mem.activation_bytes(model, seq, micro, True, "fp32", checkpoint_offload=True)
    assert seen["offloaded_bytes"] == counted.host == (layers - 1) * micro * seq * 64 * 4
    assert seen["restored_bytes"] == seen["offloaded_bytes"] and seen["kept_last_tensors"] == 1
    on_gpu = mem.activation_bytes(model, seq, micro, True, "fp32")
    assert on_gpu.total - counted.total == (layers - mem.OFFLOAD_KEPT_INPUTS) * micro * seq * 64 * 4
    assert seen["loss_difference"] == 0 and seen["grad_difference"] == 0


def test_the_planner_offloads_checkpoints_only_when_nothing_fits_without():
    """2M tokens of an 8B model on 8 H100s: no candidate fits at any sequence-parallel size with the checkpoints on
    the GPU; with them in host memory one does, and the plan says what it costs. 128k needs no offload."""
    assert make_plan(build_inputs({**MILLIONS, "checkpoint_offload": False})).choice is None
    plan = make_plan(build_inputs(MILLIONS))
    assert plan.choice is not None and plan.choice.checkpoint_offload and plan.choice.checkpointing
    assert dsc.cpu_checkpointing(plan.deepspeed) and dsc.check_keys(plan.deepspeed) == []
    assert any("planning again with them in host memory" in line for line in plan.walk)
    host = plan.choice.activations.host
    assert host == (32 - 1) * 2 * 4096 * (MILLIONS["seq_len"] // plan.inputs.sp)
    assert any(note.startswith("activation checkpoint offload") and f"{host / 1e9:.1f} GB per GPU" in note
               for note in plan.notes)
    assert "activation_checkpointing.cpu_checkpointing=true" in plan.launch
    short = make_plan(build_inputs({**MILLIONS, "seq_len": 131072}))
    assert short.choice is not None and not short.choice.checkpoint_offload
    assert not dsc.cpu_checkpointing(short.deepspeed)


def test_offloaded_checkpoints_must_fit_host_memory():
    plan = make_plan(build_inputs(MILLIONS))
    need = plan.choice.cpu_bytes_per_node / 1e9
    small = make_plan(build_inputs({**MILLIONS, "cpu_ram_gb": need / 2}))
    assert small.choice is None or small.choice.cpu_bytes_per_node <= need / 2 * 1e9
    roomy = make_plan(build_inputs({**MILLIONS, "cpu_ram_gb": need * 2}))
    assert roomy.choice is not None and roomy.choice.checkpoint_offload


def test_the_launch_line_resolves_to_the_estimate_the_plan_chose():
    """The plan's --set items on its nearest preset resolve to a config the planner prices as it chose: the offload
    is read back from deepspeed.activation_checkpointing.cpu_checkpointing, not assumed."""
    plan = make_plan(build_inputs(MILLIONS))
    assert plan.choice.checkpoint_offload
    words = shlex.split(plan.launch)
    preset = words[words.index("--preset") + 1]
    overrides = [words[i + 1] for i, word in enumerate(words) if word == "--set"]
    resolved = resolve(load_preset(preset, overrides), world_size=8)
    assert dsc.cpu_checkpointing(resolved.ds)
    again = plan_for_resolved(resolved)
    assert again.checkpoint_offload and again.activations == plan.choice.activations  # buffers: the preset's own


def test_forcing_and_forbidding_it_are_flags_and_contradictions_are_named():
    forced = make_plan(build_inputs({**MILLIONS, "seq_len": 131072, "checkpoint_offload": True}))
    assert forced.choice.checkpoint_offload or not forced.choice.checkpointing
    with pytest.raises(Exception, match="moves activation checkpoints to host memory"):
        build_inputs({**MILLIONS, "checkpoint_offload": True, "activation_checkpointing": False})
