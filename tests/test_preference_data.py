"""Preference pairs (data.task=preference, trainer/data/preference.py): records -> two masked sequences per pair,
the truncation rule, bad records as named errors with file and line, and prepared shards checked like SFT's.

Fast and local: no DeepSpeed, no distributed, no network.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from trainer.config import DataConfig, ModelConfig
from trainer.data import IGNORE_INDEX, DataError, apply_chat_template, build_datasets, load_tokenizer
from trainer.data.prepare import prepare
from trainer.data.preference import fit_pair

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = ROOT / "data" / "tiny" / "tokenizer"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig(tokenizer=str(TOKENIZER_DIR)))


@pytest.fixture(autouse=True)
def prepared_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def write_jsonl(path: Path, records: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def cfg(source: str, **overrides) -> DataConfig:
    return DataConfig(**{**dict(source=source, eval_source=source, seq_len=48, task="preference"), **overrides})


def pairs(data) -> list[dict]:
    samples = data.train.sources[0].samples
    batch = samples.rows(np.arange(len(samples)))
    return [{key: batch[key][i].tolist() for key in batch} for i in range(len(samples))]


def real(ids: list[int], mask: list[int]) -> list[int]:
    return [t for t, m in zip(ids, mask) if m]


def error(call, *args) -> str:
    with pytest.raises(DataError) as info:
        call(*args)
    return str(info.value)


# ------------------------------------------------------------------------------------------- sequences

def test_a_pair_is_two_sequences_sharing_the_prompt_with_only_the_responses_labelled(tmp_path, tokenizer):
    record = {"prompt": "Q: What is 3 plus 4?\nA:", "chosen": " 7.", "rejected": " 12, I think."}
    pair = pairs(build_datasets(cfg(write_jsonl(tmp_path / "p.jsonl", [record])), tokenizer, 0))[0]
    prompt = tokenizer(record["prompt"])["input_ids"]
    for side, name in enumerate(("chosen", "rejected")):
        response = tokenizer(record[name], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        n = len(prompt) + len(response)
        assert pair["input_ids"][side][:n] == prompt + response
        assert pair["labels"][side] == [IGNORE_INDEX] * len(prompt) + response + [IGNORE_INDEX] * (48 - n)
        assert pair["attention_mask"][side] == [1] * n + [0] * (48 - n)


def test_chat_pairs_label_only_the_final_turn_and_accept_string_message_or_list(tmp_path):
    tokenizer = apply_chat_template(load_tokenizer(ModelConfig(tokenizer=str(TOKENIZER_DIR))),
                                    DataConfig(chat_template="chatml"))
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
               {"role": "user", "content": "2+2?"}]
    forms = [{"messages": history, "chosen": "4.", "rejected": "5."},
             {"messages": history, "chosen": {"role": "assistant", "content": "4."},
              "rejected": [{"role": "assistant", "content": "5."}]}]
    data = build_datasets(cfg(write_jsonl(tmp_path / "c.jsonl", forms), seq_len=96), tokenizer, 0)
    first, second = pairs(data)
    assert first == second  # the three response forms mean the same turn
    for side, answer in enumerate(("4.", "5.")):
        whole = tokenizer.apply_chat_template(history + [{"role": "assistant", "content": answer}], tokenize=False)
        prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        learnt = tokenizer.decode([t for t in first["labels"][side] if t != IGNORE_INDEX])
        assert learnt == whole[len(prompt):].rstrip("\n") or learnt == whole[len(prompt):]
        assert "Hello." not in learnt  # an earlier assistant turn is context, not the response
        assert tokenizer.decode(real(first["input_ids"][side], first["attention_mask"][side])).endswith(
            learnt)


def test_the_eval_split_holds_out_whole_pairs(tmp_path, tokenizer):
    records = [{"prompt": f"Q: {i}?\nA:", "chosen": f" yes {i}.", "rejected": f" no {i}."} for i in range(40)]
    data = build_datasets(cfg(write_jsonl(tmp_path / "p.jsonl", records), eval_source=None, eval_fraction=0.25),
                          tokenizer, 0)
    assert (data.stats["train"]["pairs"], data.stats["eval"]["pairs"]) == (30, 10)
    for pair in pairs(data):
        chosen, rejected = (tokenizer.decode(real(pair["input_ids"][s], pair["attention_mask"][s])) for s in (0, 1))
        assert chosen.split("A:")[0] == rejected.split("A:")[0] and "yes" in chosen and "no" in rejected


# ------------------------------------------------------------------------------------------- truncation

def test_truncation_cuts_the_prompt_from_the_left_first_then_the_responses_from_the_right():
    prompt, chosen, rejected = list(range(100, 110)), list(range(200, 204)), list(range(300, 302))
    fitted = fit_pair(prompt, chosen, rejected, seq_len=12, truncate=True)
    assert fitted.prompt == prompt[2:] and fitted.chosen == chosen and fitted.rejected == rejected and fitted.cut == 2
    # a long response: the prompt keeps half of seq_len (its end), the responses lose their tails
    fitted = fit_pair(prompt, list(range(200, 220)), rejected, seq_len=12, truncate=True)
    assert fitted.prompt == prompt[4:] and fitted.chosen == list(range(200, 206)) and fitted.rejected == rejected
    assert fitted.cut == 4 + 14 and not fitted.problem
    # a prompt shorter than half of seq_len is never cut
    fitted = fit_pair(prompt[:3], list(range(200, 220)), rejected, seq_len=12, truncate=True)
    assert fitted.prompt == prompt[:3] and fitted.chosen == list(range(200, 209))


def test_fitting_problems_are_named():
    assert "no room for a response" in fit_pair(list(range(12)), [1], [2], seq_len=12, truncate=True).problem
    assert "data.truncate" in fit_pair(list(range(8)), [1] * 5, [2], seq_len=12, truncate=False).problem
    same = fit_pair(list(range(8)), [1] * 7 + [2], [1] * 7 + [3], seq_len=12, truncate=True)  # room for 6
    assert "same" in same.problem and "once cut" in same.problem


def test_truncated_pairs_fit_and_are_counted(tmp_path, tokenizer):
    record = {"prompt": "Q: " + "word " * 6 + "?\nA:", "chosen": " one two three" * 10, "rejected": " no."}
    data = build_datasets(cfg(write_jsonl(tmp_path / "p.jsonl", [record]), seq_len=32, truncate=True), tokenizer, 0)
    pair = pairs(data)[0]
    assert data.stats["train"]["truncated_records"] == 1
    assert sum(pair["attention_mask"][0]) == 32
    end_of_prompt = tokenizer(record["prompt"])["input_ids"][-3:]
    prompt_len = pair["labels"][0].index(next(t for t in pair["labels"][0] if t != IGNORE_INDEX))
    assert pair["input_ids"][0][prompt_len - 3:prompt_len] == end_of_prompt  # the prompt's end is kept


# ------------------------------------------------------------------------------------------- bad records

GOOD = {"prompt": "Q: a?\nA:", "chosen": " b.", "rejected": " c."}


@pytest.mark.parametrize("bad, expected", [
    ({"prompt": "Q: a?\nA:", "chosen": " b."}, "field 'rejected' is missing"),
    ({"prompt": "Q: a?\nA:", "chosen": " b.", "rejected": 3}, "field 'rejected' is int"),
    ({"prompt": "Q: a?\nA:", "chosen": " same", "rejected": " same"}, "identical"),
    ({"prompt": "Q: " + "long " * 60, "chosen": " b.", "rejected": " c."}, "no room for a response"),
])
def test_bad_records_are_named_errors_with_file_and_line(tmp_path, tokenizer, bad, expected):
    source = write_jsonl(tmp_path / "p.jsonl", [GOOD, GOOD, bad, GOOD])
    message = error(build_datasets, cfg(source, truncate=True), tokenizer, 0)
    assert f"{source} line 3" in message and expected in message


def test_a_source_without_rejected_responses_names_the_fields_expected(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Q", "chosen": "A"}])
    message = error(build_datasets, cfg(source), tokenizer, 0)
    assert "'rejected'" in message and "data.rejected_field" in message and "line 1" in message


def test_a_pair_longer_than_seq_len_without_truncate_is_an_error(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "p.jsonl", [GOOD, {**GOOD, "chosen": " yes" * 60}])
    message = error(build_datasets, cfg(source), tokenizer, 0)
    assert f"{source} line 2" in message and "data.truncate" in message


def test_chat_pairs_with_a_bad_response_name_the_line(tmp_path):
    tokenizer = apply_chat_template(load_tokenizer(ModelConfig(tokenizer=str(TOKENIZER_DIR))),
                                    DataConfig(chat_template="chatml"))
    messages = [{"role": "user", "content": "Hi"}]
    source = write_jsonl(tmp_path / "c.jsonl", [{"messages": messages, "chosen": "a", "rejected": "b"},
                                                 {"messages": messages, "chosen": "a", "rejected": [{"x": 1}]}])
    message = error(build_datasets, cfg(source, seq_len=96), tokenizer, 0)
    assert f"{source} line 2" in message and "'rejected'" in message


# ------------------------------------------------------------------------------------------- prepared shards

def test_prepared_pairs_are_checked_against_the_run_like_sft(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "p.jsonl", [{**GOOD, "chosen": f" b{i}."} for i in range(8)])
    out = tmp_path / "prepared"
    manifest = prepare(cfg(source), source, tokenizer, out, records_per_shard=3)
    assert [e["documents"] for e in manifest["splits"]["train"]["shards"]] == [6, 6, 4]  # two per pair
    data = build_datasets(cfg(str(out)), tokenizer, 0)
    assert data.stats["train"]["pairs"] == 8
    assert "prepared for task 'preference'" in error(build_datasets, cfg(str(out), task="sft"), tokenizer, 0)
    assert "seq_len 48" in error(build_datasets, cfg(str(out), seq_len=64), tokenizer, 0)
    marker = out / "train" / "00000.json"
    entry = json.loads(marker.read_text())
    manifest_path = out / "manifest.json"
    changed = json.loads(manifest_path.read_text())
    changed["splits"]["train"]["shards"][0]["records"] = 2  # a pair split across shards
    manifest_path.write_text(json.dumps(changed))
    assert "each record is two" in error(build_datasets, cfg(str(out)), tokenizer, 0)
    assert entry["records"] == 3


def test_precomputed_reference_log_probs_travel_with_their_pairs_through_a_mixture(tmp_path, tokenizer):
    from trainer.data import Source, Stream
    samples = []
    for name in ("a", "b"):
        source = write_jsonl(tmp_path / f"{name}.jsonl", [{**GOOD, "chosen": f" {name}{i}."} for i in range(6)])
        found = build_datasets(cfg(source), tokenizer, 0).train.sources[0].samples
        found.reference = np.arange(12, dtype=np.float64).reshape(6, 2) + (0.5 if name == "b" else 0.0)
        samples.append(found)
    stream = Stream([Source("a", samples[0]), Source("b", samples[1])], seed=3)
    rows = stream.rows(np.arange(12))
    which, within = stream.sample_ids(np.arange(12))
    assert rows["reference_logps"].dtype == np.float64 and set(which.tolist()) == {0, 1}
    for row, (d, i) in enumerate(zip(which.tolist(), within.tolist())):
        assert rows["reference_logps"][row].tolist() == samples[d].reference[i].tolist()
        assert rows["input_ids"][row].tolist() == samples[d].rows(np.array([i]))["input_ids"][0].tolist()
