"""Light commands stay light (issue 25): `--help`, presets, show, export, plan (--chart too), lint, doctor, report,
`launch --dry-run` and `prepare-data --help` import neither torch nor DeepSpeed; what they need to know about the
installed DeepSpeed (its keys, models, removed keys, optimizers, schedulers) is learned once, cached on disk keyed
by DeepSpeed's version and files (trainer/ds/learned.py), and must equal what the live DeepSpeed says."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.ds import check, learned

REPO = Path(__file__).resolve().parent.parent
HEAVY = ("torch", "deepspeed")

# Runs `python -m trainer ARGS` as __main__ does, then prints which heavy modules the command imported
PROBE = """
import json, runpy, sys
sys.argv = ["trainer"] + sys.argv[1:]
code = 0
try:
    runpy.run_module("trainer", run_name="__main__", alter_sys=True)
except SystemExit as stop:
    code = stop.code
print("\\nLOADED " + json.dumps([m for m in %r if m in sys.modules]), file=sys.stderr)
sys.exit(code)
""" % (HEAVY,)


def run_light(args: list[str], cache_home: Path) -> tuple[subprocess.CompletedProcess, list[str]]:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache_home)}
    result = subprocess.run([sys.executable, "-c", PROBE, *args], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=300)
    line = next((x for x in result.stderr.splitlines() if x.startswith("LOADED ")), None)
    assert line, result.stderr[-3000:]
    return result, json.loads(line[len("LOADED "):])


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory) -> Path:
    """An XDG cache whose DeepSpeed facts were learned once (in a child process, as a first light command does)."""
    home = tmp_path_factory.mktemp("xdg")
    run_light(["show", "tiny_cpu"], home)
    return home


def a_run_dir(root: Path) -> Path:
    run = root / "run"
    run.mkdir()
    lines = [{"step": s, "loss": 3.0 - s / 10, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0}
             for s in range(1, 6)] + [{"step": 4, "eval_loss": 2.8}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return run


LIGHT = {  # name: (argv, what the command wrote or said when it did its work)
    "help": (["--help"], "stdout:prepare-data"),
    "no command": ([], "stdout:prepare-data"),  # `python -m trainer` alone lists the commands
    "presets": (["presets"], "stdout:tiny_cpu"),
    "show": (["show", "tiny_cpu"], "stdout:zero_optimization"),
    "export": (["export", "tiny_cpu", "-o", "{tmp}/ds.json"], "file:{tmp}/ds.json"),
    "plan": (["plan", "scenarios/13b_8xa100.yaml"], "stdout:zero"),
    "plan --chart": (["plan", "scenarios/13b_8xa100.yaml", "--chart", "{tmp}/chart.png"], "file:{tmp}/chart.png"),
    "lint": (["lint", "tiny_cpu"], "any"),
    "doctor": (["doctor", "tiny_cpu", "tests/logs/cuda_oom.log"], "stdout:memory"),
    "report": (["report", "{tmp}/run", "-o", "{tmp}/report.png"], "file:{tmp}/report.png"),
    "launch --dry-run": (["launch", "tiny_cpu", "--dry-run"], "stdout:train.py"),
    "prepare-data --help": (["prepare-data", "--help"], "stdout:--records-per-shard"),
}


def test_every_command_not_marked_heavy_is_held_light_here():
    """trainer/commands.py marks the commands that import torch to do their work (`heavy`); each of the others is
    run by the test below, so a light command that starts importing torch is caught."""
    from trainer.commands import COMMANDS
    covered = {argv[0] for argv, _ in LIGHT.values() if argv and not argv[0].startswith("-")}
    assert {name for name, command in COMMANDS.items() if not command.heavy} <= covered


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LIGHT))
def test_a_light_command_imports_neither_torch_nor_deepspeed(name, cache_home, tmp_path):
    argv, evidence = LIGHT[name]
    a_run_dir(tmp_path)
    result, loaded = run_light([a.format(tmp=tmp_path) for a in argv], cache_home)
    assert result.returncode in (0, 1), result.stderr[-3000:]  # lint/doctor: 1 = findings
    assert loaded == [], f"{name} imported {loaded}"
    kind, _, what = evidence.format(tmp=tmp_path).partition(":")
    if kind == "stdout":
        assert what.lower() in result.stdout.lower(), result.stdout[-2000:]
    elif kind == "file":
        assert Path(what).stat().st_size > 0


@pytest.mark.slow  # a light command and the live DeepSpeed check, ~6 s (issue 36's 120 s quick-tier budget)
def test_a_bad_deepspeed_value_is_refused_by_a_light_command_as_by_train(cache_home):
    """The light check says what DeepSpeed's own models say (same words), without importing DeepSpeed."""
    result, loaded = run_light(["show", "tiny_cpu", "--set", "deepspeed.zero_optimization.stage=7",
                                "--set", "deepspeed.zero_optimization.reduce_bucket_size=-1",
                                "--set", "deepspeed.zero_optimization.overlap_com=true"], cache_home)
    assert result.returncode == 2 and loaded == []
    assert "deepspeed.zero_optimization.stage: Input should be 0, 1, 2 or 3 (got 7)" in result.stderr
    assert "deepspeed.zero_optimization.reduce_bucket_size: Input should be greater than 0 (got -1)" in result.stderr
    assert "deepspeed.zero_optimization.overlap_com: not a DeepSpeed key (did you mean 'overlap_comm'?)" \
        in result.stderr
    ds = {"zero_optimization": {"stage": 7, "reduce_bucket_size": -1, "overlap_com": True}}
    live = check.check_keys(ds, live=True)
    assert [p for p in live if p in result.stderr] == live  # every problem the live check finds, word for word


@pytest.mark.slow  # imports DeepSpeed for the live answers, ~5 s (issue 36's 120 s quick-tier budget)
def test_the_cache_equals_what_the_live_deepspeed_says(cache_home, monkeypatch):
    files = list((cache_home / "deepspeed-preset-trainer" / "deepspeed-config").glob("*.json"))
    assert len(files) == 1
    cached = json.loads(files[0].read_text())
    ident = learned.identity()
    assert files[0].name == learned.cache_path(ident).name  # named by DeepSpeed's version and file digest
    assert {k: cached[k] for k in ident} == ident
    import deepspeed
    assert cached["deepspeed"] == deepspeed.__version__
    live = learned.learn()  # in this process, from the imported DeepSpeed
    assert {k: v for k, v in cached.items() if k not in ident} == json.loads(json.dumps(live))
    assert "zero_optimization" in cached["top_keys"] and "intra_op_parallelism" in cached["dict_blocks"]["aio"]


# every JSON kind of value a preset can hold, and the edges of the ranges DeepSpeed's models use
PROBES = [None, True, False, 0, 1, -1, 3, 7, 0.5, 1.5, -0.5, "1", "x", "auto", "cpu", "nvme", "true", "torch",
          [], ["a"], ["z1"], {}, {"device": "cpu"}, 10**12]


def test_mirrored_models_refuse_what_deepspeed_refuses_in_the_same_words():
    """For each field of each learned model and each probe value: the check without DeepSpeed gives DeepSpeed's
    own problems, except where DeepSpeed runs a validator of its own (learned as 'any', or a cross-field check):
    those it may miss - never refuse more - and the live check in train still applies them."""
    known = learned.facts()
    same = missed = 0
    for block, model_key in known["blocks"].items():
        for name, field in known["models"][model_key]["fields"].items():
            if field.get("deprecated"):
                continue
            for value in PROBES:
                for typed in (True, False):
                    ds = {block: {name: value}}
                    live, light = check.check_keys(ds, typed, live=True), check.check_keys(ds, typed, live=False)
                    assert set(light) <= set(live), (block, name, value, light, live)
                    if light == live:
                        same += bool(live)
                        continue
                    missed += 1
                    assert field["type"] == {"kind": "any"} or all("Value error, " in p for p in set(live) - set(light)), \
                        (block, name, value, live, light)
    assert same > 500 and missed < same / 10  # the mirror judges nearly everything, and most values are refused


def test_a_damaged_or_foreign_cache_is_learned_again(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    learned.facts.cache_clear()
    path = learned.cache_path(learned.identity())
    path.parent.mkdir(parents=True)
    try:
        for damage in ("{not json", json.dumps({"schema": learned.SCHEMA}), json.dumps([1, 2])):
            path.write_text(damage)
            path.chmod(0o600)
            learned.facts.cache_clear()
            assert "zero_optimization" in learned.facts()["blocks"]
            assert json.loads(path.read_text())["top_keys"] == learned.facts()["top_keys"]  # rewritten whole
        good = json.loads(path.read_text())
        lie = {**good, "top_keys": good["top_keys"] + ["made_up_key"]}
        path.write_text(json.dumps(lie))
        path.chmod(0o666)  # anyone could have written it: not trusted
        learned.facts.cache_clear()
        assert "made_up_key" not in learned.facts()["top_keys"]
        other_files = {**lie, "files": {**good["files"], next(iter(good["files"])): "0" * 64}}
        path.write_text(json.dumps(other_files))  # learned from other DeepSpeed files: stale
        path.chmod(0o600)
        learned.facts.cache_clear()
        assert "made_up_key" not in learned.facts()["top_keys"]
    finally:
        learned.facts.cache_clear()


def test_the_cache_follows_deepspeeds_files(tmp_path, monkeypatch):
    """A changed DeepSpeed file (an upgrade, a local patch) gives another cache file, or invalidates the old one."""
    real = learned.deepspeed_root()
    copy = tmp_path / "deepspeed"
    known = learned.facts()
    for relative in known["files"]:
        (copy / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(real / relative, copy / relative)
    monkeypatch.setattr(learned, "deepspeed_root", lambda: copy)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    before = learned.identity()
    assert learned.read_cache(learned.cache_path(before), before) is None  # nothing cached yet
    learned.write_cache(learned.cache_path(before), {**known, **before})
    assert learned.read_cache(learned.cache_path(before), before) is not None
    key_file = copy / learned.key_files(copy)[0]
    key_file.write_text(key_file.read_text() + "\n# patched\n")
    assert learned.cache_path(learned.identity()) != learned.cache_path(before)
    nested = next(r for r in known["files"] if r not in learned.key_files(copy))  # a nested model's module
    (copy / nested).write_text((copy / nested).read_text() + "\n# patched\n")
    assert learned.read_cache(learned.cache_path(before), before) is None


def test_without_deepspeed_installed_a_light_command_says_so(tmp_path):
    """A first light command learns in a child process; when that fails the user reads why, not a traceback."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(tmp_path / "shadow")}
    shadow = tmp_path / "shadow" / "deepspeed"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('this deepspeed is broken')\n")
    result = subprocess.run([sys.executable, "-m", "trainer", "show", "tiny_cpu"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "could not learn the installed DeepSpeed's config keys" in result.stderr
    assert "this deepspeed is broken" in result.stderr
