"""No model code runs unless the user says so, and never from a checkpoint that fails verification (issue:
reliability round 3).

A model or tokenizer directory can carry Python code that transformers runs when it is loaded with
trust_remote_code. Each attack below plants such code (it touches a marker file when imported) where a command
would find it -- a tokenizer named by a checkpoint's saved config, a run's export, an HF directory -- and checks
that it runs only with the user's own --trust-remote-code, never because a saved config says so, never through
transformers' stdin prompt, and never before the checkpoint that names it has passed verification.
"""
from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from distributed import REPO
from trainer.train import integrity

pytestmark = pytest.mark.multirank  # the checkpoints come from conftest's real 2-rank runs

PAYLOAD = '''import pathlib
pathlib.Path({marker!r}).touch()
from transformers import PreTrainedTokenizerFast


class PlantedTokenizerFast(PreTrainedTokenizerFast):
    pass
'''


def plant_code_tokenizer(directory: Path, marker: Path) -> Path:
    """The shipped tiny tokenizer, made to need its own code: importing that code touches `marker`."""
    shutil.copytree(REPO / "data" / "tiny" / "tokenizer", directory, dirs_exist_ok=True)
    module = f"planted_{abs(hash(str(marker))) % 10**8}"  # one module per test: transformers caches imports
    (directory / f"{module}.py").write_text(PAYLOAD.format(marker=str(marker)))
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.update(tokenizer_class="PlantedTokenizerFast",
                  auto_map={"AutoTokenizer": [None, f"{module}.PlantedTokenizerFast"]})
    config_file.write_text(json.dumps(config))
    return directory


def forge_manifest(ckpt: Path) -> None:
    """What an attacker who can write the checkpoint does next: make COMPLETE agree with the new bytes."""
    manifest = json.loads((ckpt / "COMPLETE").read_text())
    for name in manifest["files"]:
        manifest["files"][name] = {"bytes": (ckpt / name).stat().st_size, "sha256": integrity.sha256_file(ckpt / name)}
    (ckpt / "COMPLETE").write_text(json.dumps(manifest))


def checkpoint_asking_for_code(engine_runs, tmp_path: Path, marker: Path) -> Path:
    """A copy of a real ZeRO-2 checkpoint whose saved config names a tokenizer with code and sets
    model.trust_remote_code: true, its manifest forged to match."""
    source = max((engine_runs[0]["scratch_z2"] / "checkpoints").glob("step_*"))
    ckpt = tmp_path / "checkpoints" / source.name
    shutil.copytree(source, ckpt)
    tokenizer = plant_code_tokenizer(tmp_path / "tokenizer", marker)
    state_file = ckpt / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["config"]["model"].update(tokenizer=str(tokenizer), trust_remote_code=True)
    state_file.write_text(json.dumps(state))
    forge_manifest(ckpt)
    return ckpt


def trainer(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    """`python -m trainer ...` with something on stdin (what a pipe would answer transformers' prompt with)."""
    return subprocess.run([sys.executable, "-m", "trainer", *args], cwd=REPO, input=stdin, capture_output=True,
                          text=True, timeout=300)


def generate(model: Path, *extra: str, stdin: str = "") -> subprocess.CompletedProcess:
    return trainer("generate", "--model", str(model), "--prompt", "Once upon a time", "--greedy",
                   "--max-new-tokens", "4", *extra, stdin=stdin)


@pytest.mark.parametrize("command", ["generate", "evaluate"])
def test_a_checkpoints_saved_config_cannot_turn_code_on(engine_runs, tmp_path, command):
    marker = tmp_path / "code_ran"
    ckpt = checkpoint_asking_for_code(engine_runs, tmp_path, marker)
    proc = (generate(ckpt, stdin="y\n") if command == "generate"
            else trainer("evaluate", "--model", str(ckpt), stdin="y\n"))
    assert not marker.exists(), "the tokenizer's code ran"
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "saved with model.trust_remote_code: true" in proc.stderr  # said, not obeyed
    assert "--trust-remote-code" in proc.stderr and "planted_" in proc.stderr  # the flag and the code, named


def test_a_checkpoint_that_fails_verification_runs_no_code_even_when_allowed(engine_runs, tmp_path):
    """The tokenizer a checkpoint names is loaded after the checkpoint is verified, not before."""
    marker = tmp_path / "code_ran"
    ckpt = checkpoint_asking_for_code(engine_runs, tmp_path, marker)
    weights = ckpt / "mp_rank_00_model_states.pt"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte the (forged) manifest does not cover
    weights.write_bytes(bytes(data))
    proc = generate(ckpt, "--trust-remote-code")
    assert not marker.exists(), "the tokenizer's code ran before the checkpoint was verified"
    assert proc.returncode == 2 and "must not be resumed" in proc.stderr, proc.stderr[-2000:]
    assert "mp_rank_00_model_states.pt" in proc.stderr


def test_the_users_flag_lets_the_checkpoints_code_run_and_names_it(engine_runs, tmp_path):
    """The payload above is live: with the user's permission it runs, and the notice says which file."""
    marker = tmp_path / "code_ran"
    ckpt = checkpoint_asking_for_code(engine_runs, tmp_path, marker)
    proc = generate(ckpt, "--trust-remote-code")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert marker.exists()
    assert "trust_remote_code is on" in proc.stderr and "planted_" in proc.stderr


def test_a_run_directorys_config_cannot_turn_code_on(engine_runs, tmp_path):
    """`generate --model RUN_DIR`: the run's config.resolved.yaml says trust_remote_code and its export's tokenizer
    carries code."""
    run = tmp_path / "run"
    shutil.copytree(engine_runs[0]["export_z2"] / "hf", run / "hf")
    record = yaml.safe_load((engine_runs[0]["export_z2"] / "config.resolved.yaml").read_text())
    record["model"]["trust_remote_code"] = True
    (run / "config.resolved.yaml").write_text(yaml.safe_dump(record))
    marker = tmp_path / "code_ran"
    plant_code_tokenizer(run / "hf", marker)
    proc = generate(run, stdin="y\n")
    assert not marker.exists(), "the export's tokenizer code ran"
    assert proc.returncode == 2 and "--trust-remote-code" in proc.stderr, proc.stderr[-2000:]


def test_a_piped_yes_does_not_answer_for_the_user(engine_runs, tmp_path):
    """An HF directory with code: transformers would ask on stdin when trust_remote_code is left unset."""
    model = tmp_path / "model"
    shutil.copytree(engine_runs[0]["export_z2"] / "hf", model)
    marker = tmp_path / "code_ran"
    plant_code_tokenizer(model, marker)
    for command in (["generate", "--model", str(model), "--prompt", "Hi"], ["evaluate", "--model", str(model),
                                                                           "--data", "data/tiny/pretrain.jsonl"]):
        proc = trainer(*command, stdin="y\ny\ny\n")
        assert not marker.exists(), f"{command[0]}: the tokenizer's code ran on a piped 'y'"
        assert proc.returncode == 2 and "--trust-remote-code" in proc.stderr, proc.stderr[-2000:]
        assert "Do you wish to run the custom code" not in proc.stdout + proc.stderr


def test_every_transformers_load_in_the_trainer_says_whether_code_may_run():
    """Each Auto*.from_pretrained call passes trust_remote_code explicitly (remote_code.load_kwargs or the
    infer source's permission()): one left unset would let transformers ask on stdin."""
    unset = []
    for path in sorted((REPO / "trainer").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "from_pretrained" and isinstance(node.func.value, ast.Name)
                    and node.func.value.id.startswith("Auto")):
                continue
            explicit = any(k.arg == "trust_remote_code" for k in node.keywords) or any(
                k.arg is None and isinstance(k.value, ast.Call) and getattr(k.value.func, "id", "") in
                ("load_kwargs", "permission") for k in node.keywords)
            if not explicit:
                unset.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not unset, f"from_pretrained without an explicit trust_remote_code: {unset}"


def test_training_takes_code_permission_from_the_preset_only(tmp_path, capsys):
    """The trainer's tokenizer load (train, prepare-data): off -> a named error naming the key and the code;
    on (the preset or --set says so) -> the code runs and the notice names it."""
    from trainer.config import ModelConfig
    from trainer.data import DataError, load_tokenizer
    marker = tmp_path / "code_ran"
    tokenizer = plant_code_tokenizer(tmp_path / "tokenizer", marker)
    with pytest.raises(DataError) as refused:
        load_tokenizer(ModelConfig(tokenizer=str(tokenizer)))
    assert "model.trust_remote_code=true" in str(refused.value) and "planted_" in str(refused.value)
    assert not marker.exists()
    load_tokenizer(ModelConfig(tokenizer=str(tokenizer), trust_remote_code=True))
    assert marker.exists()
    assert "planted_" in capsys.readouterr().err
