"""The planner under long contexts: DeepSpeed Ulysses sequence parallelism (SP) when one sequence's activations fit
no GPU, its memory (every activation outside attention held s/sp tokens per GPU), its all-to-all, and its DeepSpeed
config (`sequence_parallel_size`, the batch triad over world / sp data-parallel ranks)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from trainer import ds as dsc
from trainer.config import ModelConfig
from trainer.errors import ConfigError
from trainer.plan import memory as mem
from trainer.plan.decide import OFFLOADED, ON_GPU, make_plan, offloads
from trainer.plan.estimate import CANDIDATES, best_shot, estimate
from trainer.resolve import alst_mlp_tiles, auto_logits_tiles, even_tiles
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
    # one sequence per GPU fits only with an offloaded optimizer (tiling counted), which 100 GB of host RAM rules out
    result = run_cli("plan", "--model", "8b", "--gpu", "h100-80g", "--gpus-per-node", "8", "--seq-len", "131072",
                     "--sequence-parallel", "1", "--cpu-ram-gb", "100")
    assert result.returncode == 1
    best = plan_to_json(make_plan(build_inputs({**LONG, "cpu_ram_gb": 100})))["sequence_parallel_size"]
    assert best > 1
    assert f"--sequence-parallel {best}" in result.stdout


def test_the_global_batch_counts_data_parallel_groups_not_gpus():
    inputs = dataclasses.replace(build_inputs({**LONG, "global_batch": 8}), sequence_parallel=None)
    plan = make_plan(inputs)
    sp = plan.inputs.sp
    assert sp > 1 and plan.global_batch == 8 and plan.grad_accum * plan.choice.micro_batch * (8 // sp) == 8


# --- tiled compute (DeepSpeed ALST's TiledMLP and TiledFusedLogitsLoss) as the trainer runs it ---------------------

TINY = ModelConfig(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=688, vocab_size=1024,
                   max_position_embeddings=1024)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=TINY.hidden_size, num_hidden_layers=TINY.num_layers, num_attention_heads=TINY.num_heads,
        num_key_value_heads=TINY.num_kv_heads, intermediate_size=TINY.intermediate_size, vocab_size=TINY.vocab_size,
        max_position_embeddings=TINY.max_position_embeddings, use_cache=False,
        attn_implementation="sdpa")).to(torch.bfloat16).train()


def _saved_bytes(step, excluded: set[int]) -> tuple[dict[int, int], list[int]]:
    """What autograd saves while `step(phase)` runs: {storage: bytes} saved in the forward (distinct storages, all
    alive at its end) and the bytes of every new tensor saved in the backward (recomputed pieces, each freed before
    the next). `excluded`: storages that are no activation (weights, inputs)."""
    forward, backward, phase = {}, [], ["forward"]

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() in excluded:
            pass
        elif phase[0] == "forward":
            forward[storage.data_ptr()] = storage.nbytes()
        elif not t._is_view():  # a view in backward: of a tensor the forward saved (freed ones' addresses are reused)
            backward.append(storage.nbytes())
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(phase)
    return forward, backward


@pytest.mark.slow  # bf16 autograd on CPU at 512 tokens, twice: ~8 s, the quick tier's slowest test
def test_a_tiled_mlp_keeps_no_swiglu_tensors_and_one_tile_of_them_at_a_time_as_autograd_does():
    """trainer.train.sequence_parallel.tile_mlps (DeepSpeed's TiledMLP) on a CPU Llama: each layer saves only the
    MLP's input (the RMSNorm output the formula counts already), and backward recomputes one tile's SwiGLU tensors
    at a time: the planner's layers and its one tile (plan.memory.mlp_tile_bytes)."""
    from trainer.train.sequence_parallel import tile_mlps
    seq, batch, tiles = 512, 1, 4
    ids = torch.randint(0, TINY.vocab_size, (batch, seq))
    measured = {}
    for tiled in (False, True):
        model = _tiny_llama()
        assert tile_mlps(model, tiles if tiled else 0) == (TINY.num_layers if tiled else 0)

        def step(phase):
            loss = model(input_ids=ids, labels=ids).loss
            phase[0] = "backward"
            loss.backward()
        measured[tiled] = _saved_bytes(step, {p.untyped_storage().data_ptr() for p in model.parameters()})
    planned = mem.activation_bytes(TINY, seq, batch, False, "bf16", "sdpa", mlp_tiles=tiles)
    one_tile = mem.mlp_tile_bytes(TINY, seq, batch, tiles, "bf16")
    log_softmax = 4 * seq * batch * TINY.vocab_size  # saved by the untiled loss (a backward transient is not)
    saved_forward = sum(measured[True][0].values())
    assert saved_forward == pytest.approx(planned.layers - one_tile + log_softmax, rel=0.02)
    untiled = mem.activation_bytes(TINY, seq, batch, False, "bf16", "sdpa")
    swiglu = sum(measured[False][0].values()) - saved_forward
    assert swiglu == pytest.approx(untiled.layers - planned.layers + one_tile, rel=0.02)  # what tiling dropped
    assert measured[False][1] == []  # untiled: backward recomputes nothing
    recomputed = measured[True][1]  # every layer's tiles, one after another: each tile's share equal
    assert sum(recomputed) == pytest.approx(TINY.num_layers * tiles * one_tile, rel=0.02)


def test_tiled_logits_hold_one_tiles_fp32_logits_and_the_hidden_states_gradient_as_autograd_does():
    """DeepSpeed's TiledFusedLogitsLoss with the trainer's tile loss (train.sequence_parallel.tiled_loss_sum): it
    keeps the hidden states' gradient (filled tile by tile in forward) for backward, and each tile saves its fp32
    log-softmax, one of the three fp32 tensors of its logits the formula counts (logits, log-softmax, gradient)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss
    seq, batch, tiles = 512, 2, 4
    torch.manual_seed(0)
    head = torch.nn.Linear(TINY.hidden_size, TINY.vocab_size, bias=False).to(torch.bfloat16)
    hidden = torch.randn(batch, seq, TINY.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, TINY.vocab_size, (batch, seq))

    def tile_loss(head, x, y):
        return F.cross_entropy(head(x).float(), y, reduction="sum")

    def step(phase):
        loss = TiledFusedLogitsLoss.apply(tile_loss, head, hidden, labels, None, tiles, [head.weight], "sum")
        phase[0] = "backward"
        loss.backward()
    excluded = {t.untyped_storage().data_ptr() for t in (head.weight, hidden, labels)}
    forward, backward = _saved_bytes(step, excluded)
    hidden_gradient = 2 * batch * seq * TINY.hidden_size
    tile_logits = 4 * batch * seq // tiles * TINY.vocab_size  # one tile's fp32 log-softmax
    assert hidden_gradient in forward.values() and backward == []
    per_tile = max(forward.values())  # a tile's log-softmax (each freed before the next: its address may repeat)
    assert per_tile == pytest.approx(tile_logits, rel=0.01)
    planned = mem.logits_bytes(TINY, seq, batch, "bf16", tiles=tiles)
    assert planned == pytest.approx(hidden_gradient + 3 * per_tile, rel=0.02)
    assert planned < mem.logits_bytes(TINY, seq, batch, "bf16") / 3  # against the whole micro-batch's logits


def test_the_128k_plan_counts_the_trainers_tiled_logits_and_says_so():
    plan = plan_to_json(make_plan(build_inputs(LONG)))
    sp, choice = plan["sequence_parallel_size"], plan["choice"]
    inputs = build_inputs({**LONG, "sequence_parallel": sp})
    m = inputs.model.config
    # the trainer's own "auto" (resolve.auto_logits_tiles), made even as the tiled loss runs it
    assert choice["tiled_logits"] == even_tiles(131072 // sp, auto_logits_tiles(m, 131072, sp, 1, "bf16", "sft")) > 1
    assert any("model.tiled_logits auto" in note for note in plan["notes"])
    untiled = estimate(inputs, next(c for c in CANDIDATES if c.name == choice["name"]), 1, True, logits_tiles=0)
    assert choice["gpu_bytes"]["activations"] < untiled.activations.total


def test_tiling_alone_fits_a_32k_sequence_on_one_gpu_without_offload():
    """8B at 32k on 8 H100: without tiling no candidate that keeps the optimizer on the GPU fits one sequence per
    GPU; with the trainer's tiled logits (and tiled MLPs where checkpointing alone does not fit) one does, so the
    plan needs neither sequence parallelism nor offload."""
    inputs = build_inputs({**LONG, "seq_len": 32768})
    plan = make_plan(inputs)
    assert plan.inputs.sp == 1 and not offloads(plan.choice.candidate) and plan.choice.logits_tiles > 1
    assert not any(estimate(inputs, c, 1, True, logits_tiles=0).fits for c in ON_GPU)
    assert "sequence_parallel_size" not in plan.deepspeed


def test_sequence_parallelism_is_tried_before_an_offloaded_optimizer():
    """At 128k one sequence per GPU fits only with the optimizer on the CPU; the planner takes Ulysses on the GPU
    instead, and gives the offload when the size is fixed at 1. (Pretraining: a fine-tune's padding mask at 128k
    tokens, (s, s) per layer under sdpa, fits no GPU at SP 1 even with the optimizer offloaded.)"""
    inputs = build_inputs({**LONG, "task": "pretrain"})
    assert any(best_shot(inputs, c, 1).fits for c in OFFLOADED)
    assert not any(best_shot(inputs, c, 1).fits for c in ON_GPU)
    plan = make_plan(inputs)
    assert plan.inputs.sp > 1 and not offloads(plan.choice.candidate)
    assert any(line.startswith(f"sequence parallel {plan.inputs.sp} before zero") and "_cpu_" in line
               for line in plan.walk), plan.walk
    fixed = make_plan(build_inputs({**LONG, "task": "pretrain", "sequence_parallel": 1}))
    assert fixed.inputs.sp == 1 and offloads(fixed.choice.candidate)


def test_a_plan_that_needs_tiled_mlps_puts_them_in_the_launch_line():
    """8B at 128k on one H100: with checkpointing and the optimizer on the CPU the MLPs' SwiGLU tensors still do not
    fit, so the plan tiles them (ALST's tiles of ~hidden_size tokens) and its launch line sets model.tiled_mlp."""
    inputs = build_inputs({**LONG, "gpus_per_node": 1})
    plan = make_plan(inputs)
    tiles = plan.choice.mlp_tiles
    assert tiles == alst_mlp_tiles(4096, 131072, 1, 1) == 32
    assert not estimate(inputs, plan.choice.candidate, 1, True).fits  # checkpointing alone
    assert any(f"model.tiled_mlp={tiles}" in note for note in plan.notes)
    assert f"model.tiled_mlp={tiles}" in plan.launch
