"""`python -m trainer autotune` (issue 11): the tuning config and command DeepSpeed's autotuner gets (checked with
DeepSpeed's own autotuning code), the refusals on CPU, train.py running an autotuner experiment on the real engine,
and the results dir -> preset writer.

MOCKED, because it needs GPUs: DeepSpeed's experiment scheduler (autotuning/scheduler.py launches each experiment
on CUDA devices). Its files are laid out here exactly as its run_experiment writes them; the metrics come from a
real CPU run of an experiment (multirank test) or are written by DeepSpeed's own print_json_dist with stated
numbers (unit test); ds_config_optimal.json and cmd_optimal.txt are written by DeepSpeed's own
Autotuner.write_optimal_config choosing among those experiments.
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from distributed import DEEPSPEED, REPO, new_port, remove_shm_buffers, run_cli
from trainer import ds as dsc
from trainer.launch.command import command_for
from trainer.presets import load_preset
from trainer.resolve import resolve


def dry_run(*args):
    result = run_cli("autotune", *args, "--dry-run")
    assert result.returncode == 0, result.stderr[-3000:]
    *config_lines, command = result.stdout.strip().splitlines()
    return json.loads("\n".join(config_lines)), command.split(" "), result.stderr


@pytest.mark.slow
def test_dry_run_prints_the_tuning_config_and_the_command_deepspeed_reads(tmp_path):
    config, command, log = dry_run("7b_8xa100", "--dir", str(tmp_path))
    # the planner's cut: 7B with Adam needs ~16 bytes/param = 108 GB replicated (ZeRO-0) > 80 GB; stages 1-3 fit
    assert config["zero_optimization"] == {"stage": [1, 2, 3]}
    assert "left out: ZeRO-0: does not fit" in log and "optimizer cpu offload: not tunable" in log
    # every micro-batch tried keeps the preset's global batch: 8 x 4 x 8 ranks = 256 -> 32 per rank
    micro, accum = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    assert micro == [1, 2, 4, 8, 16, 32] and max(micro) * accum == 32
    assert all(32 % m == 0 for m in micro)
    assert command[:3] == ["deepspeed", "--autotuning", "tune"]
    assert command[command.index("--num_gpus") + 1] == "8"
    script = command.index("train.py")
    assert command[script + 1:script + 3] == ["--preset", "7b_8xa100"]
    assert command[-2:] == ["--deepspeed_config", str(tmp_path / "ds_config_autotuning.json")]
    assert f"train.output_dir={tmp_path / 'run'}" in command and "train.resume=null" in command
    assert not (tmp_path / "ds_config_autotuning.json").exists()  # a dry run writes nothing

    # DeepSpeed's own autotuning code reads both halves as we meant them
    from deepspeed.autotuning.autotuner import Autotuner
    from deepspeed.autotuning.config import DeepSpeedAutotuningConfig
    parsed = DeepSpeedAutotuningConfig(config)
    assert (parsed.enabled, parsed.fast, parsed.metric) == (True, True, "throughput")
    assert (parsed.start_profile_step, parsed.end_profile_step, parsed.mp_size) == (3, 5, 1)
    assert parsed.results_dir == str(tmp_path / "results") and parsed.exps_dir == str(tmp_path / "experiments")
    (tmp_path / "ds_config_autotuning.json").write_text(json.dumps(config))
    assert Autotuner._get_user_config(None, command[script + 1:]) == config  # found after --deepspeed_config
    # and every experiment it can make from it passes the installed DeepSpeed's config checks
    experiments = dsc.experiment_configs(config)
    assert len(experiments) == 3 * 6 and all(dsc.check_keys(e) == [] for e in experiments)


@pytest.mark.slow
def test_an_experiment_config_becomes_the_presets_deepspeed_section():
    config, _, _ = dry_run("7b_8xa100")
    experiment = next(e for e in dsc.experiment_configs(config)
                      if e["zero_optimization"]["stage"] == 3 and e["train_micro_batch_size_per_gpu"] == 2)
    experiment["autotuning"] = {"enabled": True, "metric_path": "results/z3_gas16_tmbspg2/metrics.json"}
    encoded = base64.urlsafe_b64encode(json.dumps(experiment).encode()).decode()  # as scheduler.py passes it
    resolved = resolve(load_preset("7b_8xa100", dsc.experiment_overrides(dsc.decode_launcher_config(encoded))))
    assert dsc.zero(resolved.ds) == {"stage": 3}  # the experiment's block, not zero2.json's
    assert (resolved.batch.micro_batch_size, resolved.batch.grad_accum, resolved.batch.global_batch_size) == (2, 16,
                                                                                                             256)
    assert resolved.ds["autotuning"]["metric_path"] == "results/z3_gas16_tmbspg2/metrics.json"


def test_cpu_refusals_name_why():
    result = run_cli("autotune", "tiny_cpu", "--dry-run")
    assert result.returncode == 2 and "hardware.gpu: cpu" in result.stderr and "profiles CUDA" in result.stderr
    nothing = run_cli("autotune", "70b_8xa100", "--dry-run")
    assert nothing.returncode == 2 and "nothing the autotuner can run fits" in nothing.stderr
    assert "ZeRO-3: does not fit" in nothing.stderr and "not tunable" in nothing.stderr


@pytest.mark.slow
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_without_cuda_autotune_refuses_and_writes_nothing(tmp_path):
    result = run_cli("autotune", "7b_8xa100", "--dir", str(tmp_path / "at"))
    assert result.returncode == 2 and "needs CUDA GPUs" in result.stderr and "--dry-run" in result.stderr
    assert not (tmp_path / "at").exists()


# --- the results dir (scheduler MOCKED: see the module docstring) ---------------------------------------------

def lay_out_experiment(results: Path, name: str, ds_config: dict, metrics: dict | None) -> None:
    """One experiment's directory as deepspeed/autotuning/scheduler.py's run_experiment leaves it."""
    from deepspeed.utils.logging import print_json_dist
    exp_dir = results / name
    exp_dir.mkdir(parents=True)
    ds_config = {**ds_config, "autotuning": {**ds_config.get("autotuning", {}),
                                             "metric_path": str(exp_dir / "metrics.json")}}
    (exp_dir / "ds_config.json").write_text(json.dumps(ds_config))
    cmd = "deepspeed --hostfile /job/hostfile --include localhost:0,1 --master_port 29500 train.py --deepspeed_config X"
    (exp_dir / "cmd.txt").write_text(cmd + "\n")
    (exp_dir / "exp.json").write_text(json.dumps({"name": name, "ds_config": ds_config, "result_dir": str(exp_dir)}))
    (exp_dir / "stdout.log").write_text("")
    (exp_dir / "stderr.log").write_text("")
    if metrics is not None:
        print_json_dist(dict(metrics), [0], path=str(exp_dir / "metrics.json"))  # DeepSpeed's writer


def choose_optimal(results: Path, scored: list[tuple[str, float]]) -> None:
    """DeepSpeed's own Autotuner.get_best_space_records + write_optimal_config over the laid-out experiments."""
    from deepspeed.autotuning.autotuner import Autotuner
    tuner = SimpleNamespace(results_dir=str(results), records={"z": []})
    for name, value in scored:
        tuner.records["z"].append(({"name": name, "result_dir": str(results / name)}, value, 1))
    tuner.get_best_space_record = lambda space: Autotuner.get_best_space_record(tuner, space)
    tuner.get_best_space_records = lambda: Autotuner.get_best_space_records(tuner)
    Autotuner.write_optimal_config(tuner)


@pytest.mark.slow
def test_results_dir_becomes_a_preset_with_the_measured_throughput(tmp_path):
    config, _, _ = dry_run("7b_8xa100")
    experiments = {(e["zero_optimization"]["stage"], e["train_micro_batch_size_per_gpu"]): e
                   for e in dsc.experiment_configs(config)}
    results = tmp_path / "results"
    # stated numbers (a GPU would measure them): z2 at micro 4 is fastest, z3 at micro 8 slower, z1 at 16 OOMed
    fake = {"z2_gas8_tmbspg4": ((2, 4), {"latency": 2.0e6, "throughput": 128.0, "FLOPS_per_gpu": 1.5e14}),
            "z3_gas4_tmbspg8": ((3, 8), {"latency": 2.5e6, "throughput": 102.4, "FLOPS_per_gpu": 1.2e14}),
            "z1_gas2_tmbspg16": ((1, 16), None)}
    for name, (key, metrics) in fake.items():
        lay_out_experiment(results, name, experiments[key], metrics)
    choose_optimal(results, [("z2_gas8_tmbspg4", 128.0), ("z3_gas4_tmbspg8", 102.4), ("z1_gas2_tmbspg16", 0)])
    optimal = json.loads((results / "ds_config_optimal.json").read_text())
    assert optimal == experiments[(2, 4)]  # DeepSpeed chose z2_gas8_tmbspg4 and dropped its autotuning block

    out = tmp_path / "7b_8xa100_autotuned.yaml"
    result = run_cli("autotune", "7b_8xa100", "--from-results", str(results), "-o", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "best z2_gas8_tmbspg4: 128.00 samples/s" in result.stderr
    written = load_preset(str(out))
    resolved = resolve(written)
    assert dsc.zero_stage(resolved.ds) == 2 and written.deepspeed_template is None
    assert (resolved.batch.micro_batch_size, resolved.batch.grad_accum, resolved.batch.global_batch_size) == (4, 8,
                                                                                                             256)
    assert written.model == load_preset("7b_8xa100").model and written.data == load_preset("7b_8xa100").data
    header = [line[2:] for line in out.read_text().splitlines() if line.startswith("# ")]
    assert header[0].startswith("7b_8xa100_autotuned — 7b_8xa100")
    for label in ("Hardware:", "Model:", "Trade-off:", "Expected memory", "Launch:"):
        assert any(line.startswith(label) for line in header), label
    measured = next(line for line in header if line.startswith("Measured:"))
    assert "128.00 samples/s" in measured and f"{128.0 * 2048:.0f} tokens/s" in measured
    assert "2000.0 ms per optimizer step" in measured  # latency is in microseconds
    launch = next(line for line in header if line.startswith("Launch:"))
    assert launch == f"Launch: {command_for(resolved, out.stem, [])}"


@pytest.mark.slow
def test_a_results_dir_without_a_winner_is_named(tmp_path):
    result = run_cli("autotune", "7b_8xa100", "--from-results", str(tmp_path), "-o", str(tmp_path / "x.yaml"))
    assert result.returncode == 2 and "no ds_config_optimal.json" in result.stderr and "stderr.log" in result.stderr
    (tmp_path / "ds_config_optimal.json").write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    result = run_cli("autotune", "7b_8xa100", "--from-results", str(tmp_path), "-o", str(tmp_path / "x.yaml"))
    assert result.returncode == 2 and "matches no experiment" in result.stderr
    assert not (tmp_path / "x.yaml").exists()


@pytest.mark.multirank
def test_train_py_runs_an_autotuner_experiment_on_the_real_engine(tmp_path):
    """The half that runs here: DeepSpeed's engine, given an experiment config the way the scheduler passes it
    (base64 after --deepspeed_config), stops after end_profile_step and writes metrics.json; that real
    measurement, laid out as the scheduler would, becomes a preset."""
    config = dsc.tuning_config(resolve(load_preset("tiny_cpu")).ds, [2], [4, 8], 8,
                               dsc.autotuning_block("unused", "unused", start_profile_step=2, end_profile_step=3))
    experiment = dsc.experiment_configs(config)[0]
    assert (experiment["train_micro_batch_size_per_gpu"], experiment["gradient_accumulation_steps"]) == (4, 2)
    results = tmp_path / "results"
    name = "z2_gas2_tmbspg4"
    (results / name).mkdir(parents=True)
    experiment["autotuning"] = {k: v for k, v in config["autotuning"].items() if k not in ("results_dir", "exps_dir")}
    experiment["autotuning"]["metric_path"] = str(results / name / "metrics.json")  # as schedule_experiments sets it
    encoded = base64.urlsafe_b64encode(json.dumps(experiment).encode()).decode()
    port = new_port()
    cmd = [str(DEEPSPEED), "--num_gpus", "2", "--master_port", str(port), "train.py", "--preset", "tiny_cpu",
           "--set", f"train.output_dir={tmp_path / 'run'}", "--set", "train.save_every=0", "--set",
           "train.eval_every=0", "--deepspeed_config", encoded]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    finally:
        remove_shm_buffers(port)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the autotuner marks an experiment failed when its stderr says "error" anywhere (autotuning/utils.py)
    from deepspeed.autotuning.utils import search_error
    (results / name / "stderr.log").write_text(proc.stderr)
    assert search_error(str(results / name / "stderr.log")) is None
    metrics = json.loads((results / name / "metrics.json").read_text())
    assert metrics["throughput"] > 0 and metrics["latency"] > 0
    # throughput is samples/s: train_batch_size (4 x 2 x 2 ranks) per latency microseconds
    assert metrics["throughput"] == pytest.approx(16 * 1e6 / metrics["latency"])
    assert not list((tmp_path / "run").glob("checkpoints/*")), "the experiment stopped after its profile steps"

    (results / name / "ds_config.json").write_text(json.dumps(experiment))
    (results / name / "cmd.txt").write_text(" ".join(cmd[:5]) + " ...\n")
    choose_optimal(results, [(name, metrics["throughput"])])
    out = tmp_path / "tiny_autotuned.yaml"
    result = run_cli("autotune", "tiny_cpu", "--from-results", str(results), "-o", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    measured = next(line for line in out.read_text().splitlines() if line.startswith("# Measured:"))
    assert f"{metrics['throughput']:.2f} samples/s" in measured
    assert resolve(load_preset(str(out))).batch.micro_batch_size == 4
