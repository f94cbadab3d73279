"""`python -m trainer plan --inference`: the KV cache and weights it prices are the ones transformers and
DeepSpeed really allocate, the placement follows the numbers, and bad flags are clear errors.

The fast tests build tiny models on the CPU; the `multirank` ones launch DeepSpeed on 2 CPU ranks once
(AutoTP's real split, and the ZeRO-Inference configs generating the plain model's tokens)."""
from __future__ import annotations

import json
import math

import pytest
import torch

from distributed import launch, run_cli
from trainer import ds as dsc
from trainer.__main__ import main
from trainer.config import ModelConfig
from trainer.model import hf_config
from trainer.plan import memory as mem
from trainer.plan.inference import (
    autotp_rank_params, choose_placement, inference_memory, kv_cache_bytes, shard_size,
)
from trainer.plan.inference_inputs import build_inference_inputs
from trainer.plan.inference_plan import make_inference_plan
from trainer.plan.models import NAMED_MODELS

GB = 10**9
# Tiny architectures: MHA and GQA, a tied head, Qwen2's q/k/v biases, an MLP width that is not a
# multiple of 64 x tp (AutoTP gives the tail to the last rank) and a hidden size of one 64-grain.
ARCHITECTURES = {
    "gqa": dict(hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=176, vocab_size=96,
                max_position_embeddings=128),
    "mha_tied": dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=128,
                     vocab_size=96, max_position_embeddings=128, tie_word_embeddings=True),
    "qwen2_bias": dict(family="qwen2", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                       intermediate_size=256, vocab_size=96, max_position_embeddings=128),
}


def tiny(name: str, dtype=torch.float32):
    config = ModelConfig(**ARCHITECTURES[name])
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    return config, AutoModelForCausalLM.from_config(hf_config(config, "sdpa")).to(dtype).eval()


@pytest.mark.parametrize("name", ["gqa", "mha_tied", "qwen2_bias"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_kv_cache_is_the_cache_transformers_builds(name, dtype):
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    config, model = tiny(name, torch_dtype)
    batch, context = 3, 17
    with torch.no_grad():
        out = model(torch.randint(0, config.vocab_size, (batch, context)), use_cache=True)
    cache = out.cache if "cache" in out else out.past_key_values
    real = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert kv_cache_bytes(config, batch, context, dtype) == real
    assert inference_memory(config, batch, context, dtype).kv_cache == real


@pytest.mark.parametrize("name", ["gqa", "mha_tied", "qwen2_bias"])
def test_weights_at_tp1_are_the_models_parameter_bytes(name):
    config, model = tiny(name)
    real = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied weight once
    assert inference_memory(config, 1, 8, "fp32").weights == real
    assert inference_memory(config, 1, 8, "bf16").weights == real // 2


@pytest.mark.parametrize("model", ["7b", "8b", "70b", "30b"])
@pytest.mark.parametrize("tp", [2, 3, 4, 8])
def test_shard_sizes_are_deepspeeds(model, tp):
    """Our copy of AutoTP's split rule against DeepSpeed's own `get_shard_size`, for every dimension AutoTP
    splits (attention by kv heads, MLP and LM head in 64-grains), on every rank."""
    from deepspeed.module_inject.tp_shard import AutoTPMeta, get_shard_size
    m = NAMED_MODELS[model][1]
    kv_heads = m.num_kv_heads or m.num_heads
    meta = AutoTPMeta(num_kv_heads=kv_heads, num_attention_heads=m.num_heads, n_embd=m.hidden_size,
                      tp_grain_size=64)
    dims = {"self_attn.q_proj": (m.hidden_size, kv_heads), "self_attn.k_proj": (mem.kv_width(m), kv_heads),
            "mlp.gate_proj": (m.intermediate_size, None), "lm_head": (m.hidden_size, None)}
    for name, (total, heads) in dims.items():
        ours = [shard_size(total, tp, rank, heads) for rank in range(tp)]
        assert ours == [get_shard_size(total, tp, meta, name, rank) for rank in range(tp)], name
        assert sum(ours) == total


@pytest.fixture(scope="module")
def deepspeed_report(tmp_path_factory):
    root = tmp_path_factory.mktemp("inference")
    (root / "nvme").mkdir()
    spec = root / "spec.json"
    spec.write_text(json.dumps({"architectures": ARCHITECTURES, "zero_model": "gqa", "nvme_dir": str(root / "nvme"),
                                "report": str(root / "report.json")}))
    launch(["tests/workers/inference_memory.py", str(spec)], timeout=900)
    return json.loads((root / "report.json").read_text())


@pytest.mark.multirank
@pytest.mark.parametrize("name", ["gqa", "mha_tied", "qwen2_bias"])
def test_weights_at_tp2_are_what_autotp_leaves_on_each_rank(deepspeed_report, name):
    """Measured: `deepspeed.init_inference(tp_size=2)` on 2 CPU ranks, each rank's parameters counted. The
    ranks differ (the MLP tail on the last rank; a one-grain LM head on the first), and a tied LM head is
    cloned, so both ranks hold the whole embedding as well as their part of the head."""
    config = ModelConfig(**ARCHITECTURES[name])
    real = deepspeed_report["autotp"][name]
    assert autotp_rank_params(config, 2) == real
    assert inference_memory(config, 1, 8, "fp32", tp=2).weights == max(real) * 4


@pytest.mark.multirank
@pytest.mark.parametrize("mode", ["zero-cpu", "zero-nvme"])
def test_zero_inference_configs_generate_the_plain_models_tokens(deepspeed_report, mode):
    assert deepspeed_report["zero"][mode] is True


def need(model: str, batch: int = 1, context: int = 4096, dtype: str = "bf16", tp: int = 1):
    return inference_memory(NAMED_MODELS[model][1], batch, context, dtype, tp)


def test_7b_fits_one_80gb_gpu():
    n = need("7b")
    place = choose_placement(n, 80 * GB, 1000 * GB, None)
    assert place.mode == "gpu" and place.gpu_bytes == n.total
    assert f"{n.total / GB:.1f} GB per GPU" in place.reason


def test_70b_on_one_80gb_gpu_with_1tb_of_ram_is_zero_cpu():
    n = need("70b")
    assert n.weights > 80 * GB  # the plain placement cannot hold it
    place = choose_placement(n, 80 * GB, 1000 * GB, None)
    assert place.mode == "zero-cpu"
    assert place.gpu_bytes == n.zero_gpu < 0.9 * 80 * GB  # KV cache, activations and the layers in flight
    assert place.cpu_bytes >= n.model_weights
    assert f"{place.cpu_bytes / GB:.1f} GB per node" in place.reason and f"{n.total / GB:.1f}" in place.reason


def test_no_ram_to_spare_but_nvme_is_zero_nvme():
    n = need("70b")
    place = choose_placement(n, 80 * GB, 64 * GB, 2000 * GB)
    assert place.mode == "zero-nvme"
    assert place.nvme_bytes == n.model_weights and place.cpu_bytes < 64 * GB
    assert f"NVMe {n.model_weights / GB:.1f} of 1800.0 GB" in place.reason


def test_too_big_everywhere_is_none_with_hints():
    values = {"model": "70b", "gpu": "rtx4090", "context": 4096, "cpu_ram_gb": 64}
    plan = make_inference_plan(build_inference_inputs(values))
    assert plan.placement.mode == "none" and plan.deepspeed is None
    assert f"{plan.need.total / GB:.1f} GB per GPU" in plan.placement.reason
    text = " ".join(plan.hints)
    assert "--tp 8" in text and "--cpu-ram-gb" in text and "--nvme-gb" in text
    ram = int(text.split("--cpu-ram-gb ")[1].split()[0])  # the RAM the hint names does make it fit
    assert make_inference_plan(build_inference_inputs({**values, "cpu_ram_gb": ram})).placement.mode == "zero-cpu"
    assert make_inference_plan(build_inference_inputs({**values, "cpu_ram_gb": ram - 1})).placement.mode == "none"


def test_the_gpu_budget_edge_is_exact():
    """The plan keeps 10% of the device free; one byte of memory decides between gpu and ZeRO-Inference."""
    n = need("7b")
    enough = math.ceil(n.total / 0.9)
    while int(enough * 0.9) < n.total:
        enough += 1
    assert choose_placement(n, enough, None, None).mode == "gpu"
    assert choose_placement(n, enough - 1, None, None).mode == "zero-cpu"


def test_tp_divides_the_weights_and_cache_per_gpu():
    one, four = need("70b", batch=8), need("70b", batch=8, tp=4)
    assert four.kv_cache * 4 == one.kv_cache
    # embeddings stay whole on every rank: more than a quarter of the weights
    assert one.weights / 4 < four.weights < one.weights / 4 + NAMED_MODELS["70b"][1].vocab_size * 8192 * 2
    assert choose_placement(four, 80 * GB, None, None).mode == "gpu"


def test_zero_inference_config_is_valid_deepspeed():
    largest = mem.largest_layer_params(NAMED_MODELS["70b"][1])
    for mode in ("zero-cpu", "zero-nvme"):
        ds = dsc.zero_inference_config(mode, "/nvme", largest_layer=largest)
        assert dsc.check_keys(ds) == [] and dsc.zero_stage(ds) == 3
        assert dsc.offload_param_device(ds) == mode.split("-")[1] and dsc.offload_optimizer_device(ds) == "none"
    nvme = dsc.zero_inference_config("zero-nvme", "/nvme", largest_layer=largest)
    assert dsc.offload_block(nvme, "offload_param")["buffer_size"] >= largest  # DeepSpeed's swapper asserts
    from deepspeed.inference.config import DeepSpeedInferenceConfig
    assert DeepSpeedInferenceConfig(**dsc.init_inference_config(4, "bf16")).tensor_parallel.tp_size == 4


def test_cli_json(tmp_path):
    result = run_cli("plan", "--inference", "--model", "70b", "--gpu", "h100-80g", "--batch", "4", "--context",
                     "2048", "--cpu-ram-gb", "1000", "--json")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)  # nothing but the JSON on stdout
    n = need("70b", batch=4, context=2048)
    assert plan["per_gpu_bytes"] == {"weights": n.weights, "kv_cache": n.kv_cache, "logits": n.logits,
                                     "activations": n.activations, "total": n.total}
    assert (plan["batch"], plan["context"], plan["tp"], plan["dtype"]) == (4, 2048, 1, "bf16")
    assert plan["placement"]["mode"] == "zero-cpu" and plan["fits"] is True
    assert plan["placement"]["gpu_bytes"] == plan["zero_inference_gpu_bytes"] == n.zero_gpu
    assert dsc.check_keys(plan["deepspeed_config"]) == []
    assert dsc.offload_param_device(plan["deepspeed_config"]) == "cpu"


def test_cli_table_and_fits_nowhere():
    fits = run_cli("plan", "--inference", "--model", "8b", "--gpu", "a100-80g", "--context", "8192")
    assert fits.returncode == 0, fits.stderr
    for text in ("per GPU: weights", "KV cache", "Placement: gpu"):
        assert text in fits.stdout
    nowhere = run_cli("plan", "--inference", "--model", "70b", "--gpu", "rtx4090", "--context", "4096",
                      "--batch", "64", "--cpu-ram-gb", "64")
    assert nowhere.returncode == 1
    assert "Placement: none" in nowhere.stdout and "--batch" in nowhere.stdout


INFER = ["plan", "--inference", "--model", "7b", "--gpu", "a100-80g"]


@pytest.mark.parametrize("args, message", [
    (INFER + ["--context", "4096", "--batch", "0"], "argument --batch: '0' must be >= 1"),
    (INFER + ["--context", "0"], "argument --context: '0' must be >= 1"),
    (INFER, "--context is required with --inference"),
    (INFER + ["--context", "8192"], "--context 8192 is beyond Llama-2-7B's 4096 positions"),
    (INFER + ["--context", "4096", "--tp", "0"], "argument --tp: '0' must be >= 1"),
    (INFER + ["--context", "4096", "--tp", "3", "--gpus-per-node", "4"], "--tp 3 does not divide Llama-2-7B's 32"),
    (INFER + ["--context", "4096", "--tp", "2"], "--tp 2 needs 2 GPUs but --gpus-per-node x --nodes gives 1"),
    (INFER + ["--context", "4096", "--dtype", "fp8"], "--dtype: 'fp8' is not one of bf16, fp16, fp32"),
    (["plan", "--inference", "--model", "7b", "--gpu", "v100-32g", "--context", "64", "--dtype", "bf16"],
     "--dtype bf16: NVIDIA V100 32GB SXM2 (fp16 only) has no bf16"),
    (INFER + ["--context", "4096", "--seq-len", "4096"], "--seq-len does nothing without a training plan"),
    (["plan", "scenarios/seed1_7b_8xa100.yaml", "--inference", "--context", "64"], "SCENARIO does nothing without a training plan"),
    (["plan", "--model", "7b", "--gpu", "a100-80g", "--batch", "4"], "--batch does nothing without --inference"),
])
def test_bad_flags_are_clear_errors(args, message, capsys):
    """One `error:` line naming the flag: the planner's own checks, or argparse's usage + error for a flag whose
    value is not of its kind (trainer/numbers.py) or that does nothing in the mode given (trainer/flag_needs.py)."""
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.startswith("error: ") or (err.startswith("usage: python -m trainer plan")
                                         and ("error: argument" in err or "does nothing without" in err))
