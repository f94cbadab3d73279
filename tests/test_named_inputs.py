"""Issue 37 item 7: the files a config names are checked where the config is typed. `show`, `lint` and `launch
--dry-run` refuse a missing data source, eval source or chat template with its key (exit 2), before any rank starts
or any tokenizer loads; every such problem is reported at once; a hub name is left to the run."""
from __future__ import annotations

import pytest

from distributed import run_cli
from trainer.errors import ConfigError
from trainer.presets import load_preset
from trainer.resolve import resolve


@pytest.mark.parametrize("command", [["show"], ["lint"], ["launch", "--dry-run"]])
def test_light_commands_name_a_missing_source_and_an_unknown_template(command):
    proc = run_cli(command[0], "tiny_cpu", *command[1:], "--set", "data.source=/nope.jsonl",
                   "--set", "data.chat_template=llama-9")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "data.source: '/nope.jsonl': no such file or directory" in proc.stderr
    assert "data.chat_template: 'llama-9' is neither a shipped template (chatml" in proc.stderr
    assert "launch: the command:" not in proc.stdout  # refused before anything is printed to run


def problems_of(overrides: list[str]) -> list[str]:
    with pytest.raises(ConfigError) as err:
        resolve(load_preset("tiny_cpu", overrides))
    return err.value.problems


def test_every_named_file_is_checked_at_once(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.csv").write_text("a,b\n")
    problems = problems_of(['data.source=""', f"data.sources=[{{path: {tmp_path / 'empty'}}}, {{path: {tmp_path / 'notes.csv'}}}, "
                            f"{{path: data/tiny/pretrain.jsonl}}]", f"data.eval_source={tmp_path / 'eval.jsonl'}",
                            "data.chat_template=templates/mine.jinja", f"model.tokenizer={tmp_path / 'tok'}"])
    expected = [f"data.sources[0].path: '{tmp_path / 'empty'}' is a directory with no .jsonl/.json/.parquet/.txt file",
                f"data.sources[1].path: '{tmp_path / 'notes.csv'}': the trainer does not read .csv files",
                f"data.eval_source: '{tmp_path / 'eval.jsonl'}': no such file or directory",
                "data.chat_template: 'templates/mine.jinja' is neither a shipped template",
                f"model.tokenizer: '{tmp_path / 'tok'}': no such directory"]
    for fragment in expected:
        assert any(fragment in p for p in problems), (fragment, problems)
    assert len(problems) == len(expected), problems


def test_what_exists_or_lives_on_the_hub_passes(tmp_path):
    template = tmp_path / "mine.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for overrides in (["data.source=data/tiny", "data.chat_template=chatml"],
                      ["data.source=HuggingFaceH4/ultrachat_200k", f"data.chat_template={template}"],
                      ["data.source=data/tiny/chat.jsonl", "data.task=sft", "model.tokenizer=data/tiny/tokenizer"]):
        resolve(load_preset("tiny_cpu", overrides))
