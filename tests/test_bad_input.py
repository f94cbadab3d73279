"""Issue 5's bad-input suite: every kind of bad input is refused with a clear error, and nothing is
written or corrupted.

For each case: (a) the right exception (a UserError: ConfigError, DataError) or exit status 2 with
`error: ...` on stderr and no traceback; (b) the message names the key / file / line and says how to
fix it; (c) nothing written: the run's output_dir is not created, `export -o FILE` creates no FILE, an
existing run directory and its checkpoint are byte-for-byte unchanged after a refused resume.

Cases: unknown preset; unknown/misspelled keys at each level of a preset; wrong types; inconsistent
batch triad; each incompatible feature combination; missing dataset path; malformed JSONL line;
wrong columns for the task; empty dataset (and one too small for a micro-batch per rank); chat data
with a tokenizer without a chat template; resume from something that is not a checkpoint; resume a
checkpoint of another model shape (by path, and with --resume auto in the run's own directory);
output_dir not writable; NVMe path missing; a plain `python train.py` run whose preset declares more
ranks than are running.

Security (issue 5): trust_remote_code is off unless a preset or --set turns it on, and the run log
says so when it is on; secrets (WANDB_API_KEY / HF_TOKEN in the environment, a key-like field in the
DeepSpeed section) appear in no file a run writes; trainer and RNG state in checkpoints is JSON.

Config and data cases run in process; the run-time cases run real single-rank trainings: one 2-step
run makes the checkpoint, one worker process (this file run as a script) tries the refused runs one
after another through the `train` command, and one refused run is a real `train.py` process.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent

from conftest import TINY, nvme_overrides
from distributed import argv_last_wins
from rule_cases import CASES
from trainer.__main__ import main
from trainer.config import DataConfig, ModelConfig
from trainer.data import DataError, build_datasets, load_tokenizer
from trainer.errors import ConfigError, UserError
from trainer.presets import PRESET_DIR, list_presets, load_preset, with_overrides
from trainer.resolve import resolve

TOKENIZER_DIR = ROOT / "data" / "tiny" / "tokenizer"
SECRETS = {"WANDB_API_KEY": "wandb-secret-4b1d9e", "HF_TOKEN": "hf_secret_7c2a51",
           "HUGGING_FACE_HUB_TOKEN": "hf_secret_0e93f8"}
DS_SECRET = "comet-secret-5a6f20"   # a secret written into the preset's DeepSpeed section
RUN_NAME = "bad-input-suite-run"
# The tiny architecture, 2 optimizer steps, one checkpoint at the end, resolved for the one rank of a
# plain `python train.py` run (RUN[:2]).
RUN = ["--world-size", "1", *[a for o in with_overrides(TINY, [
    "train.max_steps=2", "train.warmup_steps=1", "train.eval_every=0", "train.save_every=0",
    "logging.progress_bar=false"]) for a in ("--set", o)]]
STEP_DIR = "checkpoints/step_00000002"


def sets(*overrides: str) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


def tree(root: Path) -> dict[str, str]:
    """Every path under root with the sha256 of its bytes ('dir' for directories)."""
    return {str(p.relative_to(root)): ("dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*"))}


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def tokenizer_without_chat_template(directory: Path) -> Path:
    directory.mkdir()
    config = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "tokenizer.json").write_bytes((TOKENIZER_DIR / "tokenizer.json").read_bytes())
    return directory


CHAT = [{"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                      {"role": "assistant", "content": f"{2 * i}."}]} for i in range(8)]


def cli_error(capsys, args: list[str]) -> str:
    """Run `python -m trainer ARGS` in process: it must return 2 with `error: ...` on stderr, no traceback,
    nothing on stdout; returns the message."""
    assert main(args) == 2
    captured = capsys.readouterr()
    assert "error: " in captured.err and "Traceback" not in captured.err
    assert captured.out == ""
    return captured.err[captured.err.index("error: "):]


def export_error(capsys, tmp_path: Path, preset: str, overrides: list[str]) -> str:
    """`export PRESET --set ... -o FILE` is refused and FILE is not created."""
    out = tmp_path / "out" / "ds.json"
    out.parent.mkdir(exist_ok=True)
    message = cli_error(capsys, ["export", preset, *sets(*overrides), "-o", str(out)])
    assert not out.exists()
    return message


# ================================================================================ config: presets

def test_unknown_preset_name(tmp_path):
    with pytest.raises(UserError) as err:
        load_preset("tiny_cpux")
    assert "unknown preset 'tiny_cpux' (did you mean 'tiny_cpu'?)" in str(err.value)
    assert "python -m trainer presets" in str(err.value)
    # the real CLI process: exit 2, the message on stderr, no traceback, no file
    out = tmp_path / "ds.json"
    result = subprocess.run([sys.executable, "-m", "trainer", "export", "tiny_cpux", "-o", str(out)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "error: unknown preset 'tiny_cpux' (did you mean 'tiny_cpu'?)" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not out.exists() and result.stdout == ""


def preset_with(tmp_path: Path, dotted: str, value) -> Path:
    """tiny_cpu.yaml with `value` at `dotted` (sections are created as needed), as a new file."""
    raw = yaml.safe_load((PRESET_DIR / "tiny_cpu.yaml").read_text())
    node, keys = raw, dotted.split(".")
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    node[keys[-1]] = value
    path = tmp_path / "typo_preset.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.mark.parametrize("dotted,value,key,suggestion", [
    ("hardwre", {"gpu": "cpu"}, "hardwre", "hardware"),                                    # top level
    ("hardware.gpus_per_nod", 2, "hardware.gpus_per_nod", "gpus_per_node"),
    ("model.hiden_size", 64, "model.hiden_size", "hidden_size"),
    ("model.lora.alfa", 16, "model.lora.alfa", "alpha"),                                   # nested section
    ("data.seqlen", 64, "data.seqlen", "seq_len"),
    ("train.warmup_step", 10, "train.warmup_step", "warmup_steps"),
    ("logging.log_evry", 5, "logging.log_evry", "log_every"),
    ("deepspeed.zero_optimisation", {"stage": 2}, "deepspeed.zero_optimisation", "zero_optimization"),  # DeepSpeed
    ("deepspeed.zero_optimization.overlap_com", True, "deepspeed.zero_optimization.overlap_com", "overlap_comm"),
    ("deepspeed.zero_optimization.offload_optimizer", {"device": "cpu", "pin_memmory": True},
     "deepspeed.zero_optimization.offload_optimizer.pin_memmory", "pin_memory"),
    ("deepspeed.optimizer.params.weight_decy", 0.1, "deepspeed.optimizer.params.weight_decy", "weight_decay"),
])
def test_misspelled_key_in_a_preset_file(dotted, value, key, suggestion, tmp_path, capsys):
    path = preset_with(tmp_path, dotted, value)
    before = tree(tmp_path)
    message = export_error(capsys, tmp_path, str(path), [])
    assert key in message and f"did you mean '{suggestion}'" in message, message
    if key.startswith("deepspeed"):  # checked at resolution: the preset is named by its name
        assert "typo_preset" in message
    else:  # checked when the file is read: the file is named
        assert f"unknown key '{key}'" in message and str(path) in message
    assert tree(tmp_path) == {**before, "out": "dir"}  # export_error's -o directory, left empty


def test_all_problems_of_a_preset_reported_together(tmp_path, capsys):
    raw = yaml.safe_load((PRESET_DIR / "tiny_cpu.yaml").read_text())
    raw["extra_section"] = {"a": 1}
    raw["model"]["hiden_size"] = 64
    raw["train"]["lr"] = "fast"
    path = tmp_path / "many.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as err:
        load_preset(str(path))
    assert len(err.value.problems) == 3 and str(err.value).startswith(f"3 problem(s) in {path}")
    message = export_error(capsys, tmp_path, str(path), [])
    for fragment in ("unknown key 'extra_section'", "unknown key 'model.hiden_size' (did you mean 'hidden_size'?)",
                     "train.lr: expected a number"):
        assert fragment in message


@pytest.mark.parametrize("override,fragments", [
    ("train.lr=fast", ["train.lr", "expected a number", "'fast'"]),
    ("model.num_layers=2.5", ["model.num_layers", "expected an integer", "2.5"]),
    ("logging.progress_bar=maybe", ["logging.progress_bar", "expected true/false", "'maybe'"]),
    ("train.betas=[0.9]", ["train.betas", "expected 2 values"]),
    ("train.precision=bf32", ["train.precision", "'bf32' is not one of", "'fp32'"]),
    ("model=3", ["model", "expected a mapping"]),
    ("deepspeed.zero_optimization.stage=three", ["deepspeed.zero_optimization.stage", "'three'"]),
    ("deepspeed.zero_optimization.reduce_bucket_size=-1",
     ["deepspeed.zero_optimization.reduce_bucket_size", "greater than 0"]),
    ("deepspeed.gradient_clipping=lots", ["deepspeed.gradient_clipping", "'lots'"]),
])
def test_wrong_type(override, fragments, tmp_path, capsys):
    with pytest.raises(ConfigError) as err:
        resolve(load_preset("tiny_cpu", [override]))
    assert any(all(f in p for f in fragments) for p in err.value.problems), err.value.problems
    message = export_error(capsys, tmp_path, "tiny_cpu", [override])
    assert all(f in message for f in fragments)


@pytest.mark.parametrize("overrides,fragments", [
    (["train.global_batch_size=7"],  # 8 x 1 x 2 ranks = 16
     ["batch triad inconsistent", "global_batch_size 7", "micro_batch_size 8", "grad_accum 1",
      "data-parallel size 2", "give two of the three"]),
    (["deepspeed.train_micro_batch_size_per_gpu=4"],
     ["train.micro_batch_size=8", "deepspeed.train_micro_batch_size_per_gpu=4", "disagree"]),
    (["train.micro_batch_size=0"], ["train.micro_batch_size=0 must be >= 1", "(from --set"]),
])
def test_inconsistent_batch_triad(overrides, fragments, tmp_path, capsys):
    message = export_error(capsys, tmp_path, "tiny_cpu", overrides)
    assert all(f in message for f in fragments), message


# The rule table (tests/rule_cases.py) through the CLI: `export tiny_cpu --set ...` names the key and the fix.

@pytest.mark.parametrize("name", sorted(CASES))
def test_incompatible_feature_combination(name, tmp_path, capsys):
    case = CASES[name]
    message = export_error(capsys, tmp_path, "tiny_cpu", case.breaks)
    assert all(f in message for f in case.says), message


# ====================================================================================== data

@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig(tokenizer=str(TOKENIZER_DIR)))


def data_error(source_dir: Path, cfg: DataConfig, tokenizer) -> str:
    """build_datasets raises a DataError and writes nothing next to the data."""
    before = tree(source_dir)
    with pytest.raises(DataError) as err:
        build_datasets(cfg, tokenizer, seed=0)
    assert tree(source_dir) == before
    return str(err.value)


def test_missing_dataset_path(tmp_path, tokenizer):
    missing = tmp_path / "nope.jsonl"
    message = data_error(tmp_path, DataConfig(source=str(missing), seq_len=32), tokenizer)
    assert f"{missing}: no such file or directory" in message and "data.source" in message


def test_malformed_jsonl_line_is_reported_by_number(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "one"}\n\n{"text": "two"}\n{"text": "three\n{"text": "four"}\n')
    message = data_error(tmp_path, DataConfig(source=str(path), seq_len=32), tokenizer)
    assert f"{path} line 4: invalid JSON" in message and "one JSON object" in message


@pytest.mark.parametrize("task,record,fragments", [
    ("pretrain", {"content": "x"}, ["'text' (data.text_field)"]),
    ("sft", {"question": "x", "answer": "y"},
     ["'prompt' + 'response' (data.prompt_field + data.response_field)", "'messages' (data.messages_field)"]),
])
def test_wrong_column_names_for_the_task(task, record, fragments, tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "records.jsonl", [record] * 3)
    message = data_error(tmp_path, DataConfig(task=task, source=str(path), seq_len=32), tokenizer)
    assert f"{path} line 1" in message and str(list(record)) in message
    assert all(f in message for f in fragments) and "set the data.*_field options" in message


@pytest.mark.parametrize("kind", ["empty file", "blank lines", "empty directory"])
def test_empty_dataset(kind, tmp_path, tokenizer):
    source = tmp_path / ("data" if kind == "empty directory" else "empty.jsonl")
    if kind == "empty directory":
        source.mkdir()
    else:
        source.write_text("" if kind == "empty file" else "\n  \n\n")
    message = data_error(tmp_path, DataConfig(source=str(source), seq_len=32), tokenizer)
    assert str(source) in message and "holds no" in message


def test_chat_data_with_a_tokenizer_without_chat_template(tmp_path):
    plain = load_tokenizer(ModelConfig(tokenizer=str(tokenizer_without_chat_template(tmp_path / "tok"))))
    path = write_jsonl(tmp_path / "chat.jsonl", CHAT)
    message = data_error(tmp_path, DataConfig(task="sft", source=str(path), seq_len=64), plain)
    assert f"{path}" in message and "line 1" in message and "no chat_template" in message
    assert "model.tokenizer" in message


# ====================================================================== runs: one real checkpoint

def run_process(args: list[str], env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1",
                **(env or {})}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(key, None)  # a plain single-rank run, whatever the test runner's environment
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def checkpoint_run(tmp_path_factory):
    """A 2-step single-rank run with secrets in the environment and in its DeepSpeed section, a run name,
    and trust_remote_code on; returns (run_dir, log)."""
    run_dir = tmp_path_factory.mktemp("bad_input") / "run"
    args = ["train.py", "--preset", "tiny_cpu", *RUN,
            *sets(f"train.output_dir={run_dir}", f"logging.run_name={RUN_NAME}", "model.trust_remote_code=true",
                  f"deepspeed.comet={{enabled: false, api_key: {DS_SECRET}}}")]
    result = run_process(args, env=SECRETS)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    assert (run_dir / STEP_DIR / "COMPLETE").exists(), log[-6000:]
    return run_dir, log


# ============================================================ runs: refused, nothing written

def run_cases(spec_path: str) -> None:
    """Worker (this file run as a script): each case is `python -m trainer train ARGS` in this one process,
    with the environment of a fresh plain run; the report holds its return value and output."""
    from trainer.__main__ import main as cli
    spec = json.loads(Path(spec_path).read_text())
    report, environment = {}, dict(os.environ)
    for name, args in spec["cases"].items():
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = cli(["train", *args])
            except BaseException:  # an unclear error: the test shows it
                rc = "exception"
                err.write(traceback.format_exc())
        os.environ.clear()
        os.environ.update(environment)  # start_distributed set RANK/WORLD_SIZE/...: the next case is plain
        report[name] = {"rc": rc, "stdout": out.getvalue(), "stderr": err.getvalue()}
    Path(spec["report"]).write_text(json.dumps(report, indent=1))


def refused_cases(root: Path, run_dir: Path) -> dict:
    """name: (train arguments after the tiny run's, what the error message must hold)."""
    step = run_dir / STEP_DIR
    chat = write_jsonl(root / "chat.jsonl", CHAT * 20)
    no_template = tokenizer_without_chat_template(root / "tok_no_template")
    return {
        "resume_plain_directory": (
            ["--resume", str(root / "plain_dir")],
            [f"train.resume={str(root / 'plain_dir')!r} is not a complete checkpoint", "trainer_state.json",
             "COMPLETE", "--resume auto"]),
        "resume_a_file": (
            ["--resume", str(root / "afile")],
            [f"train.resume={str(root / 'afile')!r} is not a complete checkpoint"]),
        "resume_other_shape": (
            ["--resume", str(step), *sets("model.hidden_size=32", "model.num_layers=3")],
            [f"checkpoint {step} was trained with a different model shape",
             "model.hidden_size: checkpoint 64 vs config 32", "model.num_layers: checkpoint 2 vs config 3"]),
        "resume_auto_other_shape_in_its_run_dir": (  # output_dir = the checkpoint run's own directory
            ["--resume", "auto", *sets("model.num_layers=3")],
            ["different model shape", "model.num_layers: checkpoint 2 vs config 3"]),
        "output_dir_not_writable": (  # under a regular file: mkdir fails even for root
            sets(f"train.output_dir={root / 'afile' / 'run'}"),
            [f"train.output_dir '{root / 'afile' / 'run'}' is not writable", "--set train.output_dir=PATH"]),
        "nvme_path_missing": (
            sets(*nvme_overrides(root / "no_nvme")),
            [f"deepspeed.zero_optimization.offload_optimizer.nvme_path '{root / 'no_nvme'}' does not exist",
             "create it or point it at a mounted NVMe drive"]),
        "chat_without_chat_template": (
            sets("data.task=sft", f"data.source={chat}", f"model.tokenizer={no_template}"),
            [f"{chat}: records (first at {chat} line ", "no chat_template", "model.tokenizer"]),
        "too_few_sequences_for_a_micro_batch": (  # the train split holds < 100000 sequences of 64 tokens (eval
            sets("train.micro_batch_size=100000"),  # needs only one: its set is split over the ranks, any size)
            ["data/tiny/pretrain.jsonl: the train split has", "train.micro_batch_size=100000",
             "lower train.micro_batch_size"]),
        "unknown_preset": (
            ["--preset", "tiny_cpux"], ["unknown preset 'tiny_cpux' (did you mean 'tiny_cpu'?)"]),
        "more_ranks_declared_than_running": (  # tiny_cpu declares 2 ranks; a plain `python train.py` runs 1
            [],  # and no --world-size 1 (see refused_runs)
            ["resolved for 2 ranks", "1 rank(s) are running", "hardware.gpus_per_node", "--world-size 1"]),
    }


REFUSED = ["resume_plain_directory", "resume_a_file", "resume_other_shape", "resume_auto_other_shape_in_its_run_dir",
           "output_dir_not_writable", "nvme_path_missing", "chat_without_chat_template",
           "too_few_sequences_for_a_micro_batch", "unknown_preset", "more_ranks_declared_than_running"]


@pytest.fixture(scope="module")
def refused_runs(checkpoint_run, tmp_path_factory):
    """Every refused run of this module, one after another in one worker process; returns
    ({case: result}, trees of the checkpoint run and of the inputs before, the inputs' directory)."""
    run_dir, _ = checkpoint_run
    root = tmp_path_factory.mktemp("refused")
    (root / "plain_dir").mkdir()
    (root / "plain_dir" / "notes.txt").write_text("not a checkpoint\n")
    (root / "afile").write_text("a regular file\n")
    cases = refused_cases(root, run_dir)
    assert sorted(cases) == sorted(REFUSED)
    spec_cases, outputs = {}, {}
    for name, (args, _) in cases.items():
        outputs[name] = run_dir if name == "resume_auto_other_shape_in_its_run_dir" else root / "out" / name
        preset = [] if "--preset" in args else ["--preset", "tiny_cpu"]
        base = RUN[2:] if name == "more_ranks_declared_than_running" else RUN
        # later arguments win: a case's own --preset / --set replace the tiny run's
        spec_cases[name] = argv_last_wins([*preset, *base, *sets(f"train.output_dir={outputs[name]}"), *args])
    spec = root / "spec.json"
    spec.write_text(json.dumps({"cases": spec_cases, "report": str(root / "report.json")}))
    before = {"run_dir": tree(run_dir), "root": tree(root)}
    result = run_process([__file__, str(spec)])
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]
    report = json.loads((root / "report.json").read_text())
    for name, (_, fragments) in cases.items():
        report[name].update(fragments=fragments, output_dir=str(outputs[name]))
    return report, before, root


@pytest.mark.slow
@pytest.mark.parametrize("case", REFUSED)
def test_refused_run(case, refused_runs):
    report, _, _ = refused_runs
    result = report[case]
    stderr = result["stderr"]
    assert result["rc"] == 2, stderr[-4000:]
    assert "error: " in stderr and "Traceback" not in stderr, stderr[-4000:]
    message = stderr[stderr.index("error: "):]
    assert all(f in message for f in result["fragments"]), message
    if case != "resume_auto_other_shape_in_its_run_dir":
        assert not Path(result["output_dir"]).exists(), f"{case} created {result['output_dir']}"


@pytest.mark.slow
def test_refused_runs_leave_the_checkpoint_run_byte_identical(refused_runs, checkpoint_run):
    # resumes by path from its step_00000002 and `--resume auto` in the run's own directory with another
    # model shape: no file of the run changed (config.resolved.yaml, metrics.jsonl, the checkpoint), none added
    report, before, _ = refused_runs
    run_dir, _ = checkpoint_run
    assert tree(run_dir) == before["run_dir"]


@pytest.mark.slow
def test_refused_runs_write_nothing_next_to_their_inputs(refused_runs):
    # the regular file under which output_dir was asked for, the missing nvme_path, the data, the tokenizer
    _, before, root = refused_runs
    after = tree(root)
    assert not (root / "no_nvme").exists() and not (root / "out").exists()
    assert {k: v for k, v in after.items() if k != "report.json"} == {
        k: v for k, v in before["root"].items() if k != "report.json"}


@pytest.mark.slow
def test_refused_run_as_a_real_process(tmp_path):
    # the malformed JSONL case end to end: exit status 2, one line of error, no traceback, no run directory
    data = tmp_path / "bad.jsonl"
    data.write_text('{"text": "one"}\n{"text": "two"}\n{"text": "three"\n')
    out = tmp_path / "run"
    result = run_process(["train.py", "--preset", "tiny_cpu", *RUN,
                          *sets(f"data.source={data}", f"train.output_dir={out}")])
    assert result.returncode == 2, result.stderr[-4000:]
    assert f"error: {data} line 3: invalid JSON" in result.stderr and "Traceback" not in result.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]
    assert "trust_remote_code" not in result.stdout  # off by default: no notice


# ===================================================================================== security

@pytest.mark.parametrize("name", [name for name, _ in list_presets()])
def test_trust_remote_code_is_off_unless_the_preset_turns_it_on(name):
    raw = yaml.safe_load((PRESET_DIR / f"{name}.yaml").read_text())
    asked = (raw.get("model") or {}).get("trust_remote_code", False)
    resolved = resolve(load_preset(name))
    assert resolved.config.model.trust_remote_code is asked
    assert any("trust_remote_code is ON" in n for n in resolved.notices) is asked
    turned_on = resolve(load_preset(name, ["model.trust_remote_code=true"]))
    assert turned_on.config.model.trust_remote_code is True
    assert any("trust_remote_code is ON" in n for n in turned_on.notices)


@pytest.mark.parametrize("flag", [None, "true"])
def test_transformers_gets_trust_remote_code_only_when_asked(flag, monkeypatch, tmp_path):
    import transformers
    from trainer.model import build_model
    calls = []

    def refuse(path, *args, **kwargs):
        calls.append(kwargs.get("trust_remote_code"))
        raise OSError("stopped by the test")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    overrides = [f"model.name_or_path={tmp_path}"] + ([f"model.trust_remote_code={flag}"] if flag else [])
    cfg = resolve(load_preset("tiny_cpu", overrides)).config
    with pytest.raises(DataError):
        load_tokenizer(cfg.model)
    with pytest.raises(OSError, match="stopped by the test"):
        build_model(cfg, 0)
    assert calls == [flag == "true"] * 2


@pytest.mark.slow
def test_the_run_log_says_trust_remote_code_is_on(checkpoint_run):
    _, log = checkpoint_run
    assert "notice: trust_remote_code is ON" in log


@pytest.mark.slow
def test_no_secret_in_any_file_the_run_writes(checkpoint_run):
    run_dir, log = checkpoint_run
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    assert any(p.suffix == ".pt" for p in files) and (run_dir / "config.resolved.yaml") in files
    for path in files:
        data = path.read_bytes()
        for secret in [*SECRETS.values(), DS_SECRET]:
            assert secret.encode() not in data, f"{secret} written to {path}"
    for secret in [*SECRETS.values(), DS_SECRET]:
        assert secret not in log
    resolved = yaml.safe_load((run_dir / "config.resolved.yaml").read_text())
    assert resolved["deepspeed"]["comet"]["api_key"] == "<redacted>"
    assert resolved["logging"]["run_name"] == RUN_NAME  # names are not secrets
    assert resolved["model"]["trust_remote_code"] is True


@pytest.mark.slow
def test_trainer_and_rng_state_in_checkpoints_is_json(checkpoint_run):
    run_dir, _ = checkpoint_run
    step = run_dir / STEP_DIR
    state = json.loads((step / "trainer_state.json").read_text())
    assert state["trainer"]["step"] == 2 and state["config"]["model"]["hidden_size"] == 64
    assert state["config"]["deepspeed"]["comet"]["api_key"] == "<redacted>"
    rng_files = sorted(step.glob("rng_rank*.json"))
    assert [p.name for p in rng_files] == ["rng_rank0.json"]
    assert set(json.loads(rng_files[0].read_text())) >= {"python", "numpy", "torch"}
    # everything else of ours is text; the only pickles are DeepSpeed's own engine files
    assert json.loads((step / "COMPLETE").read_text())["tag"] == "step_00000002"  # the JSON manifest
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    pickles = sorted(p.name for p in step.iterdir() if p.name not in {
        "trainer_state.json", "rng_rank0.json", "COMPLETE"})
    assert pickles == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]


if __name__ == "__main__":
    run_cases(sys.argv[1])
