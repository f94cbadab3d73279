"""`python -m trainer doctor`: failure logs (tests/logs/) -> the failure and the next change.

Every proposed `--set` list must resolve against the same preset, so a user can paste it, and every rerun
line must start as many ranks as the preset resolves for. Fast: no ranks. The real logs users posted are in
tests/logs/real/ (test_doctor_corpus.py).
"""
from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from distributed import run_cli
from doctor_checks import assert_pasteable, assert_the_trainer_accepts
from trainer import ds as dsc
from trainer.diagnose import phases
from trainer.diagnose.doctor import diagnose
from trainer.diagnose.logtext import EVIDENCE_CHARS, Log
from trainer.launch.command import train_command
from trainer.plan.estimate import plan_for_resolved
from trainer.presets import load_preset, with_overrides
from trainer.resolve import resolve

LOGS = Path(__file__).resolve().parent / "logs"
NVME_DIR = ""  # the NVMe rungs name a path the strict loader checks exists: the module's own, below


@pytest.fixture(scope="module", autouse=True)
def nvme_dir(tmp_path_factory):
    """Under pytest's temporary root, which pytest prunes (a mkdtemp at import left one directory in /tmp per
    collection, every worker, every run)."""
    global NVME_DIR
    NVME_DIR = str(tmp_path_factory.mktemp("doctor-nvme"))


def resolved(preset: str, overrides: list[str] | None = None):
    return resolve(load_preset(preset, overrides or []))


def run_doctor(preset: str, log: str, overrides: list[str] | None = None, nvme_dir: str | None = None,
               text: str | None = None):
    base, nvme_dir = overrides or [], nvme_dir or NVME_DIR
    d = diagnose(resolved(preset, base), text if text is not None else (LOGS / log).read_text(),
                 lambda extra: resolved(preset, with_overrides(base, extra)))
    assert_pasteable(preset, base, d, nvme_dir)  # the strict loader accepts every proposed change
    return d


def test_cuda_oom_walks_the_ladder_skipping_rungs_taken():
    d = run_doctor("7b_8xa100", "cuda_oom.log")  # micro 8, checkpointing already on, ZeRO-2
    assert d.failure == "cuda_oom" and "tried to allocate 1.95 GiB" in d.title and "backward" in d.title
    assert d.proposal.overrides == ["train.micro_batch_size=4", "train.grad_accum=8"]  # global batch kept
    steps = [p.step for p in d.then]
    assert not any("checkpointing" in s for s in steps)  # rung 2 already taken
    # the rest in order of cost, each on top of the ones before (its line carries them), while it lowers the
    # planner's estimate: smaller stage-3 buffers, NVMe and LoRA free no GPU memory once both offloads are on
    assert [s.split(".")[0] for s in steps] == ["1", "3", "4", "4b"]
    assert d.then[0].overrides == ["train.micro_batch_size=2", "train.grad_accum=16"]
    assert d.then[1].overrides == ["train.micro_batch_size=2", "train.grad_accum=16", "deepspeed.zero_optimization.stage=3"]
    # every change is priced: the log's 74 GiB + 1.95 GiB calibrate the estimate, and each step fits
    assert all(p.estimate.endswith("fits (calibrated with the log)") for p in [d.proposal, *d.then])
    assert any("expandable_segments" in a for a in d.advice)


def test_the_cheapest_change_that_fits_comes_first_not_the_first_rung():
    """Issue 24's 13B-like case: on ZeRO-2 the model states alone overflow the GPU, so no smaller micro-batch
    or checkpointing can fit; the first proposal is the cheapest change the planner says fits."""
    base = ["hardware.gpus_per_node=2", "train.grad_accum=16", "train.micro_batch_size=8"]
    d = run_doctor("7b_8xa100", "cuda_oom.log", base)
    assert d.proposal.step.startswith("3. ZeRO stage 2 -> 3"), d.proposal.step
    assert "fits" in d.proposal.estimate and "does not fit" not in d.proposal.estimate
    micro = resolved("7b_8xa100", with_overrides(base, ["train.micro_batch_size=4", "train.grad_accum=32"]))
    assert not plan_for_resolved(micro).fits_gpu  # the rung the fixed order would have proposed first


def test_when_nothing_on_the_ladder_fits_the_doctor_says_so():
    # a 64k-token sequence on one 16 GB V100: the activations alone are several times the GPU
    d = run_doctor("7b_2xv100", "cuda_oom.log", ["hardware.gpu=v100-16g", "hardware.gpus_per_node=1",
                                                 "model.max_position_embeddings=65536", "data.seq_len=65536"])
    assert d.proposal is None and d.then == []
    assert any("nothing on the OOM ladder fits" in a for a in d.advice)


def test_cuda_oom_at_micro_1_proposes_checkpointing_then_stage_up():
    d = run_doctor("7b_8xa100", "cuda_oom.log", ["train.micro_batch_size=1", "train.grad_accum=32",
                                                 "model.gradient_checkpointing=false"])
    assert d.proposal.overrides == ["model.gradient_checkpointing=true"]
    d = run_doctor("7b_8xa100", "cuda_oom.log", ["train.micro_batch_size=1", "train.grad_accum=32"])
    assert d.proposal.step.startswith("3.") and d.proposal.overrides == ["deepspeed.zero_optimization.stage=3"]


def test_cuda_oom_on_stage_3_with_optimizer_offload_skips_a_param_offload_host_ram_cannot_hold():
    d = run_doctor("70b_8xa100", "cuda_oom.log")  # micro 1, checkpointing, ZeRO-3 + CPU optimizer
    param_offload = resolved("70b_8xa100", ['deepspeed.zero_optimization.offload_param={"device": "cpu", '
                                            '"pin_memory": true}'])
    assert not plan_for_resolved(param_offload).fits_cpu  # 70B of 16-bit parameters in 1 TB of host RAM, x1.5
    assert d.proposal.step.startswith("6. NVMe") and "fits" in d.proposal.estimate


def test_cuda_oom_ladder_up_to_nvme(tmp_path):
    d = run_doctor("7b_2xv100", "cuda_oom.log", nvme_dir=str(tmp_path), overrides=[
        "model.lora.enabled=true", "deepspeed.zero_optimization.stage3_prefetch_bucket_size=1e7",
        "deepspeed.zero_optimization.stage3_max_live_parameters=1e8",
        "deepspeed.zero_optimization.stage3_max_reuse_distance=1e8"])
    assert d.proposal.step.startswith("6.")  # NVMe is the last rung not taken (LoRA is on)
    assert all(not p.step.startswith("7.") for p in d.then)


PHASES = Path(__file__).resolve().parent / "logs" / "phases"


@pytest.mark.parametrize("name", sorted(json.loads((PHASES / "phases.json").read_text())))
def test_phase_from_real_tracebacks(name):
    """Tracebacks users posted (tests/logs/phases/phases.json names each source): optimizer internals are the
    step even without a frame called `step`, a step called from accelerate's backward is the step, an op built
    inside deepspeed.initialize is start-up, a ZeRO checkpoint load is a resume."""
    log = Log.of((PHASES / f"{name}.log").read_text())
    expected = json.loads((PHASES / "phases.json").read_text())[name]["phase"]
    assert phases.phase_of_frames(log.frames(len(log.lines) - 1)) == expected


@pytest.mark.parametrize("log, expected", [("cuda_oom.log", "backward"), ("oom_zero_init.log", "loading"),
                                           ("real/init_oom_1.log", "init")])
def test_phase_of_the_oom_logs(log, expected):
    text = Log.of((LOGS / log).read_text())
    assert phases.phase(text, text.first(re.compile("out of memory"))) == expected


def test_an_oom_in_the_optimizer_step_gets_the_states_rungs():
    """The OOM of cuda_oom.log inside a real step traceback (DeepSpeed's stage-3 step under accelerate's
    backward): no activations are live, so micro-batch and checkpointing are not proposed."""
    lines = (LOGS / "cuda_oom.log").read_text().splitlines()
    oom = next(line for line in lines if "OutOfMemoryError" in line)
    step = (PHASES / "step_via_accelerate_backward.log").read_text()
    d = run_doctor("7b_8xa100", "", text="\n".join(lines[:5] + ["[rank2]: Traceback (most recent call last):", step, oom]))
    assert d.failure == "cuda_oom" and "optimizer step" in d.title
    assert d.proposal.step.startswith("3.") and not any(p.step.startswith(("1.", "2.")) for p in d.then)


def test_an_oom_inside_deepspeed_initialize_is_a_start_up_oom():
    text = (LOGS / "cuda_oom.log").read_text().replace("engine.backward(loss)", "deepspeed.initialize(model=m)")
    text = text.replace("line 2298, in backward", "line 2298, in _configure_zero_optimizer")
    d = run_doctor("7b_8xa100", "", text=text)
    assert d.failure == "init_oom" and d.proposal.step.startswith("3.")


def test_oom_while_loading_under_zero_init():
    d = run_doctor("70b_8xa100", "oom_zero_init.log")
    assert d.failure == "load_oom" and "GPU memory" in d.title
    assert d.proposal.overrides == ['deepspeed.zero_optimization.offload_param:={"device": "cpu", "pin_memory": true}']


def test_host_oom_while_loading_below_stage_3():
    d = run_doctor("7b_8xa100", "host_oom_load.log")
    assert d.failure == "host_oom" and "host RAM" in d.title and "loading" in d.title
    assert d.proposal.overrides == ["deepspeed.zero_optimization.stage=3"]
    assert "zero.Init" in d.proposal.reason


def test_host_oom_while_loading_with_cpu_optimizer_offload_goes_to_nvme(tmp_path):
    d = run_doctor("70b_8xa100", "host_oom_load.log", nvme_dir=str(tmp_path))
    assert d.failure == "host_oom" and d.proposal.step == "optimizer offload to NVMe"
    assert any('"device": "nvme"' in o for o in d.proposal.overrides)


@pytest.mark.parametrize("ending", ["\r\n", "\r"])
def test_line_endings_and_redrawn_progress_bars_do_not_hide_a_kill(ending):
    text = (LOGS / "host_oom_load.log").read_text().replace("\n", ending)
    assert run_doctor("7b_8xa100", "", text=text).failure == "host_oom"


def test_fp16_loss_scale_on_v100_leaves_fp16():
    d = run_doctor("7b_2xv100", "fp16_loss_scale.log")
    assert d.failure == "fp16_loss_scale"
    assert d.proposal.overrides[0] == "train.precision=fp32" and "no bf16" in d.proposal.reason
    assert dsc.precision(resolved("7b_2xv100", d.proposal.overrides).ds) == "fp32"
    assert not any("min_loss_scale" in o for p in [d.proposal, *d.then] for o in p.overrides)
    assert d.then and d.then[0].overrides[0].startswith("train.lr=")


def test_fp16_loss_scale_on_a100_switches_to_bf16():
    d = run_doctor("7b_2xv100", "fp16_loss_scale.log", ["hardware.gpu=a100-80g"])
    assert d.proposal.overrides[0] == "train.precision=bf16"
    r = resolved("7b_2xv100", ["hardware.gpu=a100-80g"] + d.proposal.overrides)
    assert dsc.precision(r.ds) == "bf16"


def test_an_fp16_log_against_a_bf16_preset_proposes_the_presets_own_bf16():
    """Only fp16 scales its loss, so the log's run was fp16 whatever the preset says: the preset's bf16 is the fix,
    and its rerun is the preset unchanged; staying in fp16 is left to a diagnosis with the log's precision."""
    d = run_doctor("7b_8xa100", "fp16_loss_scale.log")
    assert d.failure == "fp16_loss_scale" and d.proposal.overrides == [] and "train in bf16" in d.proposal.step
    stay = next(a for a in d.advice if "--set train.precision=fp16" in a)
    as_it_ran = shlex.split(stay.split(": ", 1)[1])  # what a user pastes into a shell
    assert as_it_ran[::2] == ["--set"] * (len(as_it_ran) // 2)
    in_fp16 = run_doctor("7b_8xa100", "fp16_loss_scale.log", as_it_ran[1::2])
    assert in_fp16.proposal.overrides[0] == "train.precision=bf16"


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


def test_cpu_adam_build_failure_names_the_cause_then_the_fallback():
    d = run_doctor("70b_8xa100", "cpu_adam_build.log")
    assert d.failure == "op_build" and "cpu_adam" in d.title and "c++: not found" in d.evidence
    assert d.proposal.overrides == [] and "build-essential" in d.proposal.step
    assert "DS_BUILD_CPU_ADAM=1" in d.proposal.reason
    assert d.then[0].overrides == ["deepspeed.zero_force_ds_cpu_optimizer=false",
                                   "deepspeed.optimizer.params.torch_adam=true"]


def test_nccl_timeout_with_ranks_in_step_points_at_the_fabric():
    d = run_doctor("70b_32xa100", "nccl_timeout.log")
    assert d.failure == "nccl_timeout" and "_ALLGATHER_BASE" in d.title and "1800 s" in d.title
    assert d.proposal is None
    assert any("NCCL_DEBUG=INFO" in a for a in d.advice) and any("symptom" in a for a in d.advice)


def test_an_nccl_timeout_on_the_first_small_collective_is_a_barrier():
    text = (LOGS / "nccl_timeout.log").read_text().replace("SeqNum=4821", "SeqNum=1").replace(
        "NumelIn=35651584", "NumelIn=1")
    d = run_doctor("70b_32xa100", "", text=text)
    assert d.failure == "nccl_barrier_timeout" and "prepare-data --preset 70b_32xa100" in d.proposal.step
    longer = int(d.then[0].overrides[0].split("=")[1])
    assert d.then[0].overrides[0].startswith("train.dist_timeout_s=") and longer > 1800


def test_ranks_at_different_collectives_took_different_code_paths():
    text = (LOGS / "nccl_timeout.log").read_text()
    other = [line.replace("Rank 5", "Rank 2").replace("SeqNum=4821", "SeqNum=4819") for line in text.splitlines()
             if "Watchdog caught" in line][:1]
    d = run_doctor("70b_32xa100", "", text=text + "\n" + "\n".join(other))
    assert d.failure == "nccl_desync" and "rank 2 at collective #4819" in d.title
    assert any("TORCH_DISTRIBUTED_DEBUG=DETAIL" in a for a in d.advice)


def test_batch_triad():
    d = run_doctor("7b_8xa100", "batch_triad.log")
    assert d.failure == "batch_triad" and "world size 4" in d.title
    assert d.proposal.overrides == ["hardware.gpus_per_node=4", "train.micro_batch_size=8", "train.grad_accum=8"]
    r = resolved("7b_8xa100", d.proposal.overrides)
    assert r.ds["train_batch_size"] == 256 and r.world_size == 4


def test_a_triad_at_world_size_1_is_a_launch_problem_unless_the_preset_has_one_rank():
    text = (LOGS / "batch_triad.log").read_text().replace("256 != 8 * 4 * 4", "256 != 8 * 4 * 1")
    d = run_doctor("7b_8xa100", "", text=text)
    assert d.failure == "not_distributed" and d.proposal.overrides == [] and "8 ranks" in d.proposal.step
    assert run_doctor("7b_lora_1x4090", "", text=text).failure == "batch_triad"


def test_unrecognised_log_shows_its_last_exception():
    d = run_doctor("7b_8xa100", "unrecognised.log")
    assert not d.recognised and d.proposal is None
    assert d.evidence.startswith("FileNotFoundError: [Errno 2] No such file or directory")


def test_evidence_is_bounded():
    text = (LOGS / "unrecognised.log").read_text().replace("train.jsonl'", "train.jsonl'" + " x" * 1000)
    assert len(run_doctor("7b_8xa100", "", text=text).evidence) <= EVIDENCE_CHARS


def test_an_nccl_timeout_after_an_oom_is_the_oom(tmp_path):
    text = (LOGS / "cuda_oom.log").read_text() + (LOGS / "nccl_timeout.log").read_text()
    assert diagnose(resolved("7b_8xa100"), text).failure == "cuda_oom"


def test_train_command_layouts():
    multi = train_command("70b_32xa100", ["a=b c"], nodes=4, gpus_per_node=8, launcher="torchrun", world_size=32,
                          env=(("NCCL_DEBUG", "INFO"),))
    assert multi.startswith('NCCL_DEBUG=INFO torchrun --nproc_per_node 8 --nnodes 4 --node_rank "$NODE_RANK" '
                            '--master_addr "$MASTER_ADDR"')  # the shell expands them on each node
    assert "--world-size 32 --set 'a=b c'" in multi
    assert train_command("7b_8xa100", nodes=1, gpus_per_node=8) == "deepspeed --num_gpus 8 train.py --preset 7b_8xa100"
    with pytest.raises(ValueError):
        train_command("7b_8xa100", launcher="mpirun")


@pytest.mark.slow
def test_cli_text_json_and_exit_codes():
    text = run_cli("doctor", "7b_8xa100", "tests/logs/cuda_oom.log")
    assert text.returncode == 0
    assert "recognised: CUDA out of memory" in text.stdout and "--set train.micro_batch_size=4" in text.stdout
    assert "planner:" in text.stdout
    as_json = run_cli("doctor", "7b_2xv100", "tests/logs/fp16_loss_scale.log", "--json")
    report = json.loads(as_json.stdout)
    assert set(report) == {"recognised", "failure", "class", "title", "evidence", "phase", "exception",
                           "raising_site", "nearest", "facts", "proposal", "then", "advice", "memory", "command"}
    assert report["failure"] == "fp16_loss_scale" and set(report["proposal"]) == {"step", "overrides", "reason"}
    assert_the_trainer_accepts(report["command"], "7b_2xv100")
    unknown = run_cli("doctor", "7b_8xa100", "tests/logs/unrecognised.log")
    assert unknown.returncode == 1 and "NOT RECOGNISED" in unknown.stdout and "FileNotFoundError" in unknown.stdout
    missing = run_cli("doctor", "7b_8xa100", "tests/logs/nope.log")
    assert missing.returncode == 2 and "log file 'tests/logs/nope.log' does not exist" in missing.stderr
    empty = run_cli("doctor", "7b_8xa100", "/dev/null")
    assert empty.returncode == 2 and "error:" in empty.stderr and "Traceback" not in empty.stderr


def test_the_rerun_command_carries_the_world_size_and_the_launcher():
    report = json.loads(run_cli("doctor", "7b_8xa100", "tests/logs/cuda_oom.log", "--world-size", "4",
                                "--set", "train.grad_accum=8", "--set", "train.lr=0.0002", "--json").stdout)
    assert "--num_gpus 4" in report["command"] and "--world-size 4" in report["command"]
    assert_the_trainer_accepts(report["command"], "7b_8xa100", world_size=4)
    assert "--set train.lr=0.0002" in report["command"]  # the run's own overrides come along,
    assert report["command"].count("train.grad_accum=") == 1  # those the proposal changes replaced, not repeated


@pytest.mark.parametrize("preset, log", [("70b_32xa100", "cuda_oom.log"), ("7b_8xa100", "cuda_oom.log"),
                                         ("7b_2xv100", "fp16_loss_scale.log"), ("7b_8xa100", "host_oom_load.log"),
                                         ("70b_8xa100", "cpu_adam_build.log")])
def test_the_rerun_command_is_one_the_trainer_accepts(preset, log):
    report = json.loads(run_cli("doctor", preset, f"tests/logs/{log}", "--json").stdout)
    assert report["command"], report
    assert_the_trainer_accepts(report["command"], preset)


def test_a_long_context_oom_gets_deepspeed_alsts_rungs_keeping_the_global_batch():
    """8B at 128k on 8 H100s without Ulysses and without tiled MLPs: no smaller micro-batch exists and a ZeRO stage up
    alone does not fit; the cheapest change that fits is sequence parallelism, with the accumulation that keeps the
    global batch, then the rest of ALST (tiled MLP, checkpoints in host memory), each priced by the planner."""
    base = ["deepspeed.sequence_parallel_size=1", "model.tiled_mlp=0"]
    d = run_doctor("8b_128k_8xh100", "cuda_oom.log", base)
    assert d.proposal.step.startswith("3d. sequence parallel 1 -> 2"), d.proposal.step
    assert d.proposal.overrides == ["deepspeed.sequence_parallel_size=2", "train.grad_accum=16"]
    after = resolved("8b_128k_8xh100", with_overrides(base, d.proposal.overrides))
    assert after.batch.global_batch_size == resolved("8b_128k_8xh100", base).batch.global_batch_size
    steps = [p.step.split(".")[0] for p in d.then]
    assert "3c" in steps and "4c" in steps
    offload = next(p for p in d.then if p.step.startswith("4c"))
    assert offload.overrides[-1] == "deepspeed.activation_checkpointing.cpu_checkpointing=true"
    assert set(d.proposal.overrides) <= set(offload.overrides)  # on top of the changes before it, one line
    assert all("fits" in p.estimate for p in [d.proposal, *d.then])


def test_short_sequences_get_no_long_context_rungs():
    d = run_doctor("7b_8xa100", "cuda_oom.log")
    assert not any(p.step.split(".")[0] in ("3b", "3c", "3d") for p in [d.proposal, *d.then])
