"""`python -m trainer doctor`: realistic failure logs (tests/logs/) -> the failure and the next change.

Every proposed `--set` list must resolve against the same preset, so a user can paste it. Fast: no ranks.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent

from trainer import ds as dsc
from trainer.diagnose.doctor import diagnose
from trainer.presets import load_preset
from trainer.resolve import resolve
from distributed import run_cli

LOGS = Path(__file__).resolve().parent / "logs"


def resolved(preset: str, overrides: list[str] | None = None):
    return resolve(load_preset(preset, overrides or []))


def run_doctor(preset: str, log: str, overrides: list[str] | None = None, nvme_dir: str | None = None):
    base = overrides or []
    r = resolved(preset, base)
    d = diagnose(r, (LOGS / log).read_text(), lambda extra: resolved(preset, base + extra))
    if d.proposal:  # the proposal must be a valid config for the same preset (NVMe: at an existing path)
        proposal = [o.replace("/local_nvme", nvme_dir) if nvme_dir else o for o in d.proposal.overrides]
        resolved(preset, base + proposal)
    return d



def test_cuda_oom_walks_the_ladder_skipping_rungs_taken():
    d = run_doctor("7b_8xa100", "cuda_oom.log")  # micro 8, checkpointing already on, ZeRO-2
    assert d.failure == "cuda_oom" and "tried to allocate 1.95 GiB" in d.title
    assert d.proposal.overrides == ["train.micro_batch_size=4", "train.grad_accum=8"]  # global batch kept
    steps = [p.step for p in d.then]
    assert not any("checkpointing" in s for s in steps)  # rung 2 already taken
    assert steps[0].startswith("3. ZeRO stage 2 -> 3")
    assert [s.split(".")[0] for s in steps] == ["3", "4", "4b", "5", "6", "7"]
    assert any("expandable_segments" in a for a in d.advice)


def test_cuda_oom_at_micro_1_proposes_checkpointing_then_stage_up():
    d = run_doctor("7b_8xa100", "cuda_oom.log", ["train.micro_batch_size=1", "train.grad_accum=32",
                                                 "model.gradient_checkpointing=false"])
    assert d.proposal.overrides == ["model.gradient_checkpointing=true"]
    d = run_doctor("7b_8xa100", "cuda_oom.log", ["train.micro_batch_size=1", "train.grad_accum=32"])
    assert d.proposal.step.startswith("3.") and d.proposal.overrides == ["deepspeed.zero_optimization.stage=3"]


def test_cuda_oom_on_stage_3_with_optimizer_offload_goes_to_param_offload():
    d = run_doctor("70b_8xa100", "cuda_oom.log")  # micro 1, checkpointing, ZeRO-3 + CPU optimizer
    assert d.proposal.step.startswith("4b")
    assert d.proposal.overrides == ['deepspeed.zero_optimization.offload_param={"device": "cpu", "pin_memory": true}']
    r = resolved("70b_8xa100", d.proposal.overrides)
    assert dsc.offload_param_device(r.ds) == "cpu"


def test_cuda_oom_ladder_up_to_nvme(tmp_path):
    d = run_doctor("7b_2xv100", "cuda_oom.log", nvme_dir=str(tmp_path), overrides=[
        "model.lora.enabled=true", "deepspeed.zero_optimization.stage3_prefetch_bucket_size=1e7",
        "deepspeed.zero_optimization.stage3_max_live_parameters=1e8",
        "deepspeed.zero_optimization.stage3_max_reuse_distance=1e8"])
    assert d.proposal.step.startswith("6.")  # NVMe is the last rung not taken (LoRA is on)
    assert all(not p.step.startswith("7.") for p in d.then)


def test_oom_while_loading_under_zero_init():
    d = run_doctor("70b_8xa100", "oom_zero_init.log")
    assert d.failure == "load_oom" and "GPU memory" in d.title
    assert d.proposal.overrides == ['deepspeed.zero_optimization.offload_param={"device": "cpu", "pin_memory": true}']


def test_host_oom_while_loading_below_stage_3():
    d = run_doctor("7b_8xa100", "host_oom_load.log")
    assert d.failure == "load_oom" and "host RAM" in d.title
    assert d.proposal.overrides == ["deepspeed.zero_optimization.stage=3"]
    assert "zero.Init" in d.proposal.reason


def test_host_oom_while_loading_with_cpu_optimizer_offload_goes_to_nvme(tmp_path):
    d = run_doctor("70b_8xa100", "host_oom_load.log", nvme_dir=str(tmp_path))
    assert d.failure == "load_oom" and d.proposal.step == "optimizer offload to NVMe"
    assert any('"device": "nvme"' in o for o in d.proposal.overrides)


def test_fp16_loss_scale_on_v100_raises_the_floor():
    d = run_doctor("7b_2xv100", "fp16_loss_scale.log")
    assert d.failure == "fp16_loss_scale"
    assert d.proposal.overrides == ["deepspeed.fp16.min_loss_scale=128"]
    assert "no bf16" in d.proposal.reason


def test_fp16_loss_scale_on_a100_switches_to_bf16():
    d = run_doctor("7b_2xv100", "fp16_loss_scale.log", ["hardware.gpu=a100-80g"])
    assert d.proposal.overrides[0] == "train.precision=bf16"
    r = resolved("7b_2xv100", ["hardware.gpu=a100-80g"] + d.proposal.overrides)
    assert dsc.precision(r.ds) == "bf16"


def test_stage3_save_without_gathering():
    d = run_doctor("70b_32xa100", "stage3_save.log",
                   ["deepspeed.zero_optimization.stage3_gather_16bit_weights_on_model_save=false"])
    assert d.failure == "stage3_save"
    assert d.proposal.overrides == ["deepspeed.zero_optimization.stage3_gather_16bit_weights_on_model_save=true"]
    assert any("zero_to_fp32" in a for a in d.advice)


def test_stage3_empty_weights_with_gathering_on_points_to_zero_to_fp32():
    d = run_doctor("70b_32xa100", "stage3_empty_weights.log")
    assert d.failure == "stage3_save" and d.proposal is None
    assert any("zero_to_fp32" in a for a in d.advice)


def test_cpu_adam_build_failure():
    d = run_doctor("70b_8xa100", "cpu_adam_build.log")
    assert d.failure == "cpu_adam_build"
    assert d.proposal.overrides == ["deepspeed.zero_force_ds_cpu_optimizer=false",
                                    "deepspeed.optimizer.params.torch_adam=true"]
    assert any("c++: not found" in a and "build-essential" in a for a in d.advice)


def test_nccl_timeout():
    d = run_doctor("70b_32xa100", "nccl_timeout.log")
    assert d.failure == "nccl_timeout" and "_ALLGATHER_BASE" in d.title and "1800 s" in d.title
    assert d.proposal is None
    assert any("NCCL_DEBUG=INFO" in a for a in d.advice) and any("symptom" in a for a in d.advice)


def test_batch_triad():
    d = run_doctor("7b_8xa100", "batch_triad.log")
    assert d.failure == "batch_triad" and "world size 4" in d.title
    assert d.proposal.overrides == ["hardware.gpus_per_node=4", "train.micro_batch_size=8", "train.grad_accum=8"]
    r = resolved("7b_8xa100", d.proposal.overrides)
    assert r.ds["train_batch_size"] == 256 and r.world_size == 4


def test_unrecognised_log_is_honest():
    d = run_doctor("7b_8xa100", "unrecognised.log")
    assert not d.recognised and d.proposal is None
    assert d.evidence == "Traceback (most recent call last):"


def test_an_nccl_timeout_after_an_oom_is_the_oom(tmp_path):
    log = tmp_path / "both.log"
    log.write_text((LOGS / "cuda_oom.log").read_text() + (LOGS / "nccl_timeout.log").read_text())
    d = diagnose(resolved("7b_8xa100"), log.read_text())
    assert d.failure == "cuda_oom"


def test_cli_text_json_and_exit_codes():
    text = run_cli("doctor", "7b_8xa100", "tests/logs/cuda_oom.log")
    assert text.returncode == 0
    assert "recognised: CUDA out of memory" in text.stdout and "--set train.micro_batch_size=4" in text.stdout
    assert "planner:" in text.stdout
    as_json = run_cli("doctor", "7b_2xv100", "tests/logs/fp16_loss_scale.log", "--json")
    report = json.loads(as_json.stdout)
    assert report["failure"] == "fp16_loss_scale"
    assert_the_trainer_accepts(report["command"], "7b_2xv100")
    unknown = run_cli("doctor", "7b_8xa100", "tests/logs/unrecognised.log")
    assert unknown.returncode == 1 and "NOT RECOGNISED" in unknown.stdout
    assert "FileNotFoundError" in unknown.stdout or "Traceback" in unknown.stdout
    missing = run_cli("doctor", "7b_8xa100", "tests/logs/nope.log")
    assert missing.returncode == 2 and "log file 'tests/logs/nope.log' not found" in missing.stderr


def assert_the_trainer_accepts(command: str, preset: str) -> None:
    """The rerun line launches as many ranks as the preset resolves for, and its --set items resolve."""
    import shlex
    from trainer.presets import load_preset
    from trainer.resolve import resolve
    words = shlex.split(command)
    assert words[0] == "deepspeed" and words[words.index("--preset") + 1] == preset, command
    nodes = int(words[words.index("--num_nodes") + 1]) if "--num_nodes" in words else 1
    ranks = nodes * int(words[words.index("--num_gpus") + 1])
    overrides = [words[i + 1] for i, word in enumerate(words) if word == "--set"]
    assert resolve(load_preset(preset, overrides), ranks).world_size == ranks, command


@pytest.mark.parametrize("preset, log", [("70b_32xa100", "cuda_oom.log"), ("7b_8xa100", "cuda_oom.log"),
                                         ("7b_2xv100", "fp16_loss_scale.log")])
def test_the_rerun_command_is_one_the_trainer_accepts(preset, log):
    report = json.loads(run_cli("doctor", preset, f"tests/logs/{log}", "--json").stdout)
    assert report["command"], report
    assert_the_trainer_accepts(report["command"], preset)
