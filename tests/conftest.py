"""Shared fixtures: the tiny test architecture, the ZeRO configurations, and the one launch that runs
every non-TP engine configuration (built once per test session; DeepSpeed's JIT ops are built once per
environment, trainer/jit_env.py, and shared by every launch). While a launch runs, the terminal shows what it
waits for and a line per fixture run (tests/processes.py), so `pytest -q` is not silent for the half hour the
engine fixture takes."""
from __future__ import annotations

import fcntl
import json
import os
import random
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import pytest

from trainer import jit_env

# A checkout whose .venv is a link to another checkout's: the session (and so its workers, the preloaded servers
# and every rank they fork) runs as the environment's real path, as the trainer's entry points do, or the ops'
# build.ninja would name the other spelling of the same files and every op would be rebuilt (trainer/jit_env.py).
jit_env.resolve_interpreter()

import cpu_account  # noqa: E402
import distributed  # noqa: E402
import ports  # noqa: E402
import preloaded  # noqa: E402
import processes  # noqa: E402
from distributed import last_wins, run_many  # noqa: E402 (pytest puts tests/ on sys.path)

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


def shared_dir(tmp_path_factory) -> Path:
    """A directory every xdist worker of this test session sees (their base temporary directories share a parent)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextmanager
def once_per_session(tmp_path_factory, name: str):
    """Yields (directory, done) under an exclusive lock shared by every xdist worker: the first worker to get here
    builds `directory` and marks it done; the others wait for the lock and reuse it (done=True). A session fixture
    that launches ranks is then paid once per test session, not once per worker."""
    root = shared_dir(tmp_path_factory)
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        directory, marker = root / name, root / f"{name}.done"
        done = marker.exists()
        directory.mkdir(exist_ok=True)
        yield directory, done
        marker.touch()


@pytest.fixture(scope="session")
def pretrained_dir(tmp_path_factory):
    """The tiny architecture initialised once and saved: the 'pretrained weights' every run starts from."""
    with once_per_session(tmp_path_factory, "pretrained") as (path, done):
        if not done:
            from trainer.model import hf_config, init_weights_by_name
            from trainer.presets import load_preset
            from transformers import AutoModelForCausalLM
            cfg = load_preset("tiny_cpu", TINY)
            model = AutoModelForCausalLM.from_config(hf_config(cfg.model, "sdpa"))
            init_weights_by_name(model, seed=7, std=0.02, rank=0)
            model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def engine_runs(tmp_path_factory, pretrained_dir):
    """Every non-TP run of the engine tests in one launch, once per test session (every xdist worker shares it);
    returns ({name: run_dir}, the runs' report)."""
    with once_per_session(tmp_path_factory, "engine") as (root, done):
        return _engine_runs(root, pretrained_dir, done)


def _engine_runs(root: Path, pretrained_dir: Path, done: bool):
    runs, dirs = [], {}

    def add(name, overrides):
        dirs[name] = root / name
        runs.append({"name": name, "preset": "tiny_cpu",
                     "overrides": TINY + overrides + [f"train.output_dir={root / name}"]})

    for name, overrides in STAGES.items():
        add(f"scratch_{name}", overrides)
    (root / "nvme").mkdir(exist_ok=True)
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
    if done:  # another xdist worker ran them
        return dirs, json.loads((root / "report.json").read_text())
    processes.say(f"engine_runs: {len(runs)} trainings in one 2-rank launch, the set-up of the engine, inference "
                  f"and export tests (~1-2 min on 2 cores; a line per training follows)")
    started = time.monotonic()
    _, report = run_many(runs, root)
    processes.say(f"engine_runs: done in {(time.monotonic() - started) / 60:.1f} min")
    return dirs, report




# What a launcher gives a rank (and `trainer.distributed.start_distributed` writes into os.environ for an in-process
# one-rank run). None of them may reach a job the suite starts from a value it did not choose.
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE", "LOCAL_WORLD_SIZE",
                  "GROUP_RANK", "NODE_RANK", "CROSS_RANK", "CROSS_SIZE", "TORCHELASTIC_RUN_ID")


@pytest.fixture(autouse=True)
def process_state_restored():
    """Each test leaves the worker as it found it, so no test's outcome depends on which ran before it in the same
    worker: the environment (an in-process training sets RANK=0, WORLD_SIZE=1, MASTER_PORT=..., OMP_NUM_THREADS;
    left there, every later subprocess would start as "rank 0 of a one-rank job" on a dead port) and torch's
    intra-op thread count (an in-process rank takes its share of the cores: a later test's float sums would then
    round differently)."""
    environ = dict(os.environ)
    torch = sys.modules.get("torch")
    threads = torch.get_num_threads() if torch else None
    yield
    if dict(os.environ) != environ:
        os.environ.clear()
        os.environ.update(environ)
    torch = sys.modules.get("torch")
    if torch is not None and threads is not None and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def ops_built(request):
    """Every test that may start ranks (marked multirank or slow) finds DeepSpeed's ops built for this environment:
    on a fresh machine the first such test of each worker builds them (~8 min on 2 cores, lines on the terminal),
    before its own timeouts start. Launches by any path - `deepspeed`, `trainer launch`, torchrun, a Slurm script -
    would otherwise build inside the test (CI's torchrun test waited 900 s)."""
    if any(marker in request.keywords for marker in ("multirank", "slow")):
        distributed.ensure_ops_built()


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left():
    """Jobs the tests kill cannot remove their DeepSpeed shared-memory buffers; on a 24 GB machine a
    suite's worth of them (69 MB per rank per job) is RAM."""
    yield
    distributed.remove_every_jobs_buffers()
    ports.release_all()


# --- tiers -------------------------------------------------------------------------------------------------------
# `pytest -m quick` is every test not marked `slow`, `multirank` or `gpu`: the schema, resolve, the planner, the
# data layer, the doctor, lint, docs, parsers and hostile inputs, in under two minutes. What keeps a test out of it
# is a marker, and what keeps the marker honest is the guard below: a quick test that starts ranks, builds ops or
# trains in a subprocess fails and says which marker it needs.
HEAVY = ("slow", "multirank", "gpu")
QUICK_SLOWEST_S = 2.0  # a quick test slower than this is listed at the end of a quick run


def _refuse(what: str) -> None:
    pytest.fail(f"a quick-tier test {what}: mark it @pytest.mark.multirank (ranks) or @pytest.mark.slow (an engine, a "
                f"training, op builds), or make it cheaper", pytrace=False)


LAUNCHERS = {"deepspeed", "torchrun", "train.py", "train_with_faults.py", "run_many.py", "build_ops.py"}


def _heavy_command(cmd) -> str:
    """What a command line would do that the quick tier does not ('' when nothing): start ranks (the deepspeed or
    torchrun launchers, the test workers), train (train.py, `trainer train|launch`), build ops."""
    words = [os.path.basename(str(word)) for word in ([cmd] if isinstance(cmd, (str, bytes)) else cmd)]
    programs = {word for j, word in enumerate(words) if not j or words[j - 1] != "--launcher"}  # not a flag's value
    if LAUNCHERS & programs:
        return "starts ranks, trains or builds ops in a subprocess"
    for i in range(len(words) - 2):
        command = words[i + 2] if words[i:i + 2] == ["-m", "trainer"] else None
        if command == "train":
            return "runs `trainer train` in a subprocess"
        printed_only = "--dry-run" in words or "--launcher=slurm" in words or \
            any(words[j:j + 2] == ["--launcher", "slurm"] for j in range(len(words)))  # slurm: a script for sbatch
        if command in ("launch", "autotune") and not printed_only:
            return f"runs `trainer {command}` (it starts ranks) in a subprocess"
    return ""


def _install_guard(patch: pytest.MonkeyPatch) -> None:
    """While a quick test's fixtures and body run, every process start is looked at (subprocess.Popen, which
    subprocess.run and the harness's run_group use) and so is every process group started in-process (each rank,
    engine or in-process training starts one): either fails the test, naming the marker it needs."""
    import subprocess
    import sys

    import torch.distributed  # imported at collection already (the gpu check)

    class CheckedPopen(subprocess.Popen):
        def __init__(self, args, *rest, **kwargs):
            heavy = _heavy_command(args)
            if heavy:
                _refuse(f"{heavy} ({' '.join(map(str, args))[:200]})")
            super().__init__(args, *rest, **kwargs)
    patch.setattr(subprocess, "Popen", CheckedPopen)
    patch.setenv("TRAINER_TEST_PRELOAD", "0")  # every process real, so the check above sees it
    patch.setattr(torch.distributed, "init_process_group",
                  lambda *a, **k: _refuse("starts a process group in-process (a training, an engine)"))
    if "deepspeed" in sys.modules:
        patch.setattr(sys.modules["deepspeed"], "initialize",
                      lambda *a, **k: _refuse("builds a DeepSpeed engine in-process"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The guard covers a quick test's whole protocol - its fixtures' set-up too, module and session ones included
    (a fixture that launches ranks for a quick test is the same cost)."""
    if "quick" not in item.keywords:
        yield
        return
    patch = pytest.MonkeyPatch()
    _install_guard(patch)
    try:
        yield
    finally:
        patch.undo()


def pytest_addoption(parser):
    parser.addoption("--order", default="longest-first", choices=("longest-first", "file", "reverse", "shuffle"),
                     help="module order: longest-first (default: by tests/durations.json, so the two workers end "
                          "together), as written, reversed, or shuffled with --order-seed (the tests inside each "
                          "module too). A module's tests stay together, so module fixtures are built once")
    parser.addoption("--order-seed", type=int, default=None, help="the shuffle's seed (default: printed, random)")


def pytest_configure(config):
    """The session's environment without rank variables (every subprocess inherits os.environ); the order's
    seed, one for the controller and every xdist worker (they must collect the same order); progress lines
    (tests/processes.py) to the terminal as they happen, past pytest's output capture."""
    inherited = sorted(name for name in RANK_VARIABLES if name in os.environ)
    for name in inherited:
        del os.environ[name]
    config._inherited_rank_variables = inherited
    seed = config.getoption("--order-seed")
    if seed is None:  # the controller draws it; xdist workers inherit its environment
        seed = int(os.environ.setdefault("TRAINER_TEST_ORDER_SEED", str(random.SystemRandom().randrange(10**6))))
    config._order_seed = seed
    processes.progress = _progress_printer(config)
    if os.environ.get("TRAINER_TEST_PROCESS_LOG"):
        _log_processes()
    if not os.environ.get("PYTEST_XDIST_WORKER") and config.getoption("numprocesses", None):
        return  # the controller runs no test: its workers account for themselves
    config._cpu_group = cpu_account.enter()


def pytest_unconfigure(config):
    cpu_account.leave(getattr(config, "_cpu_group", None))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    item._cpu_start = cpu_account.usage_s(getattr(item.config, "_cpu_group", None))
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """The test's CPU (setup, call, teardown; every process it started) as the JUnit property `cpu_s`: set before
    the teardown report is made, which is the one JUnit reads properties from."""
    yield
    end = cpu_account.usage_s(getattr(item.config, "_cpu_group", None))
    if end is not None and getattr(item, "_cpu_start", None) is not None:
        item.user_properties.append(("cpu_s", round(end - item._cpu_start, 2)))


def _log_processes() -> None:
    """Measurement: every real process a test starts is logged when it ends (tests/preloaded.py's log_process, which
    logs the forked ones)."""
    import subprocess

    class TimedPopen(subprocess.Popen):
        def __init__(self, args, *rest, **kwargs):
            self._started, self._args = time.monotonic(), args
            super().__init__(args, *rest, **kwargs)

        def _handle_exitstatus(self, *args, **kwargs):
            super()._handle_exitstatus(*args, **kwargs)
            preloaded.log_process(self._args, time.monotonic() - self._started, self.returncode, forked=False)
    subprocess.Popen = TimedPopen


def _progress_printer(config):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:  # an xdist worker's own output goes nowhere: it writes to the controller's stderr (Linux's /proc)
        try:
            stream = open(f"/proc/{os.getppid()}/fd/2", "a", buffering=1)
        except OSError:
            stream = sys.__stderr__

        def to_stderr(line: str) -> None:
            print(f"\n[{time.strftime('%H:%M:%S')}] [{worker}] {line}", file=stream, flush=True)
        return to_stderr

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
    return to_terminal


def pytest_report_header(config):
    lines = [f"test order: {config.getoption('--order')}"]
    if config.getoption("--order") == "shuffle":
        lines[0] += f" (--order-seed {config._order_seed})"
    if config._inherited_rank_variables:
        lines.append(f"removed from the test environment: {', '.join(config._inherited_rank_variables)} (a "
                     f"launcher's rank variables: no job the suite starts inherits them)")
    return lines


# xdist (`-n 2 --dist loadfile`, pyproject's addopts): a worker takes whole modules, so a module's fixtures are built
# once; the session fixtures that launch ranks are built once for all workers (`once_per_session`).


DURATIONS = Path(__file__).with_name("durations.json")  # module -> seconds, written by scripts/test_durations.py


def _ordered(items, how: str, seed: int):
    by_module = defaultdict(list)
    for item in items:
        by_module[item.nodeid.split("::", 1)[0]].append(item)
    modules = list(by_module)
    if how == "longest-first":
        # two workers each taking the next whole module: the longest first, or one long module started last would
        # leave the other worker idle for most of it (a new module counts as long: it is likely to launch ranks)
        seconds = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
        modules.sort(key=lambda module: -seconds.get(Path(module).name, 60.0))
        return [item for module in modules for item in by_module[module]]
    if how == "reverse":
        return [item for module in reversed(modules) for item in reversed(by_module[module])]
    rng = random.Random(seed)
    rng.shuffle(modules)
    for module in modules:
        rng.shuffle(by_module[module])
    return [item for module in modules for item in by_module[module]]


def pytest_collection_modifyitems(config, items):
    """Tiers (`quick` for every test not marked slow, multirank or gpu), the order, and `gpu` tests skipped with the
    reason on CPU machines such as CI (flash-attn, Liger, fp16, ZeRO++ quantized weights need CUDA)."""
    quick = pytest.mark.quick
    for item in items:
        if not any(marker in item.keywords for marker in HEAVY):
            item.add_marker(quick)
    how = config.getoption("--order")
    if how != "file":
        items[:] = _ordered(items, how, config._order_seed)
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: DeepSpeed's CPU backend has no fp16, flash-attn, Liger "
                                   "or quantized-weight kernels")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_quick_seconds: dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report):
    """Setup and teardown count too: a module fixture's cost lands on its first test (a fuzz run in a subprocess
    took 18 s of the quick tier in its fixture while the list, reading the call alone, never named it)."""
    if "quick" in report.keywords:
        _quick_seconds[report.nodeid] += report.duration


def pytest_terminal_summary(terminalreporter):
    slowest = sorted(((seconds, nodeid) for nodeid, seconds in _quick_seconds.items() if seconds > QUICK_SLOWEST_S),
                     reverse=True)
    if slowest:
        terminalreporter.write_sep("-", f"quick-tier tests slower than {QUICK_SLOWEST_S:g} s, setup and teardown "
                                        f"included (candidates for `slow`)")
        for duration, nodeid in slowest[:20]:
            terminalreporter.write_line(f"{duration:6.1f} s  {nodeid}")
