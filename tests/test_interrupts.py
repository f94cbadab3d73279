"""Ctrl-C in any command: exit 130, one line saying so, no traceback (from the process or its workers), and what
it wrote is whole (issue: hardening round 2). The signal goes to the whole process group, as a terminal sends it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from distributed import REPO

WORDS = "the cat sat on a mat and then the dog ran after a red ball in the park".split()


def as_from_a_terminal() -> None:
    """Ctrl-C's default action, as a command typed at a terminal has it: a test suite started in the background
    of a non-interactive shell (`pytest ... &`) runs with SIGINT ignored, and every child would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupted(args: list[str], when: str | float, timeout: float = 240, times: int = 1) -> tuple[int, str]:
    """Run `python -m trainer ARGS` in its own process group; send SIGINT to the group `when` seconds after the
    start, or once stderr has shown the text `when` `times` times. Returns (exit code, stderr)."""
    proc = subprocess.Popen([sys.executable, "-m", "trainer", *args], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=as_from_a_terminal)
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    started = time.monotonic()
    if isinstance(when, str):
        while sum(when in line for line in list(seen)) < times:
            assert proc.poll() is None, f"ended before {when!r}: {''.join(seen)[-2000:]}"
            assert time.monotonic() - started < timeout, f"never printed {when!r}"
            time.sleep(0.05)
    else:
        time.sleep(when)
    assert proc.poll() is None, "the command ended before the signal: the test proves nothing"
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=timeout)
    reader.join(timeout=30)
    return proc.returncode, "".join(seen)


def assert_clean_interrupt(code: int, err: str, command: str) -> None:
    assert code == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert err.count("interrupted (Ctrl-C)") == 1 and f"{command}: interrupted" in err, err[-3000:]


@pytest.mark.slow
def test_ctrl_c_while_the_commands_import(tmp_path):
    """`evaluate` imports torch and transformers before it parses its flags (the light commands no longer import
    anything heavy, so they end before a signal could reach their imports)."""
    code, err = interrupted(["evaluate", "--model", str(tmp_path), "-o", str(tmp_path / "r.json")], when=1.0)
    assert_clean_interrupt(code, err, "evaluate")
    assert not (tmp_path / "r.json").exists()


@pytest.mark.slow
def test_ctrl_c_in_prepare_data_with_worker_processes(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    with open(corpus, "w") as out:
        for i in range(600_000):
            out.write(json.dumps({"text": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(12))}) + "\n")
    out_dir = tmp_path / "prepared"
    code, err = interrupted(["prepare-data", "--source", str(corpus), "--tokenizer", "data/tiny/tokenizer",
                             "--out", str(out_dir), "--num-proc", "2", "--records-per-shard", "150000"],
                            when="prepare: train shard 1:")  # shard 0 is written, shard 1 is being tokenized
    assert_clean_interrupt(code, err, "prepare-data")
    assert not (out_dir / "manifest.json").exists()
    for marker in (out_dir / "train").glob("[0-9]*.json"):  # every shard it marked finished is whole
        entry = json.loads(marker.read_text())
        for suffix, info in entry["files"].items():
            assert marker.with_suffix(f".{suffix}").stat().st_size == info["bytes"]


@pytest.mark.multirank  # needs a trained run (conftest's engine runs)
def test_ctrl_c_in_generate(engine_runs, tmp_path):
    model = engine_runs[0]["export_z2"] / "hf"
    prompts = tmp_path / "prompts.jsonl"  # enough work to be still running when the signal comes
    prompts.write_text("".join(json.dumps({"prompt": f"{WORDS[i % len(WORDS)]} {i}"}) + "\n" for i in range(5000)))
    code, err = interrupted(["generate", "--model", str(model), "--prompts", str(prompts), "--batch-size", "1",
                             "--max-new-tokens", "32", "--ignore-eos", "-o", str(tmp_path / "out.txt")],
                            when="inference:")
    assert_clean_interrupt(code, err, "generate")
    assert not (tmp_path / "out.txt").exists()
