"""trainer.plan.memory: parameter counts, DeepSpeed's model-state accounting, activations. Fast (no ranks), but for
the measurement of what DeepSpeed allocates on 2 CPU ranks.

The model-state sweep compares against the estimators of the installed DeepSpeed, for many sizes,
GPU counts, offload flags and zero.Init, with exact equality.
"""
from __future__ import annotations

import dataclasses

import itertools
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

from distributed import launch
from trainer.config import LoraConfig, ModelConfig
from trainer.plan import memory as mem
from trainer.plan.models import NAMED_MODELS
from trainer.presets import load_preset

SIZES = [(1_000_003, 50_000), (124_439_808, 38_597_376), (1_235_814_400, 262_668_288),
         (6_738_415_616, 131_072_000), (13_015_864_320, 163_840_000), (68_976_648_192, 262_144_000),
         (175_000_000_000, 1_207_959_552), (1_000_000_000_007, 3_221_225_472)]
GPUS_PER_NODE = [1, 2, 3, 4, 8, 16]
NODES = [1, 2, 3, 4, 32]


@pytest.fixture(scope="module")
def deepspeed_estimators():
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    return estimate_zero2_model_states_mem_needs, estimate_zero3_model_states_mem_needs


def test_zero2_matches_deepspeed_exactly(deepspeed_estimators):
    zero2, _ = deepspeed_estimators
    for (params, _), g, n, offload in itertools.product(SIZES, GPUS_PER_NODE, NODES, (False, True)):
        expected = zero2(params, num_gpus_per_node=g, num_nodes=n, cpu_offload=offload)
        assert mem.zero2_model_states(params, g, n, offload) == expected, (params, g, n, offload)
        ours = mem.model_states(params, 0, 2, g, n, offload_optimizer=offload)
        assert (ours.cpu_bytes, ours.gpu_bytes) == expected
        assert ours.params + ours.gradients + ours.optimizer + ours.working == ours.gpu_bytes


def test_zero3_matches_deepspeed_exactly(deepspeed_estimators):
    _, zero3 = deepspeed_estimators
    offloads = [(False, False), (True, False), (True, True)]
    for (params, largest), g, n, (opt, par), init in itertools.product(SIZES, GPUS_PER_NODE, NODES, offloads,
                                                                         (True, False)):
        expected = zero3(params, largest, num_gpus_per_node=g, num_nodes=n, cpu_offload=opt,
                         cpu_offload_params=par, zero_init=init)
        assert mem.zero3_model_states(params, largest, g, n, opt, par, init) == expected, (params, g, n, opt, par)
        ours = mem.model_states(params, largest, 3, g, n, offload_optimizer=opt, offload_param=par, zero_init=init)
        assert (ours.cpu_bytes, ours.gpu_bytes, ours.working) == expected
        assert ours.params + ours.gradients + ours.optimizer + ours.working == ours.gpu_bytes


def test_stages_0_and_1_use_the_same_bytes_per_param():
    for (params, _), g, n in itertools.product(SIZES, GPUS_PER_NODE, NODES):
        zero0 = mem.model_states(params, 0, 0, g, n)
        zero1 = mem.model_states(params, 0, 1, g, n)
        one_gpu_zero2 = mem.zero2_model_states(params, 1, 1, False)[1]
        assert zero0.gpu_bytes == one_gpu_zero2 == 20 * params  # 2 + 18: nothing sharded
        assert zero1.gpu_bytes == 4 * params + int(4 * params / (g * n)) + int(12 * params / (g * n))
        assert zero0.cpu_bytes == zero1.cpu_bytes == mem.zero2_model_states(params, g, n, False)[0]
    assert mem.model_states(10**9, 0, 1, 1, 1).gpu_bytes == mem.model_states(10**9, 0, 2, 1, 1).gpu_bytes


def test_seed_16_bytes_per_param_and_160_gb_for_10b():
    table = mem.seed_sharding_formula(10 * 10**9, stage=0, gpus=8)
    assert table == {"params": 20e9, "gradients": 20e9, "optimizer": 120e9, "total": 160e9}


@pytest.mark.parametrize("stage, expected_gb", [(1, 20 + 20 + 120 / 8), (2, 20 + (20 + 120) / 8), (3, 160 / 8)])
def test_seed_per_stage_sharding_formulas(stage, expected_gb):
    assert mem.seed_sharding_formula(10 * 10**9, stage, gpus=8)["total"] == pytest.approx(expected_gb * 1e9)


@pytest.mark.parametrize("preset, params", [("7b_8xa100", 6_738_415_616), ("70b_8xa100", 68_976_648_192),
                                            ("1b_pretrain_8xh100", 1_235_814_400), ("tiny_cpu", 3_426_560)])
def test_param_counts_of_preset_architectures(preset, params):
    assert mem.count_params(load_preset(preset).model) == params


def test_named_sizes_match_their_published_counts():
    counts = {name: mem.count_params(config) for name, (_, config) in NAMED_MODELS.items()}
    assert counts["7b"] == 6_738_415_616
    assert counts["13b"] == 13_015_864_320
    assert counts["70b"] == 68_976_648_192
    assert counts["8b"] == 8_030_261_248          # Llama-3.1-8B
    assert counts["1b"] == 1_235_814_400          # Llama-3.2-1B (tied embeddings)
    assert counts["30b"] == 32_528_943_616        # LLaMA-30B


TINY_SHAPES = [
    dict(family="llama", tie=False, kv=4), dict(family="llama", tie=True, kv=2), dict(family="llama", tie=False, kv=1),
    dict(family="qwen2", tie=False, kv=2),
]


@pytest.mark.parametrize("shape", TINY_SHAPES, ids=lambda s: f"{s['family']}-tie{s['tie']}-kv{s['kv']}")
def test_counts_and_largest_layer_match_a_real_model(shape):
    from deepspeed.runtime.zero.stage3 import model_to_params
    from transformers import AutoConfig, AutoModelForCausalLM
    m = ModelConfig(family=shape["family"], hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=shape["kv"],
                    intermediate_size=200, vocab_size=300, max_position_embeddings=64,
                    tie_word_embeddings=shape["tie"])
    hf = AutoConfig.for_model(shape["family"], hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                              num_key_value_heads=shape["kv"], intermediate_size=200, vocab_size=300,
                              max_position_embeddings=64, tie_word_embeddings=shape["tie"])
    model = AutoModelForCausalLM.from_config(hf)
    total, largest = model_to_params(model)  # DeepSpeed's own definitions
    assert mem.count_params(m) == total == sum(p.numel() for p in model.parameters())
    assert mem.largest_layer_params(m) == largest


def test_llama2_7b_on_the_meta_device():
    from transformers import LlamaConfig, LlamaForCausalLM
    _, m = NAMED_MODELS["7b"]
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                             intermediate_size=11008, vocab_size=32000))
    assert sum(p.numel() for p in model.parameters()) == mem.count_params(m) == 6_738_415_616
    largest = max(sum(p.numel() for p in mod.parameters(recurse=False)) for mod in model.modules())
    assert largest == mem.largest_layer_params(m) == 32000 * 4096  # the embedding, not an MLP projection


def test_lora_adapter_count_matches_peft():
    from peft import LoraConfig as PeftLoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM
    m = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=160,
                    vocab_size=128, max_position_embeddings=64)
    for targets in (["q_proj", "k_proj", "v_proj", "o_proj"], ["q_proj", "v_proj", "gate_proj", "down_proj"]):
        lora = LoraConfig(r=8, target_modules=targets)
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                             num_key_value_heads=2, intermediate_size=160, vocab_size=128))
        peft_model = get_peft_model(model, PeftLoraConfig(r=8, target_modules=targets))
        trainable = sum(p.numel() for p in peft_model.parameters() if p.requires_grad)
        assert mem.lora_params(m, lora) == trainable
    assert mem.lora_params(NAMED_MODELS["7b"][1], LoraConfig(r=16)) == 32 * 4 * 16 * (4096 + 4096)


def _saved_activation_bytes(m: ModelConfig, dtype, checkpointing: bool, attention: str, seq: int, batch: int,
                            padded: int = 0) -> int:
    """Bytes of the distinct tensors autograd saves for backward (parameters excluded)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=m.hidden_size, num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads,
        num_key_value_heads=m.num_kv_heads, intermediate_size=m.intermediate_size, vocab_size=m.vocab_size,
        max_position_embeddings=m.max_position_embeddings, use_cache=False, attn_implementation=attention)).to(dtype)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    ids = torch.randint(0, m.vocab_size, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[-1, seq - padded:] = 0  # the last row ends in `padded` pad tokens (an SFT batch); 0: no mask passed
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids, attention_mask=mask if padded else None)
    return sum(saved.values())


@pytest.mark.parametrize("dtype, checkpointing, attention, tolerance", [
    (torch.bfloat16, False, "sdpa", 0.02), (torch.float32, False, "sdpa", 0.02),
    (torch.bfloat16, True, "sdpa", 0.02), (torch.bfloat16, False, "eager", 0.05)])
def test_activation_formula_matches_what_autograd_saves(dtype, checkpointing, attention, tolerance):
    """The formula's saved set (layers, final norm, fp32 log-softmax output) against a real CPU forward.

    Checkpointing's recomputed layer and the loss-side gradient are backward transients, not saved tensors."""
    m = ModelConfig(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=688,
                    vocab_size=1024, max_position_embeddings=512)
    seq, batch = 128, 2
    precision = "fp32" if dtype == torch.float32 else "bf16"
    planned = mem.activation_bytes(m, seq, batch, checkpointing, precision, attention)
    recomputed = mem.layer_activation_bytes(m, seq, batch, precision, attention) if checkpointing else 0
    saved_part = planned.layers - recomputed + 4 * seq * batch * m.vocab_size  # + log-softmax output
    measured = _saved_activation_bytes(m, dtype, checkpointing, attention, seq, batch)
    assert measured == pytest.approx(saved_part, rel=tolerance)


@pytest.mark.parametrize("kv_heads", [2, 4], ids=["gqa", "mha"])
def test_padding_mask_terms_match_what_autograd_saves(kv_heads):
    """sdpa under a padding mask: k/v repeated to all heads (GQA only) and a per-layer mask in the model's
    dtype, exactly the extra bytes a real CPU forward saves (transformers' repeat_kv path, torch's mask cast)."""
    m = ModelConfig(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=kv_heads, intermediate_size=688,
                    vocab_size=1024, max_position_embeddings=512)
    seq, batch = 128, 2
    unmasked = _saved_activation_bytes(m, torch.bfloat16, False, "sdpa", seq, batch)
    masked = _saved_activation_bytes(m, torch.bfloat16, False, "sdpa", seq, batch, padded=28)
    planned = (mem.activation_bytes(m, seq, batch, False, "bf16", "sdpa", padding_mask=True).layers
               - mem.activation_bytes(m, seq, batch, False, "bf16", "sdpa").layers)
    assert planned > 0 and masked - unmasked == planned
    expansion = 2 * seq * batch * 2 * (256 - kv_heads * 64) * m.num_layers
    assert planned == expansion + 2 * batch * seq * seq * m.num_layers


def test_activations_flash_never_store_the_score_matrix_and_checkpointing_shrinks_them():
    _, m = NAMED_MODELS["7b"]
    sdpa = mem.layer_activation_bytes(m, 4096, 1)
    eager = mem.layer_activation_bytes(m, 4096, 1, attention="eager")
    assert eager - sdpa == 4096 * 32 * 4096 * 6  # a.s.s.(4 + 2) bytes per sequence
    full = mem.activation_bytes(m, 2048, 1, checkpointing=False)
    ckpt = mem.activation_bytes(m, 2048, 1, checkpointing=True)
    assert ckpt.layers < full.layers / 10
    assert full.logits == ckpt.logits == 12 * 2048 * 32000
    # Per layer and token, 16-bit: 20h + 4h_kv + 8I + 4a + 8 bytes (the module docstring's formula).
    assert mem.layer_activation_bytes(m, 1, 1) == 20 * 4096 + 4 * 4096 + 8 * 11008 + 4 * 32 + 8


@pytest.mark.multirank
@pytest.mark.parametrize("stage", [2, 3])
def test_fp32_accounting_is_what_deepspeed_allocates(stage, tmp_path):
    """scripts/measure_memory.py on tiny_cpu shrunk to 2 layers, 2 CPU ranks, fp32: the bytes the engine's ZeRO
    optimizer holds (params, gradient partitions, fp32 master weights and Adam moments) are the planner's, and
    what it holds of the reduce buckets is within the planner's bucket allowance."""
    report = tmp_path / "memory.json"
    launch(["scripts/measure_memory.py", "--preset", "tiny_cpu", "--stage", str(stage), "--json", str(report)])
    result = json.loads(report.read_text())
    assert (result["stage"], result["precision"], result["world"]) == (stage, "fp32", 2)
    measured, planned = result["measured"], result["planned"]
    assert (measured["params"], measured["optimizer"]) == (planned["params"], planned["optimizer"]), result
    # ZeRO-1/2 size the gradient buffer by whole parameters: the one straddling the partition boundary is held
    # whole (DeepSpeed's estimator, and so the planner, count the exact partition)
    straddle = result["straddle_bytes"] if stage < 3 else 0
    assert planned["gradients"] <= measured["gradients"] <= planned["gradients"] + straddle, result
    assert measured["buffers"] <= planned["buffers"], result  # what it holds of the reduce buckets


def test_lora_states_keep_the_frozen_base_in_16_bit():
    _, m = NAMED_MODELS["7b"]
    base, adapters = mem.count_params(m), mem.lora_params(m, LoraConfig(r=16))
    one_gpu = mem.lora_model_states(base, adapters, mem.largest_layer_params(m), 0, 1, 1, False, False)
    assert one_gpu.gpu_bytes == 2 * base + 20 * adapters
    sharded = mem.lora_model_states(base, adapters, mem.largest_layer_params(m), 3, 8, 1, False, False)
    assert sharded.params == int(2 * adapters / 8) + int(2 * base / 8)


def test_nvme_and_hpz_bytes():
    assert mem.nvme_offload_bytes(10**9, 2) == int(18 * 10**9 / 2 * 1.5)
    assert mem.nvme_offload_bytes(10**9, 1, optimizer=True, params=False) == int(16 * 10**9 * 1.5)
    assert mem.hpz_secondary_bytes(68_976_648_192, 8, "bf16") == int(2 * 68_976_648_192 / 8)
    assert mem.hpz_secondary_bytes(10**9, 1, "bf16") == 0


def test_fp32_offload_puts_the_optimizer_states_in_host_ram():
    """fp32 + CPU offload (e.g. a V100 preset in fp32): what leaves the GPU is counted on the host, per node,
    with DeepSpeed's 1.5x host factor: 16 bytes per parameter of each rank's partition (gradient partition,
    fp32 master, Adam moments), +4 with parameters offloaded at stage 3. It used to count nothing there."""
    P, LL, per_node, nodes = 7_000_000_000, 262_000_000, 2, 2
    gpus = per_node * nodes
    zero2 = mem.model_states(P, LL, 2, per_node, nodes, offload_optimizer=True, precision="fp32")
    assert zero2.gpu_bytes == 4 * P                                     # only the fp32 params stay
    assert zero2.cpu_bytes == int(16 * P / gpus * per_node * 1.5)
    zero3 = mem.model_states(P, LL, 3, per_node, nodes, offload_optimizer=True, offload_param=True, precision="fp32")
    assert zero3.cpu_bytes == int(20 * P / gpus * per_node * 1.5)
    assert zero3.gpu_bytes == 8 * LL                                    # one gathered module
    # without offload the host holds what each rank loads before partitioning (one layer under zero.Init)
    plain = mem.model_states(P, LL, 2, per_node, nodes, precision="fp32")
    assert plain.cpu_bytes == int(4 * P * per_node * 1.5)
    assert mem.model_states(P, LL, 3, per_node, nodes, precision="fp32").cpu_bytes == int(4 * LL * per_node * 1.5)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_activation_formula_matches_what_autograd_saves(family, dtype):
    """An MoE layer saves, per token, k experts' dispatched inputs and SwiGLU tensors plus the router's softmax and
    top-k (plan.memory.moe_bytes_per_token); Qwen3-MoE adds its q/k norms. Against a real CPU forward of
    transformers' model with 8 experts, top-2."""
    from transformers import AutoConfig, AutoModelForCausalLM
    m = ModelConfig(family=family, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
                    vocab_size=1024, max_position_embeddings=512, num_experts=8, num_experts_per_tok=2)
    extra = {"moe_intermediate_size": 128, "head_dim": 64} if family == "qwen3_moe" else {}
    config = AutoConfig.for_model(family, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=128, vocab_size=1024,
                                  max_position_embeddings=512, use_cache=False, attn_implementation="sdpa",
                                  num_experts=8, num_experts_per_tok=2, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    seq, batch = 128, 2
    ids = torch.randint(0, m.vocab_size, (batch, seq))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    precision = "fp32" if dtype == torch.float32 else "bf16"
    planned = mem.activation_bytes(m, seq, batch, False, precision, "sdpa").layers + 4 * seq * batch * m.vocab_size
    dense = dataclasses.replace(m, family="llama", num_experts=None, num_experts_per_tok=None)
    assert sum(saved.values()) == pytest.approx(planned, rel=0.02)
    assert planned > mem.activation_bytes(dense, seq, batch, False, precision, "sdpa").layers  # k experts > 1 MLP
