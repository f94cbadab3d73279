"""Experiments that survive preemption (issue 13, part A): one wandb run across resumes whose history holds each step
once, metrics.jsonl rewound at a resume, provenance in config.resolved.yaml and wandb, TensorBoard as a second tracker.

The preempted run is real: one CPU rank, wandb offline, SIGKILLed after step 7 (the last checkpoint is step 4, so
steps 5-7 were logged and are lost), then resumed with --resume auto to step 12. It pauses 5 s after step 5: wandb-core
writes its offline file every few seconds (trainer/train/trackers.py), and a kill right after a checkpoint would find
the rows before it unwritten, which is wandb's behaviour, not what this test is about. wandb's history is read back from the
offline files with wandb's own reader (`wandb leet inspect --json`, wandb-core's transaction-log reader: wandb 0.31
ships no Python one), TensorBoard's with its EventAccumulator.
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from conftest import STAGES, TINY
from distributed import REPO, last_wins, launch, launch_raw, run_cli, with_faults
from trainer import provenance
from trainer.train.metrics import REWOUND_FILE, rewind_metrics


WANDB = Path(sys.executable).parent / "wandb"
KILL_AT, SAVED, MAX_STEPS = 7, 4, 12
RUN = TINY + STAGES["z2"] + [
    "hardware.gpus_per_node=1", f"train.max_steps={MAX_STEPS}", f"train.save_every={SAVED}", "train.eval_every=4",
    "logging.log_every=1", "logging.progress_bar=false", "logging.wandb_mode=offline", "logging.wandb_project=tests",
    "logging.tensorboard=true", "logging.wandb_log_model=true", "train.export_hf=true"]


def train_args(out, *extra) -> list[str]:
    args = ["train.py", "--preset", "tiny_cpu"]
    for item in last_wins(RUN + [f"train.output_dir={out}", *extra]):
        args += ["--set", item]
    return args


def rows_of(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [json.loads(line) for line in (run_dir / name).read_text().splitlines()]


def wandb_records(offline_dir: Path) -> list[dict]:
    """Every record of an offline run's transaction log, as wandb's own reader prints them."""
    proc = subprocess.run([str(WANDB), "leet", "inspect", "--json", str(offline_dir)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def numeric(row: dict) -> dict:
    return {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """The run killed after step 7 and resumed to step 12; what the run directory held in between."""
    out = tmp_path_factory.mktemp("preempted") / "run"
    code, output = launch_raw(with_faults(train_args(out)), ranks=1, env={"TRAINER_FAULTS": f"pause_at@{SAVED + 1},kill_at@{KILL_AT}"})
    assert code != 0, f"kill_at@{KILL_AT} did not kill the run:\n{output[-3000:]}"
    before = {"run_id": (out / "wandb_run_id").read_text().strip(), "rows": rows_of(out),
              "tb_files": sorted((out / "tensorboard").glob("events.out.tfevents.*"))}
    output = launch(train_args(out, "train.resume=auto"), ranks=1)
    assert f"continuing from {out / 'checkpoints' / f'step_{SAVED:08d}'}" in output
    return out, before


@pytest.mark.multirank
def test_one_wandb_run_whose_offline_history_has_each_step_once_and_equals_metrics_jsonl(preempted):
    out, before = preempted
    run_id = (out / "wandb_run_id").read_text().strip()
    assert run_id == before["run_id"]
    state = json.loads((out / "checkpoints" / f"step_{MAX_STEPS:08d}" / "trainer_state.json").read_text())
    assert state["trainer"]["wandb_run_id"] == run_id
    offline = sorted((out / "wandb").glob("offline-run-*"))  # one per invocation, oldest first
    assert [p.name.rsplit("-", 1)[1] for p in offline] == [run_id, run_id]

    records = [wandb_records(p) for p in offline]
    steps = [r["history"]["item"]["_step"] for recs in records for r in recs if r["type"] == "history"]
    assert len(steps) == len(set(steps)), f"a step twice in wandb: {steps}"
    history = {r["history"]["item"]["_step"]: r["history"]["item"] for recs in records for r in recs
               if r["type"] == "history"}
    rows = [r for r in rows_of(out) if "event" not in r]
    assert sorted(history) == sorted({r["step"] for r in rows}) == list(range(1, MAX_STEPS + 1))
    for row in rows:
        for key, value in numeric(row).items():
            assert history[row["step"]][key] == pytest.approx(value, rel=1e-12, abs=1e-12), (row["step"], key)
    # the resumed invocation carries wandb's rewind point, which `wandb sync` applies on the server
    run_record = next(r["run"] for r in records[1] if r["type"] == "run")
    assert run_record["branch_point"] == {"metric": "_step", "run": run_id, "value": SAVED}
    assert {"preset:tiny_cpu", "task:pretrain", "hw:1xcpu"} <= set(run_record["tags"])
    assert "provenance" in json.dumps(run_record["config"])
    assert any(r["type"] == "artifact" and r["artifact"]["type"] == "model" for r in records[1]), \
        "logging.wandb_log_model: the HF export is not logged as an artifact"


@pytest.mark.multirank
def test_metrics_jsonl_is_rewound_at_the_resume(preempted):
    out, before = preempted
    assert max(r["step"] for r in before["rows"]) == KILL_AT  # steps 5-7 were logged before the kill
    rows = rows_of(out)
    train = [r["step"] for r in rows if "loss" in r]
    evals = [r["step"] for r in rows if "eval_loss" in r]
    assert train == list(range(1, MAX_STEPS + 1)) and evals == [4, 8, 12]
    assert {"step": SAVED, "event": "resume", "checkpoint": f"step_{SAVED:08d}", "world_size": 1} in rows
    rewound = rows_of(out, REWOUND_FILE)
    assert sorted({r["step"] for r in rewound}) == list(range(SAVED + 1, KILL_AT + 1))
    assert all(r["rewound_by"]["checkpoint"] == f"step_{SAVED:08d}" for r in rewound)
    lost = {r["step"]: r for r in before["rows"] if "loss" in r and r["step"] > SAVED}
    assert [r for r in rewound if "loss" in r] == [{**lost[s], "rewound_by": rewound[0]["rewound_by"]} for s in lost]


@pytest.mark.multirank
def test_tensorboard_scalars_equal_metrics_jsonl_once_per_step(preempted):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out, before = preempted
    # the killed invocation's events hold the lost steps; the resumed writer's purge_step hides them
    first = EventAccumulator(str(before["tb_files"][0]))
    first.Reload()
    assert [e.step for e in first.Scalars("loss")] == list(range(1, KILL_AT + 1))
    board = EventAccumulator(str(out / "tensorboard"))
    board.Reload()
    rows = [r for r in rows_of(out) if "event" not in r]
    expected: dict[str, dict[int, float]] = {}
    for row in rows:
        for key, value in numeric(row).items():
            expected.setdefault(key, {})[row["step"]] = value
    assert set(board.Tags()["scalars"]) == set(expected)
    for key, by_step in expected.items():
        events = board.Scalars(key)
        assert [e.step for e in events] == sorted(by_step), key
        for event in events:
            assert event.value == pytest.approx(by_step[event.step], rel=1e-6, abs=1e-30), (key, event.step)


@pytest.mark.multirank
def test_the_run_records_its_provenance(preempted):
    out, _ = preempted
    resolved = yaml.safe_load((out / "config.resolved.yaml").read_text())
    prov = resolved["provenance"]
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    status = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True).stdout
    assert prov["git"]["commit"] == head and prov["git"]["dirty"] == bool(status.strip())
    assert prov["trainer_version"] == metadata.version("deepspeed-preset-trainer")
    assert prov["versions"] == {"python": prov["versions"]["python"], "torch": metadata.version("torch"),
                                "deepspeed": metadata.version("deepspeed"),
                                "transformers": metadata.version("transformers")}
    assert prov["world"] == {"world_size": 1, "nodes": 1, "ranks_per_node": 1, "data_parallel_size": 1,
                             "tensor_parallel_size": 1}
    assert prov["resolved_hash"] == provenance.resolved_hash(resolved)
    # the resume (train.resume=auto) is a volatile field: both invocations trained the same configuration
    first, second = (yaml.safe_load(p.read_text()) for p in sorted((out / "configs").glob("*.yaml")))
    assert first["train"]["resume"] is None and second["train"]["resume"] == "auto"
    assert first["provenance"]["resolved_hash"] == second["provenance"]["resolved_hash"]


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                          env=env).stdout.strip()


@pytest.mark.slow
def test_provenance_of_a_clean_and_a_dirty_tree(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "train.py").write_text("print('v1')\n")
    git(repo, "add", "train.py")
    git(repo, "commit", "-q", "-m", "v1")
    commit = git(repo, "rev-parse", "HEAD")
    world = provenance.world_layout(8, 4, 4, 2)
    clean = provenance.collect({"train": {"lr": 1e-3}}, world, repo)
    assert clean["git"] == {"commit": commit, "dirty": False, "changed_files": 0}
    assert clean["world"] == {"world_size": 8, "nodes": 2, "ranks_per_node": 4, "data_parallel_size": 4,
                              "tensor_parallel_size": 2}
    (repo / "train.py").write_text("print('v2, not committed')\n")
    (repo / "notes.txt").write_text("untracked\n")
    dirty = provenance.collect({"train": {"lr": 1e-3}}, world, repo)
    assert dirty["git"] == {"commit": commit, "dirty": True, "changed_files": 2}
    assert dirty["resolved_hash"] == clean["resolved_hash"]


def test_provenance_without_a_repository_or_without_git_says_why(tmp_path, monkeypatch):
    plain = provenance.git_state(tmp_path)
    assert plain["commit"] is None and plain["dirty"] is None and "not a git checkout" in plain["reason"]
    monkeypatch.setenv("PATH", str(tmp_path))  # no git binary on it
    assert provenance.git_state(REPO) == {"commit": None, "dirty": None, "reason": "git is not installed"}


def test_resolved_hash_ignores_volatile_fields_only():
    record = {"train": {"lr": 1e-3, "resume": None, "output_dir": "runs/a", "stop_after": None, "betas": [0.9, 0.95]},
              "logging": {"progress_bar": True, "log_every": 10}}
    same = json.loads(json.dumps(record))
    same["train"].update(resume="auto", output_dir="runs/b", stop_after=5)
    same["logging"]["progress_bar"] = False
    same["provenance"] = {"git": {"commit": "abc"}}
    changed = json.loads(json.dumps(record))
    changed["train"]["lr"] = 2e-3
    assert provenance.resolved_hash(record) == provenance.resolved_hash(same)
    assert provenance.resolved_hash(record) != provenance.resolved_hash(changed)
    assert provenance.resolved_hash(record).startswith("sha256:")


def test_rewind_moves_lines_past_the_checkpoint_and_marks_the_resume(tmp_path):
    lines = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}, {"step": 2, "eval_loss": 2.7},
             {"step": 3, "loss": 2.4}, {"step": 3, "skipped_step": True}]
    text = "".join(json.dumps(line) + "\n" for line in lines) + '{"step": 4, "lo'  # a line the crash cut short
    (tmp_path / "metrics.jsonl").write_text(text)
    rewound = rewind_metrics(tmp_path, 2, "step_00000002", 4)
    assert (rewound.moved, rewound.not_metrics) == (3, 1)
    assert rows_of(tmp_path) == lines[:3] + [{"step": 2, "event": "resume", "checkpoint": "step_00000002",
                                              "world_size": 4}]
    rewound = rows_of(tmp_path, REWOUND_FILE)
    assert [{k: v for k, v in r.items() if k not in ("rewound_by", "problem")} for r in rewound] == \
        lines[3:] + [{"unparsable": '{"step": 4, "lo', "line": 6}]
    assert rewound[-1]["problem"].startswith("not valid JSON")
    assert {r["rewound_by"]["checkpoint"] for r in rewound} == {"step_00000002"}


def test_a_fresh_start_in_a_used_run_directory_starts_an_empty_history(tmp_path):
    """A run that died before its first checkpoint (so --resume auto starts fresh), or one started again with
    --resume off: the earlier lines are moved aside, not left in place as if the new run had logged them."""
    from trainer.presets import load_preset
    from trainer.train.metrics import MetricsLogger
    earlier = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.9}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in earlier))
    cfg = load_preset("tiny_cpu", ["logging.progress_bar=false"])
    metrics = MetricsLogger(cfg, tmp_path, 0, 1000, 1, {})
    metrics.log({"step": 1, "loss": 2.5, "lr": 1e-3})
    metrics.close()
    assert rows_of(tmp_path) == [{"step": 1, "loss": 2.5, "lr": 1e-3}]  # no event: nothing was resumed
    moved = rows_of(tmp_path, REWOUND_FILE)
    assert [{k: v for k, v in r.items() if k != "rewound_by"} for r in moved] == earlier
    assert {(r["rewound_by"]["checkpoint"], r["rewound_by"]["step"]) for r in moved} == {(None, 0)}


TRACKER_PROBE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from trainer.presets import load_preset
    from trainer.train.metrics import MetricsLogger
    cfg = load_preset("tiny_cpu", [f"logging.tensorboard={sys.argv[2]}", "logging.progress_bar=false"])
    metrics = MetricsLogger(cfg, Path(sys.argv[1]), 0, 1000, 1, {})
    metrics.log({"step": 1, "loss": 2.5, "lr": 1e-3})
    metrics.close()
    print(json.dumps(sorted(m for m in sys.modules if "tensorboard" in m)))
""")


@pytest.mark.slow
@pytest.mark.parametrize("enabled", [False, True])
def test_tensorboard_is_imported_only_when_on(tmp_path, enabled):
    proc = subprocess.run([sys.executable, "-c", TRACKER_PROBE, str(tmp_path), str(enabled).lower()], cwd=REPO,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    modules = json.loads(proc.stdout.strip().splitlines()[-1])
    assert bool(modules) == enabled, modules
    assert (tmp_path / "tensorboard").is_dir() == enabled


@pytest.mark.multirank
def test_resume_auto_after_a_torn_metrics_line_on_two_ranks(tmp_path):
    """A run stopped after step 4 (its checkpoint), then its metrics.jsonl torn as a kill in the middle of a write
    leaves it: part of a JSON line, ending in half a UTF-8 character. `--resume auto` on 2 ranks goes on to step 6
    (before, every resume died on the bad bytes): the torn bytes move to metrics.rewound.jsonl exactly, the notice
    names the line, metrics.jsonl is all JSON with each step once, and report draws it with no note."""
    out = tmp_path / "run"
    common = TINY + STAGES["z2"] + ["train.max_steps=6", "train.save_every=4", "logging.progress_bar=false",
                                    f"train.output_dir={out}"]

    def args(*extra):
        return ["train.py", "--preset", "tiny_cpu"] + [a for item in common + list(extra) for a in ("--set", item)]

    launch(args("train.stop_after=4"))
    lines = (out / "metrics.jsonl").read_bytes().count(b"\n")
    torn = b'{"step": 5, "loss": 2.71, "lr": 0.001, "note": "\xe2\x82'
    with open(out / "metrics.jsonl", "ab") as handle:
        handle.write(torn)
    output = launch(args("train.resume=auto"))
    assert f"metrics: 1 line(s) of {out / 'metrics.jsonl'} were not metrics lines, moved to " \
           f"{out / REWOUND_FILE} with their bytes: line {lines + 1}: not UTF-8 text" in output
    rows = rows_of(out)
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 7))
    assert {"step": 4, "event": "resume", "checkpoint": "step_00000004", "world_size": 2} in rows
    (record,) = rows_of(out, REWOUND_FILE)
    assert base64.b64decode(record["unparsable_base64"]) == torn and record["line"] == lines + 1
    report = run_cli("report", str(out), "-o", str(tmp_path / "report.png"))
    assert report.returncode == 0 and "note:" not in report.stderr, report.stderr
