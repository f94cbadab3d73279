"""GPU-only paths, run on one CUDA GPU: flash-attn, Liger kernels, fp16 dynamic loss scaling, ZeRO++
quantized weights, activation checkpoints offloaded on a side stream. On CPU machines (CI) conftest.py skips them
with the reason."""
from __future__ import annotations

import importlib.util

import pytest

from conftest import STAGES, TINY
from distributed import last_wins, launch, read_metrics
from trainer.model import flash_attention_available

pytestmark = [pytest.mark.gpu]

GPU_RUN = TINY + ["hardware.gpu=h100-80g", "hardware.gpus_per_node=1", "train.eval_every=0"]


def train(tmp_path, name, *extra) -> tuple[list[dict], str]:
    out = tmp_path / name
    args = ["train.py", "--preset", "tiny_cpu"]
    for item in last_wins(GPU_RUN + [f"train.output_dir={out}", *extra]):
        args += ["--set", item]
    output = launch(args, ranks=1)
    return read_metrics(out)[0], output


def test_flash_attention_trains_like_sdpa(tmp_path):
    if not flash_attention_available():
        pytest.skip("flash-attn is not installed as transformers needs it (docs/gpu-acceptance.md: "
                    "pip install flash-attn==2.8.3.post2 --no-build-isolation)")
    flash, flash_log = train(tmp_path, "flash", "train.precision=bf16", "model.attn_implementation=flash_attention_2")
    sdpa, sdpa_log = train(tmp_path, "sdpa", "train.precision=bf16", "model.attn_implementation=sdpa")
    assert "attention flash_attention_2" in flash_log, "flash-attn did not run (a silent fallback to sdpa)"
    assert "attention sdpa" in sdpa_log
    assert [r["loss"] for r in flash] == pytest.approx([r["loss"] for r in sdpa], rel=2e-2)


def test_liger_kernels_train_like_plain_llama(tmp_path):
    if importlib.util.find_spec("liger_kernel") is None:
        pytest.skip("liger-kernel is not installed (pip install -e '.[gpu]')")
    liger, output = train(tmp_path, "liger", "train.precision=bf16", "model.liger=true")
    plain, plain_log = train(tmp_path, "plain", "train.precision=bf16")
    assert "Liger needs CUDA" not in output
    assert "LigerRMSNorm" in output, "Liger's kernels did not replace transformers' modules"
    assert "liger off" in plain_log
    assert [r["loss"] for r in liger] == pytest.approx([r["loss"] for r in plain], rel=2e-2)


def test_fp16_dynamic_loss_scaling_logs_the_scale(tmp_path):
    rows, _ = train(tmp_path, "fp16", "train.precision=fp16",
                    "deepspeed.fp16={enabled: auto, loss_scale: 0, initial_scale_power: 16, loss_scale_window: 1000, "
                    "hysteresis: 2, min_loss_scale: 1}")
    assert all("loss_scale" in r and r["loss_scale"] >= 1 for r in rows)
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_zeropp_quantized_weights_train(tmp_path):
    rows, _ = train(tmp_path, "zeropp", "train.precision=bf16", *STAGES["z3"],
                    "deepspeed.zero_optimization.zero_quantized_weights=true")
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_kernel_injected_generation_matches_plain(tmp_path):
    """DeepSpeed's fused inference kernels (replace_with_kernel_inject) on a trained tiny run, fp16: the greedy
    completions equal the non-injected engine's for most prompts (fp16 kernels round differently), and the
    injected modules are really there (DeepSpeed's DeepSpeedTransformerInference replaces the decoder layers). The
    model has as many key/value heads as heads: DeepSpeed 0.19.8's HF Llama container cannot serve grouped-query
    attention (trainer/infer/injection.py refuses it), and tiny_cpu's own model is 4/2."""
    import json

    from distributed import run_cli
    train(tmp_path, "run", "train.precision=bf16", "train.export_hf=true", "train.max_steps=30", "model.num_kv_heads=4")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("Once upon a time", "The little cat")))
    outputs = {}
    for name, extra in (("plain", []), ("inject", ["--kernel-inject"])):
        proc = run_cli("generate", "--model", str(tmp_path / "run"), "--prompts", str(prompts), "--greedy",
                       "--dtype", "fp16", "--max-new-tokens", "16", "--format", "jsonl", *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs[name] = [json.loads(line)["completion"] for line in proc.stdout.splitlines()]
        modules = next(line for line in proc.stderr.splitlines() if "deepspeed modules in the model" in line)
        assert ("Inference" in modules.split(":")[-1]) == (name == "inject"), modules  # what really ran
    same = sum(a == b for a, b in zip(outputs["plain"], outputs["inject"]))
    assert same >= 1, outputs


def test_activation_checkpoints_in_host_memory_train_like_on_the_gpu(tmp_path):
    """DeepSpeed's cpu_checkpointing on a real side stream (the CPU accelerator skips it): same losses, and the
    start-up line says where the checkpoints wait."""
    offload = 'deepspeed.activation_checkpointing:={"partition_activations": false, "cpu_checkpointing": true}'
    moved, output = train(tmp_path, "moved", "model.gradient_checkpointing=true", offload)
    kept, _ = train(tmp_path, "kept", "model.gradient_checkpointing=true")
    assert "activation checkpoints in host memory (DeepSpeed cpu_checkpointing) all but the newest" in output
    assert [r["loss"] for r in moved] == pytest.approx([r["loss"] for r in kept], rel=1e-5)
