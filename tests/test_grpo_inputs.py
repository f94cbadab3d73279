"""Hostile inputs to GRPO (data.task=grpo): the grpo section's values and the prompt records. Each is a named error
that says which key, file, line or field is wrong and what to do instead; nothing starts ranks (quick tier)."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest

from trainer.config import DataConfig, RewardSpec
from trainer.data.records import DataError
from trainer.errors import UserError
from trainer.presets import load_preset
from trainer.resolve import resolve
from trainer.train.rl import rewards
from trainer.train.rl.prompts import PromptLoader, load_prompts


def problems_of(*overrides: str) -> str:
    with pytest.raises(UserError) as caught:
        resolve(load_preset("tiny_grpo_cpu", list(overrides)))
    return str(caught.value)


def test_the_preset_resolves():
    resolved = resolve(load_preset("tiny_grpo_cpu"))
    assert resolved.config.data.task == "grpo" and resolved.config.grpo.num_generations == 8


@pytest.mark.parametrize("overrides,expected", [
    (["grpo.rewards=[{name: exact_mach}]"], ["grpo.rewards[0].name", "unknown reward 'exact_mach'",
                                             "did you mean 'exact_match'", "package.module:function"]),
    (["grpo.rewards=[{name: 'my module:fn'}]"], ["grpo.rewards[0].name", "not an import path"]),
    (["grpo.rewards=[{name: exact_match, pattern: 'x'}]"], ["grpo.rewards[0].pattern", "only read by the 'format'"]),
    (["grpo.rewards=[{name: format, pattern: '(('}]"], ["grpo.rewards[0].pattern", "not a regular expression"]),
    (["grpo.rewards=[]"], ["grpo.rewards is empty"]),
    (["grpo.rewards=[{name: exact_match, weight: 0}]"], ["every weight is 0"]),
    (["grpo.num_generations=1", "train.micro_batch_size=4"], ["grpo.num_generations=1", "at least 2"]),
    (["train.micro_batch_size=12"], ["train.micro_batch_size=12", "multiple of it"]),
    (["grpo.max_new_tokens=16"], ["grpo.max_new_tokens=16", "no room for a prompt"]),
    (["grpo.epsilon_high=0.1"], ["grpo.epsilon_high=0.1", "below grpo.epsilon"]),
    (["grpo.temperature=0"], ["grpo.temperature"]),
    (["grpo.top_p=1.5"], ["grpo.top_p"]),
    (["grpo.loss_type=ppo"], ["grpo.loss_type", "dapo"]),
    (["grpo.num_generation=4"], ["grpo.num_generation", "num_generations"]),
    (["data.task=sft", "data.source=data/tiny/chat.jsonl"], ["grpo.", "data.task=sft", "set data.task=grpo"]),
])
def test_bad_settings_are_named_with_their_key_and_a_fix(overrides, expected):
    message = problems_of(*overrides)
    for part in expected:
        assert part in message, (part, message)


def test_a_grpo_section_without_data_task_grpo_is_refused_by_the_default_preset():
    with pytest.raises(UserError, match="grpo.num_generations set, but data.task=pretrain"):
        resolve(load_preset("tiny_cpu", ["grpo.num_generations=4"]))


def test_a_missing_module_or_function_is_named_when_the_rewards_are_built(tmp_path, monkeypatch):
    with pytest.raises(rewards.RewardError, match=r"grpo.rewards\[0\].name: cannot import module 'no_such_mod_x'"):
        rewards.build_rewards([RewardSpec(name="no_such_mod_x:fn")])
    (tmp_path / "my_rewards.py").write_text("value = 3\ndef good(completions, **kw):\n    return [1.0] * len(completions)\n"
                                            "def short(completions, **kw):\n    return [1.0]\n"
                                            "def words(completions, **kw):\n    return ['a'] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(rewards.RewardError, match="has no function 'missing'"):
        rewards.build_rewards([RewardSpec(name="my_rewards:missing")])
    with pytest.raises(rewards.RewardError, match="'value' is a int"):
        rewards.build_rewards([RewardSpec(name="my_rewards:value")])
    built = rewards.build_rewards([RewardSpec(name="my_rewards:good"), RewardSpec(name="my_rewards:short"),
                                   RewardSpec(name="my_rewards:words")])
    assert rewards.score(built[:1], ["p", "q"], ["a", "b"], ["1", "2"], [1, 1]) == [[1.0, 1.0]]
    with pytest.raises(rewards.RewardError, match="returned 1 value.s. for 2 completions"):
        rewards.score(built[1:2], ["p", "q"], ["a", "b"], ["1", "2"], [1, 1])
    with pytest.raises(rewards.RewardError, match="return floats"):
        rewards.score(built[2:], ["p", "q"], ["a", "b"], ["1", "2"], [1, 1])
    sys.modules.pop("my_rewards", None)


@pytest.mark.parametrize("text,answer,reward", [
    ("8", "8", 1.0), ("the sum is 8", "8", 1.0), ("\\boxed{1,000}", "1000", 1.0), ("#### 72\nthanks", "72", 1.0),
    ("7", "8", 0.0), ("", "8", 0.0), ("8.0", "8", 1.0), ("5 then 8", "She had 3... #### 8", 1.0),
])
def test_exact_match_reads_the_answer_as_math_graders_do(text, answer, reward):
    assert rewards.exact_match(completions=[text], answer=[answer]) == [reward]


def test_format_and_length_penalty():
    assert rewards.format_reward(None)(completions=["12", "none"]) == [1.0, 0.0]
    assert rewards.format_reward(r"\d+")(completions=["12", "12 "]) == [1.0, 0.0]
    assert rewards.length_penalty(4)(completion_lengths=[2, 4, 6, 100]) == [0.0, 0.0, -0.5, -1.0]


@pytest.fixture(scope="module")
def tokenizer():
    from trainer.config import ModelConfig
    from trainer.data import load_tokenizer
    return load_tokenizer(ModelConfig(tokenizer="data/tiny_grpo/start"))


def write(tmp_path, text: str):
    path = tmp_path / "prompts.jsonl"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


@pytest.mark.parametrize("line,expected", [
    ('{"prompt": "1+1=", "answer": "2"', "not valid JSON"),
    ('["1+1=", "2"]', "a JSON list, expected an object"),
    ('{"question": "1+1=", "answer": "2"}', "no field 'prompt'"),
    ('{"prompt": 3, "answer": "2"}', "field 'prompt' is a int, expected a string"),
    ('{"prompt": "  ", "answer": "2"}', "field 'prompt' is empty"),
    ('{"prompt": "1+1="}', "no field 'answer'"),
    ('{"prompt": "1+1=", "answer": true}', "field 'answer' is a bool"),
    ('{"prompt": "1+1=", "answer": [2]}', "field 'answer' is a list"),
    ('{"prompt": "1+1=\\ud800", "answer": "2"}', "field 'prompt', character 4: U+D800, a lone surrogate"),
    ('{"prompt": "1+1=", "answer": "\\udc80"}', "field 'answer', character 0: U+DC80"),
    ('{"messages": [{"role": "user"}], "answer": "2"}', "field 'messages' must be a non-empty list"),
    ('{"prompt": "' + "1" * 40 + '", "answer": "2"}', "more than data.seq_len - grpo.max_new_tokens"),
])
def test_bad_records_name_the_file_line_and_field(tmp_path, tokenizer, line, expected):
    path = write(tmp_path, '{"prompt": "2+2=", "answer": "4"}\n\n' + line + "\n")
    with pytest.raises(DataError) as caught:
        load_prompts(str(path), tokenizer, DataConfig(), max_prompt_tokens=12)
    message = str(caught.value)
    assert f"{path}:3" in message and expected in message, message


def test_a_file_that_is_not_utf8_or_empty_or_missing_is_named(tmp_path, tokenizer):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"prompt": "caf\u00e9", "answer": "1"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match="not UTF-8"):
        load_prompts(str(path), tokenizer, DataConfig(), 12)
    with pytest.raises(DataError, match="has no records"):
        load_prompts(str(write(tmp_path, "\n\n")), tokenizer, DataConfig(), 12)
    with pytest.raises(DataError, match="no such file"):
        load_prompts(str(tmp_path / "absent.jsonl"), tokenizer, DataConfig(), 12)


def test_truncate_cuts_long_prompts_from_the_left(tmp_path, tokenizer):
    path = write(tmp_path, json.dumps({"prompt": "123456789+1=", "answer": 10}) + "\n")
    [record] = load_prompts(str(path), tokenizer, DataConfig(truncate=True), 5)
    assert tokenizer.decode(record.ids) == "89+1="
    assert record.answer == "10"


def test_the_loader_repeats_a_cycle_and_resumes_at_any_step():
    loader = PromptLoader(count=10, per_micro=2, accum=2, dp_rank=1, dp_size=2, iterations=2, seed=3)
    it = iter(loader)
    steps = [[next(it) for _ in range(2)] for _ in range(5)]
    assert [int(s[0]["iteration"]) for s in steps] == [0, 1, 0, 1, 0]
    assert steps[0][0]["prompts"].tolist() == steps[1][0]["prompts"].tolist()  # a cycle trains on one rollout
    assert steps[0][0]["prompts"].tolist() != steps[2][0]["prompts"].tolist()
    assert steps[0][0]["prompts"].tolist() == steps[0][1]["prompts"].tolist()  # each micro carries the step's
    assert steps[0][0]["prompts"].shape == (2, 2)
    again = PromptLoader(count=10, per_micro=2, accum=2, dp_rank=1, dp_size=2, iterations=2, seed=3)
    taken = PromptLoader(count=10, per_micro=2, accum=2, dp_rank=1, dp_size=2, iterations=2, seed=3)
    taken_it = iter(taken)
    for _ in range(3 * 2):
        next(taken_it)
    again.load_state_dict(taken.state_dict())
    assert again.state_dict() == {"prompts": 8, "iteration": 1}  # one cycle of 2 x 2 x 2 prompts done
    resumed = iter(again)
    for expected in steps[3:]:
        for micro in expected:
            got = next(resumed)
            assert got["prompts"].tolist() == micro["prompts"].tolist() and int(got["iteration"]) == int(
                micro["iteration"])


def test_plan_task_grpo_prices_the_rollout_and_says_which_phase_sets_the_peak(capsys):
    from trainer.__main__ import main
    assert main(["plan", "--model", "7b", "--gpu", "h100-80g", "--gpus-per-node", "8", "--task", "grpo",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    choice = plan["choice"]
    assert plan["fits"] and plan["task"] == "grpo" and plan["reference"] == "engine"
    assert choice["micro_batch"] % 2 == 0 and choice["rollout_gpu_bytes"] > 0
    assert choice["gpu_bytes"]["reference"] > 0  # the frozen KL reference's weights
    assert main(["plan", "--model", "7b", "--gpu", "h100-80g", "--gpus-per-node", "8", "--task", "grpo",
                 "--reference", "none", "--seq-len", "4096", "--micro-batch", "32", "--json"]) in (0, 1)
    long = json.loads(capsys.readouterr().out)
    rows = [row for row in long["candidates"] if row["name"] == "zero3"]
    assert rows and rows[0]["gpu_bytes"]["reference"] == 0
    assert rows[0]["rollout_sets_peak"] is True  # 32 x 4096 tokens of KV cache and the gathered model


def test_lint_warns_about_small_groups():
    from trainer.diagnose.lint import lint_resolved
    findings = lint_resolved(resolve(load_preset("tiny_grpo_cpu", ["grpo.num_generations=2"])))
    assert any(f.check == "GRPO" and "fewer than 4" in f.message for f in findings)
    assert not any(f.check == "GRPO" for f in lint_resolved(resolve(load_preset("tiny_grpo_cpu"))))


def test_the_external_rollout_interface_pushes_every_weight_and_pads_completions():
    """train/rl/external.py with a stand-in engine (the vLLM one is tests/test_grpo_engine.py's gpu test)."""
    import torch

    from trainer.train.rl.external import ExternalRollouts, SamplingSettings, push_weights

    class Recorder:
        def __init__(self):
            self.names, self.asked = [], None

        def load_weights(self, named_tensors):
            self.names = [name for name, _ in named_tensors]

        def generate(self, prompt_ids, n, params):
            self.asked = (prompt_ids, n, params)
            return [[5, 6, 1], [7, 1]] * len(prompt_ids)

    module = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    engine = type("Engine", (), {"module": module})()
    recorder = Recorder()
    assert push_weights(engine, recorder) == 4 and recorder.names == ["0.weight", "0.bias", "1.weight", "1.bias"]
    ids, mask = ExternalRollouts(recorder, pad_id=0, device="cpu").complete([[3, 4]], 2, SamplingSettings(8))
    assert ids.tolist() == [[5, 6, 1], [7, 1, 0]] and mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert recorder.asked[1] == 2 and recorder.asked[2].max_new_tokens == 8
