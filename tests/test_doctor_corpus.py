"""The doctor on real failure logs: excerpts users posted in public issue threads (tests/logs/real/), each
with a sidecar naming its source, the cause and fix the thread gives, and what the doctor must conclude -
the failure and the first proposed change - against a shipped preset. Fast: no ranks, in-process.
"""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from doctor_checks import assert_pasteable, assert_resolves, assert_the_trainer_accepts
from trainer.__main__ import main
from trainer.diagnose.doctor import diagnose

REAL = Path(__file__).resolve().parent / "logs" / "real"
SIDECARS = sorted(REAL.glob("*.json"))
# Every kind of failure the doctor knows of real users' logs (issue 15), each with at least one real log.
KINDS = {"host_oom", "op_build", "nccl_barrier_timeout", "nccl_desync", "nccl_timeout", "fp16_loss_scale",
         "init_oom", "cuda_oom", "not_distributed", "zero3_load", "ssh_launch", "nvme_aio", "stage3_save",
         "ds_version"}


def case(sidecar: Path) -> dict:
    return json.loads(sidecar.read_text())


def run(meta: dict, text: str, nvme_dir: str):
    expect = meta["expect"]
    base = expect.get("preset_overrides", [])
    return diagnose(assert_resolves(expect["preset"], base), text,
                    lambda extra: assert_resolves(expect["preset"], base + extra, nvme_dir))


def test_the_corpus_covers_every_kind_with_real_logs():
    kinds = [case(s)["expect"]["failure"] for s in SIDECARS]
    assert len(SIDECARS) >= 25 and KINDS <= set(kinds), sorted(KINDS - set(kinds))
    assert {s.stem.rsplit("_", 1)[0] for s in SIDECARS} <= KINDS  # named <kind>_<n>
    assert sorted(p.stem for p in REAL.glob("*.log")) == [s.stem for s in SIDECARS]


@pytest.mark.parametrize("sidecar", SIDECARS, ids=lambda p: p.stem)
def test_sidecar_names_its_source(sidecar):
    meta = case(sidecar)
    assert meta["source"].startswith("https://github.com/") and meta["repo"] in meta["source"]
    assert all(meta[key].strip() for key in ("thread", "cause", "fix"))
    log = sidecar.with_suffix(".log").read_text()
    assert 1 <= len(log.splitlines()) <= 60  # an excerpt, not the thread


@pytest.mark.parametrize("sidecar", SIDECARS, ids=lambda p: p.stem)
def test_real_log_diagnosis_and_first_change(sidecar, tmp_path):
    meta = case(sidecar)
    expect, text = meta["expect"], sidecar.with_suffix(".log").read_text()
    d = run(meta, text, str(tmp_path))
    assert d.failure == expect["failure"], (d.failure, d.title)
    first = d.proposal.overrides if d.proposal else None
    if "first_overrides" in expect:
        assert first == expect["first_overrides"], first
    if "first_overrides_start" in expect:
        assert first[:len(expect["first_overrides_start"])] == expect["first_overrides_start"], first
    if "first_overrides_any_of" in expect:
        assert any(first[:len(option)] == option for option in expect["first_overrides_any_of"]), first
    if "first_step_contains" in expect:
        assert expect["first_step_contains"] in d.proposal.step, d.proposal.step
    if "advice_contains" in expect:
        assert any(expect["advice_contains"] in a for a in d.advice), d.advice
    assert_pasteable(expect["preset"], expect.get("preset_overrides", []), d, str(tmp_path))


@pytest.mark.parametrize("sidecar", SIDECARS, ids=lambda p: p.stem)
def test_windows_line_endings_change_nothing(sidecar, tmp_path):
    meta = case(sidecar)
    text = sidecar.with_suffix(".log").read_text()
    plain, crlf = run(meta, text, str(tmp_path)), run(meta, text.replace("\n", "\r\n"), str(tmp_path))
    assert (crlf.failure, crlf.proposal) == (plain.failure, plain.proposal)


@pytest.mark.parametrize("sidecar", SIDECARS, ids=lambda p: p.stem)
def test_real_log_rerun_command_is_one_the_trainer_accepts(sidecar, tmp_path):
    expect = case(sidecar)["expect"]
    argv = ["doctor", expect["preset"], str(sidecar.with_suffix(".log")), "--json"]
    for item in expect.get("preset_overrides", []):
        argv += ["--set", item]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    report = json.loads(out.getvalue())
    assert code == 0 and report["recognised"] and len(report["evidence"]) <= 300
    if report["proposal"] is None:
        assert report["command"] is None
        return
    assert_the_trainer_accepts(report["command"], expect["preset"], str(tmp_path))
