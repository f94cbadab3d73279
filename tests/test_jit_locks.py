"""Stale JIT-build locks (issue 24): a `lock` file that a killed op build left in the torch extensions directory
makes every later run wait for ever in silence. The trainer and preflight name such a file before DeepSpeed
loads its ops and, while a rank waits on it, print the file, its age and the removal command. Tested by planting
a lock in a private TORCH_EXTENSIONS_DIR for the op DeepSpeed builds first on CPU ranks (deepspeed_shm_comm).
"""
from __future__ import annotations

import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from distributed import DEEPSPEED, REPO, new_port, remove_shm_buffers
from processes import stop_tree
from trainer import jit_locks
from trainer.diagnose.recognise import diagnose
from trainer.presets import load_preset
from trainer.resolve import resolve

OP = "deepspeed_shm_comm"  # DeepSpeed's CPU all-reduce op, built inside deepspeed.init_distributed on CPU ranks


def plant(root: Path, minutes_old: float, op: str = OP) -> Path:
    lock = root / op / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    then = time.time() - minutes_old * 60
    os.utime(lock, (then, then))
    return lock


def test_the_extensions_root_is_torchs(tmp_path, monkeypatch):
    """The same directory torch's cpp_extension builds in: TORCH_EXTENSIONS_DIR, else its default with the
    python/accelerator tag."""
    from torch.utils.cpp_extension import _get_build_directory
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert Path(_get_build_directory("probe", False)).parent == jit_locks.extensions_root()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    assert jit_locks.extensions_root() == tmp_path / "mine"


def test_a_lock_no_build_owns_is_stale_and_says_how_to_remove_it(tmp_path):
    lock = plant(tmp_path, minutes_old=22)
    (found,) = jit_locks.locks(tmp_path)
    assert found.stale and found.path == lock
    text = found.describe()
    assert str(lock) in text and "22 min old" in text and f"rm -f {shlex.quote(str(lock))}" in text
    young = plant(tmp_path, minutes_old=0.1, op="cpu_adam")  # a build that is only starting
    assert not jit_locks.Lock.at(young).stale


HOLD = "import os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); print('held', flush=True); time.sleep(60)"


def test_a_lock_a_running_build_holds_is_not_stale_and_one_nobody_holds_is(tmp_path):
    """The holder is the live process with the lock file open (torch's FileBaton keeps it open while it builds),
    not a process that merely sits in the op's directory (a shell, an editor): an hour-old lock with only such a
    process there is stale, and the same lock held is not; once the holder dies it is stale again."""
    lock = plant(tmp_path, minutes_old=60)
    bystander = subprocess.Popen(["sleep", "60"], cwd=lock.parent)
    builder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert builder.stdout.readline().strip() == "held"
        found = jit_locks.Lock.at(lock)
        assert found.builder == f"pid {builder.pid} (python{sys.version_info.major}.{sys.version_info.minor})" \
            or found.builder.startswith(f"pid {builder.pid} ("), found.builder
        assert not found.stale and "is being built by" in found.describe() and "rm -f" not in found.describe()
        builder.kill()
        builder.wait()
        assert jit_locks.Lock.at(lock).stale  # the bystander in the directory does not make it a build
    finally:
        for process in (bystander, builder):
            process.kill()
            process.wait()


HOSTILE = ["'$(touch {canary})'", "x;touch {canary}", "`touch {canary}`", "$HOME", "-rf", "\\", "*", "it's"]


def drawn_name(rng: random.Random, canary: Path) -> bytes:
    """An op directory name as a file system allows it: any bytes but '/' and NUL (text that is not UTF-8, control
    characters, shell syntax), often with a command substitution that would touch the canary."""
    raw = bytes(rng.choice([rng.randrange(1, 256), rng.choice(b"'\"$`\\ \n\t;*?[]{}()<>|&!#~\x1b")])
                for _ in range(rng.randint(1, 10))).replace(b"/", b"_")
    if rng.random() < 0.5:
        raw += rng.choice(HOSTILE).format(canary=canary).encode()
    return b"_" + raw if raw in (b".", b"..") else raw


def test_the_printed_removal_command_names_exactly_the_lock_whatever_the_op_directory_is_called(tmp_path):
    """Drawn op directory names (any bytes a name may hold): the removal command, as a terminal shows it (UTF-8,
    what cannot be encoded escaped), holds no control character, parses to the lock's path, and run by bash
    removes that file and runs nothing else."""
    rng = random.Random(38)
    canary = tmp_path / "RAN"
    for i in range(40):
        name = os.fsdecode(drawn_name(rng, canary))
        lock = plant(tmp_path / f"root{i}", minutes_old=40, op=name)
        command = jit_locks.Lock.at(lock).describe().split("Remove it: ", 1)[1]
        shown = command.encode("utf-8", "backslashreplace")  # what stderr writes
        assert not [c for c in shown if c < 0x20 or c == 0x7F], (name, command)
        subprocess.run(["bash", "-c", shown], check=True)
        assert not lock.exists() and not canary.exists(), (name, command)
        assert lock.parent.exists()


def test_the_one_quoting_function_is_the_same_bytes_when_run_and_printable_when_shown():
    """shell.quote on drawn words (any code point, bytes that are not UTF-8, shell syntax): bash reads back the
    word's bytes exactly, and the quoted text holds no control character to reach a terminal."""
    from trainer.shell import quote
    rng = random.Random(39)
    words = []
    for _ in range(300):
        raw = bytes(rng.randrange(1, 256) for _ in range(rng.randint(0, 6)))
        text = "".join(chr(rng.choice([rng.randrange(0x20, 0x7F), rng.randrange(0, 0x20), rng.randrange(0xA0, 0x3000),
                                       rng.randrange(0x10000, 0x10FFFF)])) for _ in range(rng.randint(0, 6)))
        word = rng.choice([os.fsdecode(raw), text.replace("\x00", ""), os.fsdecode(raw) + text.replace("\x00", "")])
        words.append(word)
    quoted = [quote(word) for word in words]
    for word, text in zip(words, quoted):
        assert not [c for c in text.encode("utf-8", "backslashreplace") if c < 0x20 or c == 0x7F], (word, text)
    script = "".join(f"printf '%s\\0' {text}\n" for text in quoted).encode("utf-8", "surrogateescape")
    out = subprocess.run(["bash", "-c", script], capture_output=True, check=True).stdout
    assert out.split(b"\0")[:-1] == [os.fsencode(word) for word in words]


def test_a_stale_lock_beside_a_built_op_is_removed_and_named(tmp_path, monkeypatch):
    built = plant(tmp_path, minutes_old=30, op="cpu_adam")
    (built.parent / "cpu_adam.so").write_bytes(b"")
    unbuilt = plant(tmp_path, minutes_old=30, op="fused_adam")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    said: list[str] = []
    monkeypatch.setattr(jit_locks.waits, "watch", lambda emit, probe: None)
    jit_locks.check_and_watch(said.append)
    assert not built.exists() and unbuilt.exists()
    assert any("removed stale JIT lock" in s and "cpu_adam is already built" in s for s in said), said
    assert any("stale JIT lock" in s and str(unbuilt) in s and "rm -f" in s for s in said), said


# The first op each run loads: one training rank has no peer, so no comm op (trainer/distributed.py), and goes
# straight to its optimizer's; two preflight ranks load the comm op.
RUNS = {"train": ([sys.executable, "train.py", "--preset", "tiny_cpu", "--world-size", "1"], "fused_adam"),
        "preflight": ([str(DEEPSPEED), "--num_gpus", "2", "--master_port", "{port}", "--module", "trainer",
                       "preflight", "--preset", "tiny_cpu"], OP)}


@pytest.mark.slow
@pytest.mark.parametrize("run_name", sorted(RUNS))
def test_a_planted_lock_is_named_before_the_ops_load_and_while_the_rank_waits(run_name, tmp_path):
    command, op = RUNS[run_name]
    port = new_port()
    lock = plant(tmp_path / "ext", minutes_old=22, op=op)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "TRAINER_JIT_LOCK_REPORT_S": "1",
           "PYTHONPATH": str(REPO)}
    env.pop("RANK", None)
    run = subprocess.Popen([word.format(port=port) for word in command], cwd=REPO, env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[str] = []
    try:
        deadline = time.time() + 180
        while time.time() < deadline and sum(line.startswith("[rank 0] waiting") for line in lines) < 2:
            line = run.stderr.readline()
            if not line:
                break
            lines.append(line)
    finally:
        stop_tree(run.pid)  # it waits on the planted lock: nothing is building, nothing half-written
        run.wait()
        remove_shm_buffers(port)
    named = [line for line in lines if str(lock) in line]
    assert named and "stale JIT lock" in named[0] and "22 min old" in named[0], lines[-5:]
    waits = [line for line in named if line.startswith("[rank 0] waiting")]
    assert len(waits) >= 2 and all(f"rm -f {shlex.quote(str(lock))}" in line for line in waits)
    # ... and the doctor reads that log
    d = diagnose(resolve(load_preset("tiny_cpu")), "".join(lines))
    assert d.failure == "jit_lock" and d.proposal.step == f"remove the stale lock: rm -f {lock}"


def test_the_doctor_reads_a_log_that_stops_while_loading_an_op():
    # the end of the log of deepspeedai/DeepSpeedExamples#842 ("Step3 hanging for a long time")
    text = ("[2024-01-02 07:30:41,488] [INFO] [partition_parameters.py:348:__exit__] finished initializing model - "
            "num_params = 517, num_elems = 2.78B\n"
            + "Using /root/.cache/torch_extensions/py39_cu117 as PyTorch extensions root...\n" * 4)
    d = diagnose(resolve(load_preset("7b_8xa100")), text)
    assert d.failure == "jit_lock" and "stopped while loading" in d.title
    assert d.proposal.step == "remove the stale lock: rm -f /root/.cache/torch_extensions/py39_cu117/*/lock"
    assert diagnose(resolve(load_preset("7b_8xa100")), text + "step=1, loss=2.3\n").failure != "jit_lock"


@pytest.mark.slow
def test_sigterm_during_an_op_build_stops_the_build_and_leaves_no_lock(tmp_path):
    """Issue 38 item 8: `python -m trainer launch` signalled while rank 0 builds an op (here the CPU all-reduce, in a
    private extensions directory) - the build stops at once (no compiler left running), its lock goes with it, the
    rank says so, and the next run is not left waiting on the lock."""
    ext = tmp_path / "ext"
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(ext), "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    launch = subprocess.Popen([sys.executable, "-m", "trainer", "launch", "tiny_cpu", "--master-port",
                               str(new_port()), "--set", f"train.output_dir={tmp_path / 'run'}"], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    try:
        for line in launch.stdout:
            lines.append(line)
            if f"op {OP}: not built for this environment yet" in line:
                break
        deadline = time.time() + 60  # the build has started once ninja's compilers run
        while time.time() < deadline and not any((d / "build.ninja").is_file() for d in ext.glob("*")):
            time.sleep(0.2)
        time.sleep(2)
        assert (ext / OP / "lock").is_file(), "".join(lines[-20:])
        launch.send_signal(signal.SIGTERM)
        lines += launch.stdout.readlines()
        code = launch.wait(timeout=120)
    finally:
        stop_tree(launch.pid)
        launch.wait()
    output = "".join(lines)
    assert f"op {OP}: build stopped by SIGTERM - its compilers stopped, no lock left" in output, output[-4000:]
    assert code != 0 and not (ext / OP / "lock").exists()
    compilers = [p for p in psutil.process_iter(["cmdline"]) if str(ext) in " ".join(p.info["cmdline"] or [])]
    assert compilers == [], [p.info["cmdline"][:3] for p in compilers]
