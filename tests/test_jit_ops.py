"""DeepSpeed's JIT ops per environment, said out loud (issues 30 and 31): each Python environment gets its own
extensions directory and its own ninja first on PATH (trainer/jit_env.py), whoever starts the process; every op
load is announced with whether it is built and how long a build takes here, with a line every 30 s while it builds
(trainer/jit_ops.py); a missing ninja is a named error the doctor knows; a one-rank generate or evaluate builds
nothing; the ops a preset needs are known ahead (trainer/ds/ops.py, scripts/build_ops.py).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from distributed import REPO, new_port, remove_shm_buffers
from processes import run_group
from trainer import ds as dsc
from trainer import jit_env, jit_ops, waits
from trainer.diagnose.recognise import diagnose
from trainer.errors import UserError
from trainer.presets import load_preset
from trainer.resolve import resolve

SITE_PACKAGES = Path(sysconfig.get_paths()["purelib"])


# --- one extensions directory and one ninja per environment ------------------------------------------------------

def test_each_environment_has_its_own_root_beside_torchs(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    a, b = jit_env.environment_root(Path("/srv/a/.venv")), jit_env.environment_root(Path("/srv/b/.venv"))
    assert a != b and a.parent == b.parent == (tmp_path / "cache" / "torch_extensions").resolve()
    assert a == jit_env.environment_root(Path("/srv/a/.venv"))  # stable: the next run finds its ops
    assert "srv-a-.venv" in a.name and a.name.startswith(f"py{sys.version_info.major}{sys.version_info.minor}-")


def test_a_virtualenv_reached_through_a_symlink_runs_as_its_real_path(tmp_path):
    """Issue 38 item 8: the entry points re-execute under the environment's real path once, so the op builds see
    one spelling of it (two would rewrite build.ninja in turn and rebuild every op); an interpreter that runs the
    entry code embedded (runpy inside another command) is left as it is."""
    prefix = Path(sys.prefix)
    linked = tmp_path / "venv"
    linked.symlink_to(prefix.resolve(), target_is_directory=True)
    python = linked / Path(sys.executable).relative_to(prefix)
    (tmp_path / "probe.py").write_text("import sys\nfrom trainer import jit_env\njit_env.resolve_interpreter()\n"
                                       "print(sys.prefix, sys.argv[1:])\n")
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}"}
    env.pop(jit_env.RESOLVED_ONCE, None)

    def prefix_of(*argv: str) -> str:
        proc = subprocess.run([str(python), *argv], env=env, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout.strip()
    assert prefix_of(str(tmp_path / "probe.py"), "a", "b") == f"{prefix.resolve()} ['a', 'b']"
    assert prefix_of("-m", "probe", "c") == f"{prefix.resolve()} ['c']"
    embedded = f"import runpy, sys; sys.argv = ['probe.py', 'd']; runpy.run_path({str(tmp_path / 'probe.py')!r})"
    assert prefix_of("-c", embedded) == f"{linked} ['d']"


def test_settle_keeps_the_users_choice_and_replaces_another_environments(tmp_path):
    mine = {"PATH": "/usr/bin:/bin", "TORCH_EXTENSIONS_DIR": str(tmp_path / "mine")}
    jit_env.settle(mine)
    assert mine["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "mine")
    assert jit_env.root_origin(mine) == "TORCH_EXTENSIONS_DIR, as set"
    # a root the trainer chose for another environment (a test of one venv starting another's python) is replaced
    other = Path("/elsewhere/.venv")
    inherited = {"PATH": "/usr/bin", "TORCH_EXTENSIONS_DIR": str(jit_env.environment_root(other)),
                 jit_env.CHOSEN_FOR: str(other)}
    jit_env.settle(inherited)
    assert inherited["TORCH_EXTENSIONS_DIR"] == str(jit_env.environment_root())
    assert jit_env.root_origin(inherited).startswith("this environment's")


@pytest.mark.skipif(jit_env.environment_ninja() is None, reason="this environment has no ninja of its own")
def test_the_environments_ninja_goes_first_on_path(tmp_path):
    """Debian's ninja (or any other) first on PATH, as in a shell where the venv is not activated or an ssh
    login: the environment's own goes before it, once."""
    other = tmp_path / "debian"
    other.mkdir()
    (other / "ninja").write_text("#!/bin/sh\necho 1.11.1\n")
    (other / "ninja").chmod(0o755)
    environ = {"PATH": f"{other}:/usr/bin:/bin"}
    jit_env.settle(environ)
    jit_env.settle(environ)
    assert jit_env.ninja_in_use(environ)[0] == str(jit_env.environment_ninja())
    assert environ["PATH"].split(os.pathsep).count(str(jit_env.environment_ninja().parent)) == 1


def second_environment(tmp_path: Path) -> Path:
    """Another virtualenv on this machine (as a second checkout's .venv), using this one's packages through a
    .pth file; it has no ninja of its own."""
    env = tmp_path / "other-checkout" / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    purelib = subprocess.run([str(env / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                              "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip()
    Path(purelib, "parent_env.pth").write_text(f"{SITE_PACKAGES}\n{REPO}\n")
    return env


def test_a_process_of_another_environment_gets_its_own_root_not_its_parents(tmp_path):
    """This test runs in one environment (its TORCH_EXTENSIONS_DIR is set, by the trainer's import) and starts
    another environment's python, as a second checkout's launch would: the child builds in its own root."""
    env = second_environment(tmp_path)
    probe = ("import os, trainer; from trainer import jit_env; "
             "print(os.environ['TORCH_EXTENSIONS_DIR']); print(jit_env.root_origin())")
    child = subprocess.run([str(env / "bin" / "python"), "-c", probe], cwd=REPO, capture_output=True, text=True,
                           timeout=120, env={**os.environ})
    assert child.returncode == 0, child.stderr[-2000:]
    root, origin = child.stdout.splitlines()
    assert root == str(jit_env.environment_root(env.resolve())) != os.environ["TORCH_EXTENSIONS_DIR"]
    assert origin == f"this environment's, {env.resolve()}"


# --- every op load said out loud ---------------------------------------------------------------------------------

class FakeBuild:
    """A stand-in for torch's build (the real one takes minutes): something works in the op's directory for
    `seconds`, then the .so is there."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __call__(self, builder, verbose=True):
        directory = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / builder.name
        directory.mkdir(parents=True, exist_ok=True)
        worker = subprocess.Popen(["sleep", str(self.seconds)], cwd=directory)
        worker.wait()
        (directory / f"{builder.name}.so").write_bytes(b"")
        return "module"


@pytest.fixture
def shm_builder():
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
    return ShareMemCommBuilder()


@pytest.mark.slow
def test_an_op_build_is_announced_and_measured(tmp_path, monkeypatch, shm_builder):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("LOCAL_RANK", "0")
    lines: list[str] = []
    assert jit_ops.announced(FakeBuild(3.5), lines.append)(shm_builder) == "module"
    first = lines[0]
    assert first.startswith("op deepspeed_shm_comm: not built for this environment yet - building it now, once")
    assert f"in {tmp_path / 'ext' / 'deepspeed_shm_comm'}" in first and "with ninja" in first
    assert re.search(r"\(expected \d+(\.\d)? (s|min): measured on 2 CPUs", first)
    assert lines[-1].startswith("op deepspeed_shm_comm: built in")
    history = json.loads((tmp_path / "ext" / jit_ops.HISTORY).read_text())
    seconds = history["deepspeed_shm_comm"][jit_ops.machine_class()]
    assert 3.0 <= seconds < 30
    # the next load: built before; the estimate is now what was measured here
    lines.clear()
    jit_ops.announced(lambda builder, verbose=True: "module", lines.append)(shm_builder)
    assert lines[0].startswith("op deepspeed_shm_comm: built before - loading it")
    assert lines[1].startswith("op deepspeed_shm_comm: loaded in")
    assert jit_ops.op_load(shm_builder).expected() == (seconds, f"measured here, {jit_ops.machine_class()}")


def test_one_rank_per_node_speaks(tmp_path, monkeypatch, shm_builder):
    """The other ranks wait on the speaker's build lock (which jit_locks reports): no line of theirs."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("LOCAL_RANK", "1")
    lines: list[str] = []
    jit_ops.announced(FakeBuild(0), lines.append)(shm_builder)
    assert lines == []


def test_the_heartbeat_names_the_build_every_30_s_while_it_runs(tmp_path, monkeypatch, shm_builder):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    op = jit_ops.op_load(shm_builder)
    op.directory.mkdir(parents=True)
    with open(op.directory / "lock", "w") as lock:  # a build holds its lock file open (torch's FileBaton)
        worker = subprocess.Popen(["sleep", "30"], cwd=op.directory, stdin=lock)
    expected = waits.duration(op.expected()[0])
    try:
        with waits.during(op.still) as build:
            due = [waits.report_now(30.0, build.started + seconds) for seconds in (5, 29, 30, 45, 60, 61)]
    finally:
        worker.kill()
        worker.wait()
    line = f"op deepspeed_shm_comm: still building (pid {worker.pid} (sleep)) - {{}} so far, ~{expected} expected"
    assert due == [None, None, line.format("30 s"), None, line.format("60 s"), None]
    assert waits.report_now(0.0) is None  # the wait is over: nothing to report


def test_an_op_nobody_listed_gets_an_estimate_from_its_sources(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    op = jit_ops.OpLoad("some_new_op", tmp_path / "some_new_op", ["a.cpp", "b.cpp", "c.cu"])
    seconds, basis = op.expected()
    assert seconds > jit_ops.SECONDS_PER_SOURCE[".cu"] and "3 source file(s)" in basis


@pytest.mark.parametrize("history", ['{"deepspeed_shm_comm": 12', '["a list"]', '{"deepspeed_shm_comm": 7}',
                                     '{"deepspeed_shm_comm": {"%s": "soon"}}' % jit_ops.machine_class(),
                                     '{"deepspeed_shm_comm": {"%s": -1}}' % jit_ops.machine_class()])
def test_a_damaged_history_falls_back_to_the_reference(tmp_path, monkeypatch, shm_builder, history):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    (tmp_path / jit_ops.HISTORY).write_text(history)
    seconds, basis = jit_ops.op_load(shm_builder).expected()
    assert seconds >= jit_ops.REFERENCE_S["deepspeed_shm_comm"] and basis.startswith("measured on 2 CPUs")


def test_no_ninja_is_a_named_error_with_the_fix_and_the_doctor_knows_it(monkeypatch, shm_builder, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no ninja anywhere
    built = []
    load = jit_ops.announced(lambda builder, verbose=True: built.append(builder), lambda line: None)
    with pytest.raises(UserError) as refused:
        load(shm_builder)
    message = str(refused.value)
    assert not built and "deepspeed_shm_comm" in message and f"-m pip install {jit_env.NINJA_PIN}" in message
    d = diagnose(resolve(load_preset("tiny_cpu")), f"[rank 0] error: {message}\n")
    assert d.failure == "op_build" and "no ninja" in d.title and "pip install ninja" in d.proposal.step
    # ... and DeepSpeed's own words for it, as the issue saw them
    d = diagnose(resolve(load_preset("tiny_cpu")), "RuntimeError: Unable to JIT load the deepspeed_shm_comm op due "
                                                   "to ninja not being installed.\n")
    assert d.failure == "op_build" and "deepspeed_shm_comm" in d.title and "pip install ninja" in d.proposal.step


# --- which ops a run needs, and none for one rank ----------------------------------------------------------------

def test_the_ops_a_config_needs():
    ds = resolve(load_preset("tiny_cpu")).ds
    assert dsc.jit_ops(ds, 2, "cpu") == ["deepspeed_shm_comm", "fused_adam"]
    assert dsc.jit_ops(ds, 1, "cpu") == ["fused_adam"]
    assert dsc.jit_ops(ds, 8, "cuda") == ["fused_adam"]
    offload = resolve(load_preset("tiny_cpu", ["deepspeed.zero_optimization.offload_optimizer={device: cpu}"])).ds
    assert dsc.jit_ops(offload, 2, "cpu") == ["deepspeed_shm_comm", "cpu_adam"]
    torch_adam = resolve(load_preset("tiny_cpu", ["deepspeed.optimizer.params.torch_adam=true"])).ds
    assert dsc.jit_ops(torch_adam, 1, "cpu") == []


def announced_ops(output: str) -> list[str]:
    return list(dict.fromkeys(re.findall(r"op (\w+): (?:not built|built before)", output)))


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["z2", "z2_cpu_offload"])
def test_a_one_rank_training_loads_the_ops_its_config_names_and_says_so(stage, tmp_path):
    """The prediction setup.sh builds from is what a real run loads (one rank: no comm op); the first eval says
    what it runs once."""
    from conftest import STAGES, TINY
    from distributed import last_wins
    items = last_wins(TINY + STAGES[stage] + ["train.max_steps=4", "train.eval_every=2", "train.save_every=0",
                                              f"train.output_dir={tmp_path / 'run'}"])
    proc = run_group([sys.executable, "train.py", "--preset", "tiny_cpu", "--world-size", "1",
                      *[w for i in items for w in ("--set", i)]],
                     cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true"}, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:]
    expected = dsc.jit_ops(resolve(load_preset("tiny_cpu", items)).ds, 1, "cpu")
    assert announced_ops(proc.stdout) == expected and expected
    assert len(re.findall(r"eval at step 2: the run's first, 8 sequence\(s\) from 1 source\(s\), \d+ forward",
                          proc.stdout)) == 1
    assert "eval at step 4: the run's first" not in proc.stdout


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    path = tmp_path_factory.mktemp("model")
    config = AutoConfig.for_model("llama", hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                  num_key_value_heads=2, intermediate_size=96, vocab_size=1024,
                                  max_position_embeddings=64)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(str(REPO / "data/tiny/tokenizer")).save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("command", [["generate", "--prompt", "Once upon", "--max-new-tokens", "4"],
                                     ["evaluate", "--data", "data/tiny/pretrain.jsonl", "--eval-sequences", "4",
                                      "--seq-len", "32"]], ids=["generate", "evaluate"])
def test_a_one_rank_generate_or_evaluate_builds_nothing(command, tiny_model, tmp_path):
    """With an empty extensions directory: no op directory appears (DeepSpeed's comm op is for peers)."""
    ext = tmp_path / "ext"
    ext.mkdir()
    started = time.monotonic()
    proc = run_group([sys.executable, "-m", "trainer", command[0], "--model", str(tiny_model), *command[1:]],
                     cwd=REPO, env={**os.environ, "TORCH_EXTENSIONS_DIR": str(ext)}, timeout=600, merge=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(ext.iterdir()) == [] and "op " not in proc.stderr
    print(f"one-rank {command[0]} with an empty extensions directory: {time.monotonic() - started:.1f} s")


@pytest.mark.slow
def test_two_ranks_still_use_the_shared_memory_op(tmp_path, tiny_model):
    """The one-rank shortcut is for one rank only: two ranks load the comm op (from this environment's root)."""
    port = new_port()
    try:
        proc = run_group([str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port",
                          str(port), "--module", "trainer", "generate", "--model", str(tiny_model), "--prompt", "Hi",
                          "--max-new-tokens", "2"], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                         timeout=900)
    finally:
        remove_shm_buffers(port)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert announced_ops(proc.stdout) == ["deepspeed_shm_comm"]


@pytest.mark.slow
def test_build_ops_builds_what_a_preset_needs(tmp_path):
    """scripts/build_ops.py (what `scripts/setup.sh tiny_cpu` runs), against this environment's root, where the
    suite's runs have built or will build them anyway: every op ready, each announced."""
    proc = run_group([sys.executable, "scripts/build_ops.py", "tiny_cpu"], cwd=REPO, timeout=1200, merge=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "build_ops: tiny_cpu on cpu: deepspeed_shm_comm, fused_adam" in proc.stdout
    assert announced_ops(proc.stdout) == ["deepspeed_shm_comm", "fused_adam"]
    assert re.search(r"build_ops: done in", proc.stdout)
    refused = run_group([sys.executable, "scripts/build_ops.py", "7b_8xa100"], cwd=REPO, timeout=300, merge=False)
    assert refused.returncode == 2 and "build them on the machine that runs 7b_8xa100" in refused.stderr
