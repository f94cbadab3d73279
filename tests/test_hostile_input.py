"""Issue 12's hostile inputs: each class of failure (files that are not what they claim, outputs that could be
half-written, validation holes, YAML itself, errors that point to the wrong place) tried per input kind and
command, in process through `trainer.__main__.main`. Every case: exit 2, `error: ...` naming the thing and
where, no traceback, nothing on stdout, and no output written or overwritten.

The training-time sweep (a bad tokenizer, unreadable data, a full disk at save) is at the end; it runs real
single-rank `train.py` processes.
"""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from trainer import files
from trainer.__main__ import main
from trainer.errors import UserError
from trainer.presets import PRESET_DIR, TEMPLATE_DIR

ROOT = Path(__file__).resolve().parent.parent
TINY_PRESET = (PRESET_DIR / "tiny_cpu.yaml").read_text()
HF_CONFIG = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "intermediate_size": 11008, "vocab_size": 32000,
             "max_position_embeddings": 4096}


def refused(capsys, args: list[str], *fragments: str) -> str:
    """`python -m trainer ARGS` returns 2 with one `error: ...` holding every fragment, no traceback, no stdout."""
    assert main(args) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert "error: " in err and "Traceback" not in err, err[-3000:]
    assert captured.out == ""
    message = err[err.index("error: "):]
    assert all(f in message for f in fragments), message
    assert len(message) < 4000, f"message of {len(message)} characters"
    return message


# The kinds of file that are not what they claim, each with what the error must say.
NOT_WHAT_THEY_CLAIM = {
    "directory": (None, "is a directory"),
    "binary": (b"\x7fELF\x02\x01\x01\x00\x00\x00" * 50, "binary file"),
    "invalid_utf8": (b"model:\n  family: \xff\xfe llama\n", "not UTF-8 text"),
    "empty": (b"", "is empty"),
    "blank": (b"   \n\n", "is empty"),
}


def bad_file(tmp_path: Path, kind: str, name: str) -> Path:
    path = tmp_path / name
    content, _ = NOT_WHAT_THEY_CLAIM[kind]
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    return path


# ============================================================ 1. files that are not what they claim

@pytest.mark.parametrize("kind", sorted(NOT_WHAT_THEY_CLAIM))
@pytest.mark.parametrize("command", ["show", "export", "lint"])
def test_preset_file_that_is_not_a_preset(kind, command, tmp_path, capsys):
    path = bad_file(tmp_path, kind, "p.yaml")
    out = ["-o", str(tmp_path / "ds.json")] if command == "export" else []
    refused(capsys, [command, str(path), *out], f"preset {path}", NOT_WHAT_THEY_CLAIM[kind][1])
    assert not (tmp_path / "ds.json").exists()


@pytest.mark.parametrize("text,kind", [("- a\n- b\n", "a list"), ("just a string\n", "a string"), ("42\n", "a number")])
def test_preset_whose_top_level_is_not_a_mapping(text, kind, tmp_path, capsys):
    path = tmp_path / "p.yaml"
    path.write_text(text)
    refused(capsys, ["show", str(path)], f"preset {path}: the top level is {kind}", "a mapping of sections")


def test_missing_preset_path_is_named_as_a_path(capsys):
    refused(capsys, ["show", "no/such/preset.yaml"], "preset file 'no/such/preset.yaml' does not exist")


@pytest.mark.parametrize("kind", sorted(NOT_WHAT_THEY_CLAIM))
def test_deepspeed_template_that_is_not_json(kind, tmp_path, capsys):
    path = bad_file(tmp_path, kind, "t.json")
    refused(capsys, ["show", "tiny_cpu", "--set", f"deepspeed_template={path}"],
            f"deepspeed_template {path}", NOT_WHAT_THEY_CLAIM[kind][1])


@pytest.mark.parametrize("text,says", [("[1, 2]", "the top level is a list"), ('{"a": 1,}', "line 1 column 9"),
                                       ('{"gradient_clipping": NaN}', "NaN is not a JSON number")])
def test_deepspeed_template_with_bad_json(text, says, tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(text)
    refused(capsys, ["export", "tiny_cpu", "--set", f"deepspeed_template={path}", "-o", "-"],
            f"deepspeed_template {path}", says)


@pytest.mark.parametrize("kind", sorted(NOT_WHAT_THEY_CLAIM))
def test_scenario_file_that_is_not_a_scenario(kind, tmp_path, capsys):
    path = bad_file(tmp_path, kind, "s.yaml")
    refused(capsys, ["plan", str(path)], f"scenario file {path}", NOT_WHAT_THEY_CLAIM[kind][1])


def test_scenario_file_that_is_a_list(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text("- model: 7b\n- gpu: a100-80g\n")
    refused(capsys, ["plan", str(path)], f"scenario file {path}: the top level is a list", "model, gpu")


@pytest.mark.parametrize("kind", sorted(NOT_WHAT_THEY_CLAIM))
def test_hf_config_json_that_is_not_a_config(kind, tmp_path, capsys):
    path = bad_file(tmp_path, kind, "config.json")
    refused(capsys, ["plan", "--model", str(path), "--gpu", "a100-80g"], "--model config.json", str(path),
            NOT_WHAT_THEY_CLAIM[kind][1])


@pytest.mark.parametrize("content,says", [
    ([HF_CONFIG], "the top level is a list"),
    ({**HF_CONFIG, "hidden_size": "4096"}, "hidden_size: expected an integer, got '4096'"),
    ({**HF_CONFIG, "num_hidden_layers": [32]}, "num_layers: expected an integer"),
    ({**HF_CONFIG, "model_type": "x" * 5000}, "has model_type 'xxxx"),
])
def test_hf_config_json_with_wrong_shape(content, says, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(content))
    message = refused(capsys, ["plan", "--model", str(path), "--gpu", "a100-80g"], says)
    assert len(message) < 1500


def test_a_device_is_not_read_as_a_config(capsys):
    # /dev/zero would be read forever; it is refused by its type before a byte is read
    refused(capsys, ["plan", "--model", "/dev/zero.json", "--gpu", "a100-80g"], "does not exist")
    with pytest.raises(UserError, match="not a regular file"):
        files.read_text("/dev/zero", "preset")


def test_an_oversized_file_is_refused_by_its_size(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_bytes(b"# " + b"x" * (files.MAX_CONFIG_BYTES + 10))
    with pytest.raises(UserError, match=r"preset .*big.yaml is 4,194,316 bytes, over the 4,194,304"):
        files.read_text(path, "preset")


# --- the doctor's log reader (trainer.files.read_log; doctor.py calls it) -----------------------------------

def test_read_log_refuses_a_directory_a_missing_file_and_says_empty(tmp_path):
    with pytest.raises(UserError, match="log file .* is a directory"):
        files.read_log(tmp_path)
    with pytest.raises(UserError, match="log file .* does not exist"):
        files.read_log(tmp_path / "nope.log")
    (tmp_path / "empty.log").write_bytes(b"")
    with pytest.raises(UserError, match="log file .*empty.log is empty"):
        files.read_log(tmp_path / "empty.log")
    (tmp_path / "blank.log").write_bytes(b"\n \n")
    with pytest.raises(UserError, match="is empty"):
        files.read_log(tmp_path / "blank.log")


def test_read_log_refuses_a_binary_file(tmp_path):
    (tmp_path / "core").write_bytes(b"\x00\x01\x02\x00" * 4096)
    with pytest.raises(UserError, match="log file .*core is a binary file, not a log"):
        files.read_log(tmp_path / "core")


def test_read_log_names_random_bytes_and_a_zip_and_reads_compressed_and_utf16_logs(tmp_path):
    import bz2
    import gzip
    import random
    draw = random.Random(7)
    (tmp_path / "noise").write_bytes(bytes(draw.randrange(1, 256) for _ in range(20_000)))  # not one NUL
    with pytest.raises(UserError, match="noise is a binary file, not a log"):
        files.read_log(tmp_path / "noise")
    (tmp_path / "logs.zip").write_bytes(b"PK\x03\x04" + b"\x00" * 100)
    with pytest.raises(UserError, match="is a zip archive: extract the log"):
        files.read_log(tmp_path / "logs.zip")
    text = "step 1\nRuntimeError: CUDA out of memory\n"
    (tmp_path / "run.log.gz").write_bytes(gzip.compress(text.encode()))
    (tmp_path / "run.log.bz2").write_bytes(bz2.compress(text.encode()))
    (tmp_path / "ps.log").write_bytes(text.encode("utf-16"))  # PowerShell's `>` writes UTF-16 with a BOM
    assert all(files.read_log(tmp_path / name) == text for name in ("run.log.gz", "run.log.bz2", "ps.log"))
    (tmp_path / "cut.gz").write_bytes(gzip.compress(text.encode())[:12])
    with pytest.raises(UserError, match="cut.gz is gzip-compressed but does not decompress"):
        files.read_log(tmp_path / "cut.gz")


def test_read_log_keeps_the_tail_of_a_compressed_log(tmp_path):
    import gzip
    (tmp_path / "big.gz").write_bytes(gzip.compress(b"early line\n" * 5000 + b"RuntimeError: the end\n"))
    text = files.read_log(tmp_path / "big.gz", max_bytes=1000)
    assert text.rstrip().endswith("RuntimeError: the end") and len(text) <= 1000


def test_read_log_replaces_bad_bytes_drops_control_characters_and_cuts_long_lines(tmp_path):
    log = tmp_path / "run.log"
    log.write_bytes(b"step 1 \xff\xfe loss 2.0\x1b[0m\r\n" + b"=" * 50_000 + b"\nRuntimeError: CUDA out of memory\n")
    text = files.read_log(log)
    lines = text.splitlines()
    assert lines[0] == "step 1 \ufffd\ufffd loss 2.0[0m"
    assert len(lines[1]) < files.MAX_LOG_LINE + 100 and "48,000 more characters cut" in lines[1]
    assert lines[2] == "RuntimeError: CUDA out of memory"


def test_read_log_reads_only_the_tail_of_a_huge_log(tmp_path):
    log = tmp_path / "huge.log"
    with open(log, "wb") as handle:
        handle.write(b"early line\n" * 2000)
        handle.write(b"RuntimeError: the end\n")
    text = files.read_log(log, max_bytes=1000)
    assert text.rstrip().endswith("RuntimeError: the end") and len(text) <= 1000
    assert text.count("early line") < 100


# ============================================================ 2. outputs that could be half-written

OLD = '{"old": true}\n'


@pytest.fixture
def existing(tmp_path) -> Path:
    path = tmp_path / "ds.json"
    path.write_text(OLD)
    return path


def export_args(target: str) -> list[str]:
    return ["export", "tiny_cpu", "-o", target]


def plan_args(target: str) -> list[str]:
    return ["plan", "--model", "7b", "--gpu", "a100-80g", "--gpus-per-node", "8", "-o", target]


@pytest.mark.parametrize("command", [export_args, plan_args], ids=["export", "plan"])
@pytest.mark.parametrize("target,says", [("", ": empty"), ("/dev/full", "is a character device"),
                                         ("{dir}", "a directory"), ("{dir}/no/such/ds.json", "does not exist")])
def test_bad_output_target_is_refused_before_any_work(command, target, says, tmp_path, capsys):
    refused(capsys, command(target.format(dir=tmp_path)), "-o", says)
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize("command", [export_args, plan_args], ids=["export", "plan"])
def test_full_disk_leaves_the_existing_output_unchanged(command, existing, monkeypatch, capsys):
    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(files.os, "fsync", full)
    refused(capsys, command(str(existing)), f"-o {existing}: cannot write it (No space left on device)",
            "nothing was written")
    assert existing.read_text() == OLD
    assert sorted(os.listdir(existing.parent)) == ["ds.json"]  # the temporary file is gone too


def test_a_file_size_limit_leaves_the_existing_output_unchanged(existing):
    # a real process under RLIMIT_FSIZE (Python ignores SIGXFSZ, so the write fails with EFBIG)
    script = ("import resource, sys; from trainer.__main__ import main; "
              "resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64)); sys.exit(main(sys.argv[1:]))")
    result = subprocess.run([sys.executable, "-c", script, *export_args(str(existing))], cwd=ROOT,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"error: -o {existing}: cannot write it (File too large)" in result.stderr
    assert "Traceback" not in result.stderr
    assert existing.read_text() == OLD and sorted(os.listdir(existing.parent)) == ["ds.json"]


def test_a_written_output_replaces_the_old_one_whole_and_keeps_its_mode(existing, capsys):
    existing.chmod(0o640)
    assert main(export_args(str(existing))) == 0
    assert json.loads(existing.read_text())["zero_optimization"]["stage"] == 2
    assert existing.stat().st_mode & 0o777 == 0o640


# ============================================================ 3. validation holes

@pytest.mark.parametrize("command", ["show", "lint"])
def test_world_size_zero_is_an_error_not_the_presets_world_size(command, capsys):
    assert main([command, "tiny_cpu", "--world-size", "0"]) == 2
    err = capsys.readouterr().err
    assert "argument --world-size: '0' must be >= 1" in err and "Traceback" not in err


@pytest.mark.parametrize("override,says", [
    ("train.lr=.inf", "train.lr: inf is not a finite number"),
    ("train.weight_decay=.nan", "train.weight_decay: nan is not a finite number"),
    ("deepspeed.optimizer.params.eps=-.inf", "deepspeed.optimizer.params.eps: -inf is not a finite number"),
    ("deepspeed.zero_optimization.reduce_bucket_size=.nan", "reduce_bucket_size: nan is not a finite number"),
])
def test_non_finite_numbers_are_refused(override, says, existing, capsys):
    refused(capsys, ["export", "tiny_cpu", "--set", override, "-o", str(existing)], says, f"(from --set {override})")
    assert existing.read_text() == OLD


def test_deepspeed_template_name_cannot_climb_out_of_the_templates_directory(capsys):
    refused(capsys, ["show", "tiny_cpu", "--set", "deepspeed_template=.."], "deepspeed_template '..'", ".json")
    refused(capsys, ["show", "tiny_cpu", "--set", "deepspeed_template=../../pyproject.toml"],
            "a path must name a DeepSpeed .json file")


def test_deepspeed_template_at_an_explicit_path_is_read_and_said(tmp_path, capsys):
    path = tmp_path / "mine.json"
    path.write_text((TEMPLATE_DIR / "zero2.json").read_text())
    assert main(["show", "tiny_cpu", "--set", f"deepspeed_template={path}"]) == 0
    document = yaml.safe_load(capsys.readouterr().out)
    assert document["deepspeed_template"] == str(path.resolve())
    assert f"deepspeed_template read from {path.resolve()} (not presets/deepspeed/)" in document["notices"]


def test_lora_targets_in_a_scenario_name_modules(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text("model: 7b\ngpu: a100-80g\ntask: lora\nlora: {target_modules: [q_proj, query_key_value]}\n")
    refused(capsys, ["plan", str(path)], "lora.target_modules: ['query_key_value'] name no module",
            "q_proj, k_proj")


# ============================================================ 4. YAML itself

def test_duplicate_section_in_a_preset_is_refused_with_both_lines(tmp_path, capsys):
    path = tmp_path / "p.yaml"
    path.write_text(TINY_PRESET + "train:\n  max_steps: 5\n")
    first = TINY_PRESET.splitlines().index("train:") + 1
    last = len(TINY_PRESET.splitlines()) + 1
    refused(capsys, ["show", str(path)], f"preset {path}: line {last}: duplicate key 'train' (first at line {first})",
            "merge them")


def test_duplicate_key_in_a_set_value_and_in_a_scenario(tmp_path, capsys):
    refused(capsys, ["show", "tiny_cpu", "--set", "deepspeed.zero_optimization={stage: 1, stage: 3}"],
            "--set deepspeed.zero_optimization={stage: 1, stage: 3}: line 1: duplicate key 'stage'")
    path = tmp_path / "s.yaml"
    path.write_text("model: 7b\ngpu: a100-80g\ngpu: h100-80g\n")
    refused(capsys, ["plan", str(path)], f"scenario file {path}: line 3: duplicate key 'gpu' (first at line 2)")


def test_merge_keys_may_still_be_overridden():
    assert files.parse_yaml("base: &b {a: 1, b: 2}\nx:\n  <<: *b\n  a: 3\n")["x"] == {"a": 3, "b": 2}


def billion_laughs(levels: int) -> str:
    lines = ['a0: &a0 "lol"']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels + 1)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("levels", [7, 9])
def test_alias_bomb_is_refused_fast_with_a_short_message(levels, tmp_path, capsys):
    path = tmp_path / "bomb.yaml"
    path.write_text(billion_laughs(levels))
    started = time.monotonic()
    refused(capsys, ["show", str(path)], f"preset {path}", "aliases expand to more than 100,000 values")
    assert time.monotonic() - started < 5


@pytest.mark.slow
def test_recursive_alias_and_deep_nesting_are_refused(tmp_path, capsys):
    path = tmp_path / "loop.yaml"
    path.write_text("train: &t\n  again: *t\n")
    refused(capsys, ["show", str(path)], "an alias refers to itself")
    refused(capsys, ["show", "tiny_cpu", "--set", "train.lr=" + "[" * 5000 + "]" * 5000], "--set train.lr=[[[[")


def test_long_values_are_shortened_in_messages(capsys):
    message = refused(capsys, ["show", "tiny_cpu", "--set", "train.lr=" + "x" * 100_000], "train.lr: expected a number")
    assert len(message) < 1000


# ============================================================ 5. errors that point to the right place

def test_set_mistakes_are_blamed_on_the_set_item_not_the_preset(capsys):
    message = refused(capsys, ["show", "tiny_cpu", "--set", "train.lr=abc"], "in the command line",
                      "train.lr: expected a number, got 'abc' (from --set train.lr=abc)")
    assert "tiny_cpu.yaml" not in message


def test_file_and_set_problems_together_name_both(tmp_path, capsys):
    path = tmp_path / "p.yaml"
    path.write_text(TINY_PRESET.replace("  lr: 3.0e-3", "  lr: fast"))
    message = refused(capsys, ["show", str(path), "--set", "train.max_steps=many"], f"{path} and the command line",
                      "train.lr: expected a number, got 'fast'\n", "(from --set train.max_steps=many)")
    assert "'fast' (from --set" not in message


def test_deepspeed_section_errors_name_the_preset_path(tmp_path, capsys):
    path = tmp_path / "p.yaml"
    path.write_text(TINY_PRESET.replace("zero_optimization: {", "zero_optimization: {stage: 4, "))
    refused(capsys, ["show", str(path)], f"in {path}:", "deepspeed.zero_optimization.stage: Input should be 0, 1, 2 "
            "or 3 (got 4)")


def test_other_tools_names_get_a_suggestion(capsys):
    refused(capsys, ["show", "tiny_cpu", "--set", "train.learning_rate=1e-4"],
            "unknown key 'train.learning_rate' (did you mean 'lr'?)")
    refused(capsys, ["show", "tiny_cpu", "--set", "train.gradient_accumulation_steps=2"], "did you mean 'grad_accum'")


def test_batch_triad_error_shows_no_value_the_user_did_not_give(capsys):
    message = refused(capsys, ["show", "tiny_cpu", *("--set", "train.grad_accum=null"),
                               *("--set", "train.global_batch_size=4")],
                      "global_batch_size 4 is not a multiple of micro_batch_size 8 x data-parallel size 2 = 16",
                      "use a global_batch_size of 16")
    assert "grad_accum 0" not in message


def test_gpu_names_are_case_insensitive_in_presets_as_in_plan(capsys):
    assert main(["show", "7b_8xa100", "--set", "hardware.gpu=A100-80G", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["hardware"]["gpu"] == "a100-80g"
    refused(capsys, ["show", "7b_8xa100", "--set", "hardware.gpu=a100-80"], "(did you mean 'a100-80g' or 'a100-80g-pcie'?)")


def test_bf16_on_v100_says_v100_has_no_bf16(capsys):
    refused(capsys, ["show", "7b_2xv100", "--set", "train.precision=bf16"], "train.precision=bf16",
            "V100", "has no bf16", "train.precision=fp16")


def test_missing_scenario_suggests_one_that_exists(capsys):
    message = refused(capsys, ["plan", "scenarios/seed1_7b_8xa10.yaml"], "does not exist",
                      "(did you mean 'seed1_7b_8xa100.yaml'?)")
    suggested = message.split("`python -m trainer plan ")[1].split("`")[0]
    assert (ROOT / suggested).is_file()


# --- round four of scripts/sweep_hostile.py: sequence parallelism, MoE/AutoEP, preference tuning ---------------

MIXTRAL = {**HF_CONFIG, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2}


@pytest.mark.parametrize("config,fragment", [
    ({**MIXTRAL, "num_local_experts": 0}, "model.num_experts=0 must be >= 1"),
    ({**MIXTRAL, "num_experts_per_tok": 9}, "model.num_experts_per_tok=9 exceeds model.num_experts=8"),
], ids=["no experts", "top-k over experts"])
def test_plan_refuses_an_moe_config_json_it_cannot_count(config, fragment, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(config))
    refused(capsys, ["plan", "--model", str(tmp_path / "config.json"), "--gpu", "a100-80g"],
            f"--model {tmp_path / 'config.json'}: ", fragment)


@pytest.mark.parametrize("flags,fragment", [
    (["--model", "8b", "--task", "dpo", "--sequence-parallel", "2"], "--sequence-parallel 2: the DPO loss"),
    (["--model", "mixtral-8x7b", "--task", "dpo-lora", "--expert-parallel", "8"],
     "--expert-parallel 8 with --task dpo-lora"),
    (["--model", "mixtral-8x7b", "--sequence-parallel", "2", "--expert-parallel", "2"],
     "--sequence-parallel 2: the trainer wires AutoEP on data-parallel ranks only"),
], ids=["sp with dpo", "ep with lora", "sp with ep"])
def test_plan_refuses_flags_the_trainer_would_refuse_together(flags, fragment, capsys):
    """The planner used to choose these, and the launch line it printed was then refused by the trainer's rules."""
    refused(capsys, ["plan", *flags, "--gpu", "h100-80g", "--gpus-per-node", "8"], fragment)


def test_plan_does_not_pick_sequence_parallelism_for_dpo(capsys):
    assert main(["plan", "--model", "8b", "--gpu", "h100-80g", "--gpus-per-node", "8", "--task", "dpo",
                 "--seq-len", "131072", "--json"]) == 1  # fits nowhere without it
    plan = json.loads(capsys.readouterr().out)
    assert not plan["fits"] and "sequence parallelism: the DPO loss" in " ".join(plan["walk"]), plan["walk"]


@pytest.mark.parametrize("reference,fragment", [
    ("missing", "--reference '{d}/missing': no such file or directory"),
    ("config.json", "--reference {d}/config.json: a regular file, not a directory"),
    ("", "--reference is empty"),
], ids=["missing", "a file", "empty"])
def test_evaluate_names_a_bad_reference_as_reference_not_model(reference, fragment, tmp_path, capsys):
    """A bad --reference used to be reported as '--model ...' (and an empty one silently meant the default)."""
    (tmp_path / "config.json").write_text(json.dumps({**HF_CONFIG, "hidden_size": 64, "num_hidden_layers": 1,
                                                      "num_attention_heads": 2, "num_key_value_heads": 2}))
    for file in (ROOT / "data" / "tiny" / "tokenizer").iterdir():  # the model's tokenizer loads before --reference
        (tmp_path / file.name).write_bytes(file.read_bytes())
    target = str(tmp_path / reference) if reference else ""
    refused(capsys, ["evaluate", "--model", str(tmp_path), "--data", str(ROOT / "data" / "tiny" / "preference.jsonl"),
                     "--task", "preference", "--reference", target], fragment.format(d=tmp_path))


def test_a_word_for_an_optional_number_says_null_is_the_other_choice(capsys):
    refused(capsys, ["show", "tiny_cpu", "--set", "model.tiled_logits=auto"],
            "model.tiled_logits: expected an integer or null, got 'auto'")


# ============================================================ training-time inputs (train.py, one rank)

TINY_RUN = ["--world-size", "1", "--set", "model.num_layers=2", "--set", "model.hidden_size=64",
            "--set", "model.intermediate_size=176", "--set", "data.seq_len=64", "--set", "train.max_steps=2",
            "--set", "train.warmup_steps=1", "--set", "logging.progress_bar=false"]


def broken_tokenizer(tmp_path: Path) -> Path:
    """The tiny tokenizer with a tokenizer.json that is valid JSON of the wrong shape (KeyError in `tokenizers`)."""
    directory = tmp_path / "tok"
    directory.mkdir()
    for file in (ROOT / "data" / "tiny" / "tokenizer").iterdir():
        (directory / file.name).write_bytes(file.read_bytes())
    (directory / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 5}}')
    return directory


def test_a_broken_tokenizer_is_a_data_error(tmp_path):
    from trainer.config import ModelConfig
    from trainer.data import DataError, load_tokenizer
    with pytest.raises(DataError, match=r"cannot load a tokenizer from .*tok' \(KeyError: .*model.tokenizer"):
        load_tokenizer(ModelConfig(tokenizer=str(broken_tokenizer(tmp_path))))


def test_a_fifo_as_data_file_is_refused_not_read_forever(tmp_path):
    from trainer.data.records import DataError, _read_file
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match="data.jsonl: not a regular file"):
        _read_file(fifo)


def test_an_unreadable_data_file_is_named(tmp_path, monkeypatch):
    from trainer.data import records
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "x"}\n')

    def eio(path):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(records.Path, "read_bytes", eio)
    with pytest.raises(records.DataError, match=r"data.jsonl: cannot read it \(Input/output error\)"):
        records._read_file(data)


def run_train(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "train.py", "--preset", "tiny_cpu", *TINY_RUN, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["tokenizer", "data", "set"])
def test_train_py_refuses_bad_inputs_with_exit_2(case, tmp_path):
    out = tmp_path / "run"
    args = {"tokenizer": ["--set", f"model.tokenizer={broken_tokenizer(tmp_path)}"],
            "data": ["--set", f"data.source={tmp_path / 'fifo.jsonl'}"],
            "set": ["--set", "train.learning_rate=1e-3"]}[case]
    if case == "data":
        os.mkfifo(tmp_path / "fifo.jsonl")
    result = run_train([*args, "--set", f"train.output_dir={out}"])
    says = {"tokenizer": "cannot load a tokenizer from", "data": "fifo.jsonl' is not a regular file (a FIFO",
            "set": "unknown key 'train.learning_rate' (did you mean 'lr'?) (from --set train.learning_rate=1e-3)"}
    assert result.returncode == 2, result.stderr[-3000:]
    assert "error: " in result.stderr and says[case] in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not out.exists()


def test_rehearse_keeps_the_train_values_given_with_set(tmp_path):
    from trainer.presets import load_preset, set_keys
    from trainer.train.rehearse import rehearsal_config
    overrides = [f"train.output_dir={tmp_path / 'mine'}", "train.max_steps=3", "train.save_every=1"]
    rehearsed, notices = rehearsal_config(load_preset("7b_8xa100", overrides), 2, set_keys(overrides))
    train = rehearsed.train
    assert (train.output_dir, train.max_steps, train.save_every) == (str(tmp_path / "mine"), 3, 1)
    assert (train.eval_every, train.keep_last, train.warmup_steps) == (3, 2, 2)  # not given: the rehearsal's
    assert any("kept from --set: train.max_steps=3" in n for n in notices)
