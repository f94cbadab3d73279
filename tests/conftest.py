"""Shared fixtures: the tiny test architecture, the ZeRO configurations, and the one launch that runs
every non-TP engine configuration (built once per test session; DeepSpeed's JIT ops are built once per
environment, trainer/jit_env.py, and shared by every launch). While a launch runs, the terminal shows what it
waits for and a line per fixture run (tests/processes.py), so `pytest -q` is not silent for the half hour the
engine fixture takes."""
from __future__ import annotations

import os
import time

import pytest

import processes
from distributed import USED_PORTS, last_wins, remove_shm_buffers, run_many  # pytest puts tests/ on sys.path

STEPS = 6
TINY = [
    "model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
    "model.intermediate_size=176", "model.max_position_embeddings=128", "data.seq_len=64",
    "train.micro_batch_size=2", "train.grad_accum=2", f"train.max_steps={STEPS}", "train.warmup_steps=2",
    "train.lr=1e-3", "logging.log_every=1", "train.eval_every=3", "train.eval_sequences=8", "train.save_every=3",
    "train.export_hf=false",
]
SAMPLE_PROMPTS = ["Once upon a time", "The little cat"]
STAGES = {
    "z0": ["deepspeed.zero_optimization.stage=0"],
    "z1": ["deepspeed.zero_optimization.stage=1"],
    "z2": ["deepspeed.zero_optimization.stage=2"],
    "z3": ["deepspeed.zero_optimization.stage=3"],
    "z2_cpu_offload": ["deepspeed.zero_optimization.stage=2",
                       "deepspeed.zero_optimization.offload_optimizer={device: cpu, pin_memory: false}"],
    "z3_cpu_offload": ["deepspeed.zero_optimization.stage=3",
                       "deepspeed.zero_optimization.offload_optimizer={device: cpu, pin_memory: false}",
                       "deepspeed.zero_optimization.offload_param={device: cpu, pin_memory: false}"],
    "z2_grad_ckpt": ["deepspeed.zero_optimization.stage=2", "model.gradient_checkpointing=true"],
    "z3_ds_act_ckpt": ["deepspeed.zero_optimization.stage=3", "model.gradient_checkpointing=true",
                       "deepspeed.activation_checkpointing={partition_activations: false}"],
}
ROUNDTRIP_STAGES = ("z0", "z2", "z3", "z2_cpu_offload")  # ZeRO-1 saves and loads through ZeRO-2's code


def nvme_overrides(path) -> list[str]:
    block = f"{{device: nvme, nvme_path: {path}, pin_memory: false, buffer_count: 4}}"
    return ["deepspeed.zero_optimization.stage=3",
            f"deepspeed.zero_optimization.offload_optimizer={block}",
            f"deepspeed.zero_optimization.offload_param={{device: nvme, nvme_path: {path}, pin_memory: false, "
            f"buffer_count: 5, buffer_size: 1.0e+6}}",
            "deepspeed.aio={block_size: 1048576, queue_depth: 8, intra_op_parallelism: 1, single_submit: false, "
            "overlap_events: true}"]


@pytest.fixture(scope="session")
def pretrained_dir(tmp_path_factory):
    """The tiny architecture initialised once and saved: the 'pretrained weights' every run starts from."""
    from trainer.model import hf_config, init_weights_by_name
    from trainer.presets import load_preset
    from transformers import AutoModelForCausalLM
    cfg = load_preset("tiny_cpu", TINY)
    model = AutoModelForCausalLM.from_config(hf_config(cfg.model, "sdpa"))
    init_weights_by_name(model, seed=7, std=0.02, rank=0)
    path = tmp_path_factory.mktemp("pretrained")
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def engine_runs(tmp_path_factory, pretrained_dir):
    """Every non-TP run of this module in one launch; returns {name: run_dir} and the wandb report."""
    root = tmp_path_factory.mktemp("engine")
    runs, dirs = [], {}

    def add(name, overrides):
        dirs[name] = root / name
        runs.append({"name": name, "preset": "tiny_cpu",
                     "overrides": TINY + overrides + [f"train.output_dir={root / name}"]})

    for name, overrides in STAGES.items():
        add(f"scratch_{name}", overrides)
    (root / "nvme").mkdir()
    add("scratch_z3_nvme", nvme_overrides(root / "nvme"))
    for name in ("z0", "z2", "z3", "z3_cpu_offload"):
        add(f"pretrained_{name}", STAGES[name] + [f"model.name_or_path={pretrained_dir}"])
    # resume: 2N straight vs N, stop, resume, N (same config: only stop_after differs)
    for stage in ("z2", "z3"):
        add(f"straight_{stage}", STAGES[stage] + ["train.max_steps=8", "train.save_every=4"])
        add(f"halves_{stage}", STAGES[stage] + ["train.max_steps=8", "train.save_every=4", "train.stop_after=4"])
        add(f"halves_{stage}", STAGES[stage] + ["train.max_steps=8", "train.save_every=4", "train.resume=auto"])
    for stage in ("z2", "z3"):
        add(f"export_{stage}", STAGES[stage] + ["train.export_hf=true"])
    add("samples_z3", STAGES["z3"] + [f"train.sample_prompts=[{', '.join(SAMPLE_PROMPTS)}]",
                                      "train.sample_max_new_tokens=8"])
    add("lora_z2", STAGES["z2"] + [f"model.name_or_path={pretrained_dir}", "model.lora.enabled=true",
                                   "train.lr=1e-2", "train.export_hf=true", "train.export_merged=true"])
    add("wandb_offline", STAGES["z2"] + ["logging.wandb_mode=offline", "logging.wandb_project=tests",
                                         f"train.sample_prompts=[{SAMPLE_PROMPTS[0]}]"])
    # engines saved and loaded directly, in this launch (tests/test_checkpoint_io.py): torch's AdamW keeps the state
    # tensors it is given, the case where a load from a mapped file must copy them off
    dirs["checkpoint_roundtrip"] = root / "checkpoint_roundtrip"
    runs.append({"name": "checkpoint_roundtrip", "worker": "checkpoint_roundtrip", "spec": {
        "out": str(root / "checkpoint_roundtrip"), "report": str(root / "checkpoint_roundtrip" / "report.json"),
        "base": last_wins(TINY + ["deepspeed.optimizer.params.torch_adam=true",
                                  "deepspeed.zero_force_ds_cpu_optimizer=false"]),
        "configs": {name: STAGES[name] for name in ROUNDTRIP_STAGES}}})
    processes.say(f"engine_runs: {len(runs)} trainings in one 2-rank launch, the set-up of the engine, inference "
                  f"and export tests (~20-30 min on 2 cores; a line per training follows)")
    started = time.monotonic()
    _, report = run_many(runs, root)
    processes.say(f"engine_runs: done in {(time.monotonic() - started) / 60:.1f} min")
    return dirs, report




# What `trainer.distributed.start_distributed` writes into os.environ for an in-process (one-rank) run
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE")


@pytest.fixture(autouse=True)
def no_rank_variables_left():
    """An in-process training sets RANK=0, WORLD_SIZE=1, MASTER_PORT=... in pytest's own environment; left
    there, every later subprocess (a launch, a supervisor, a CLI command) would start as "rank 0 of a
    one-rank job" on a dead port. Restore them after each test."""
    before = {name: os.environ.get(name) for name in RANK_VARIABLES}
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left():
    """Jobs the tests kill cannot remove their DeepSpeed shared-memory buffers; on a 24 GB machine a
    suite's worth of them (69 MB per rank per job) is RAM."""
    yield
    for port in USED_PORTS:
        remove_shm_buffers(port)


def pytest_configure(config):
    """Progress lines (tests/processes.py) go to the terminal as they happen, past pytest's output capture."""
    def to_terminal(line: str) -> None:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        capture = config.pluginmanager.get_plugin("capturemanager")
        if reporter is None:
            return
        if capture is None:
            reporter.write_line(f"[{time.strftime('%H:%M:%S')}] {line}")
            return
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"[{time.strftime('%H:%M:%S')}] {line}")
    processes.progress = to_terminal


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA (flash-attn, Liger, fp16, ZeRO++ quantized weights): skip them, with the
    reason, on CPU machines such as CI."""
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: DeepSpeed's CPU backend has no fp16, flash-attn, Liger "
                                   "or quantized-weight kernels")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
