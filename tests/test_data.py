"""Tests of the data pipeline (trainer/data.py) and the shipped tiny dataset (data/tiny/).

Fast and local: no DeepSpeed, no distributed, no network. Bad inputs are written under tmp_path.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parent.parent

from trainer.config import DataConfig, ModelConfig
from trainer.data import (
    IGNORE_INDEX, DataError, MicroBatchLoader, blocks_dataset, build_datasets, chat_sample, load_records,
    apply_chat_template, load_tokenizer, pack_pretrain, record_format, tokenize_records,
)

TINY = ROOT / "data" / "tiny"
TOKENIZER_DIR = TINY / "tokenizer"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig(tokenizer=str(TOKENIZER_DIR)))


def write_jsonl(path: Path, records: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


def data_cfg(source: str, **overrides) -> DataConfig:
    # eval_source = source by default, so small test files are not split and every record is in train.
    settings = dict(source=source, eval_source=source, seq_len=64, task="sft", packing=False)
    return DataConfig(**{**settings, **overrides})


def real_tokens(row: dict) -> list[int]:
    return [t for t, m in zip(row["input_ids"], row["attention_mask"]) if m]


def label_runs(labels: list[int]) -> list[list[int]]:
    """Maximal runs of trainable (not IGNORE_INDEX) labels."""
    runs, current = [], []
    for label in labels + [IGNORE_INDEX]:
        if label != IGNORE_INDEX:
            current.append(label)
        elif current:
            runs.append(current)
            current = []
    return runs


def error_message(call, *args, **kwargs) -> str:
    with pytest.raises(DataError) as info:
        call(*args, **kwargs)
    return str(info.value)


# -------------------------------------------------------------------------------- shipped tiny data

def test_tiny_tokenizer_loads_and_round_trips(tokenizer):
    assert len(tokenizer) <= 1024
    special = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}
    assert None not in special and len(special) == 3
    for line in (TINY / "pretrain.jsonl").read_text().splitlines()[:50]:
        text = json.loads(line)["text"]
        ids = tokenizer(text)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_load_tokenizer_falls_back_to_eos_for_padding(tmp_path):
    config = json.loads((TOKENIZER_DIR / "tokenizer_config.json").read_text())
    del config["pad_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_bytes((TOKENIZER_DIR / "tokenizer.json").read_bytes())
    loaded = load_tokenizer(ModelConfig(name_or_path=str(tmp_path)))
    assert loaded.pad_token == loaded.eos_token == "</s>"


def test_tiny_tokenizer_has_working_chat_template(tokenizer):
    messages = [{"role": "user", "content": "What is 3 plus 4?"}, {"role": "assistant", "content": "7."}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "<s>user\nWhat is 3 plus 4?</s>assistant\n7.</s>"
    prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert text.startswith(prompt) and prompt.endswith("assistant\n")


@pytest.mark.parametrize("name, minimum, fmt", [
    ("pretrain.jsonl", 3000, "text"), ("sft.jsonl", 2000, "pair"), ("chat.jsonl", 300, "chat")])
def test_tiny_files_load(tokenizer, name, minimum, fmt):
    records = load_records(str(TINY / name))
    assert len(records) >= minimum
    task = "pretrain" if fmt == "text" else "sft"
    assert record_format(records, DataConfig(task=task), tokenizer, name) == fmt


def test_tiny_data_is_small():
    assert sum(f.stat().st_size for f in TINY.rglob("*") if f.is_file()) < 2_000_000


def test_tiny_data_regeneration_is_byte_identical(tmp_path):
    spec = importlib.util.spec_from_file_location("make_tiny_data", ROOT / "scripts" / "make_tiny_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.generate(tmp_path)
    shipped = sorted(p.relative_to(TINY) for p in TINY.rglob("*") if p.is_file())
    assert shipped == sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    for relative in shipped:
        assert (tmp_path / relative).read_bytes() == (TINY / relative).read_bytes(), relative


def test_tiny_pretrain_builds_with_a_held_out_eval(tokenizer):
    cfg = DataConfig(task="pretrain", source=str(TINY / "pretrain.jsonl"), seq_len=128, eval_fraction=0.05)
    data = build_datasets(cfg, tokenizer, seed=0)
    assert data.stats["eval"]["records"] == 200 and data.stats["train"]["records"] == 3800
    assert len(data.train) > 1000 and len(data.eval) > 50
    assert data.train.column_names == ["input_ids", "labels", "attention_mask"]


# ------------------------------------------------------------------------------------ SFT masking

def test_sft_prompt_tokens_are_masked_and_response_tokens_labelled(tmp_path, tokenizer):
    record = {"prompt": "Q: What is 3 plus 4?\nA:", "response": " 7."}
    source = write_jsonl(tmp_path / "sft.jsonl", [record])
    row = build_datasets(data_cfg(source), tokenizer, seed=0).train[0]
    prompt = tokenizer(record["prompt"])["input_ids"]
    response = tokenizer(record["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    n = len(prompt) + len(response)
    assert row["input_ids"][:n] == prompt + response
    assert row["labels"][:n] == [IGNORE_INDEX] * len(prompt) + response
    # Padding: pad id, no loss, no attention.
    assert row["input_ids"][n:] == [tokenizer.pad_token_id] * (64 - n)
    assert row["labels"][n:] == [IGNORE_INDEX] * (64 - n)
    assert row["attention_mask"] == [1] * n + [0] * (64 - n)


def test_chat_labels_cover_only_assistant_content(tmp_path, tokenizer):
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 3 plus 4?"}, {"role": "assistant", "content": "7."},
        {"role": "user", "content": "What does the cow say?"}, {"role": "assistant", "content": "The cow says moo."},
    ]
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    row = build_datasets(data_cfg(source, seq_len=128), tokenizer, seed=0).train[0]
    rendered = tokenizer(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    assert real_tokens(row) == rendered["input_ids"]
    runs = [tokenizer.decode(run) for run in label_runs(row["labels"])]
    assert runs == ["7.</s>", "The cow says moo.</s>"]


def test_chat_sample_masks_boundary_straddling_tokens_as_assistant(tokenizer):
    # "user: hi" then assistant content starting with a space: the first content token is " 7".
    ids, labels = chat_sample(tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " 7"}])
    assert tokenizer.decode([t for t in labels if t != IGNORE_INDEX]) == " 7</s>"


# --------------------------------------------------------------------------------- chat templates

CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 3 plus 4?"}, {"role": "assistant", "content": "7."},
    {"role": "user", "content": "What does the cow say?"}, {"role": "assistant", "content": "The cow says moo."},
]
# CONVERSATION as the public templates render it (OpenHermes/Qwen ChatML, Llama-2-chat, zephyr-7b-beta),
# and what the model learns: each assistant message and its end of turn.
PUBLIC_FORMATS = {
    "chatml": ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nWhat is 3 plus 4?"
               "<|im_end|>\n<|im_start|>assistant\n7.<|im_end|>\n<|im_start|>user\nWhat does the cow say?<|im_end|>\n"
               "<|im_start|>assistant\nThe cow says moo.<|im_end|>\n",
               ["7.<|im_end|>\n", "The cow says moo.<|im_end|>\n"]),
    "llama-2": ("<s>[INST] <<SYS>>\nYou are a helpful assistant.\n<</SYS>>\n\nWhat is 3 plus 4? [/INST] 7. </s>"
                "<s>[INST] What does the cow say? [/INST] The cow says moo. </s>",
                [" 7. </s>", " The cow says moo. </s>"]),
    "zephyr": ("<|system|>\nYou are a helpful assistant.</s>\n<|user|>\nWhat is 3 plus 4?</s>\n<|assistant|>\n7.</s>\n"
               "<|user|>\nWhat does the cow say?</s>\n<|assistant|>\nThe cow says moo.</s>\n",
               ["7.</s>\n", "The cow says moo.</s>\n"]),
}


def templated_tokenizer(chat_template: str):
    """A fresh tiny tokenizer (applying a template changes the object) with data.chat_template applied."""
    return apply_chat_template(load_tokenizer(ModelConfig(tokenizer=str(TOKENIZER_DIR))),
                               DataConfig(chat_template=chat_template))


@pytest.mark.parametrize("name", sorted(PUBLIC_FORMATS))
def test_named_chat_template_renders_the_public_format_and_labels_only_assistant_turns(tmp_path, name):
    rendering, learnt = PUBLIC_FORMATS[name]
    tokenizer = templated_tokenizer(name)
    assert tokenizer.apply_chat_template(CONVERSATION, tokenize=False) == rendering
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}])
    row = build_datasets(data_cfg(source, seq_len=160), tokenizer, seed=0).train[0]
    assert real_tokens(row) == tokenizer(rendering, add_special_tokens=False)["input_ids"]
    assert [tokenizer.decode(run) for run in label_runs(row["labels"])] == learnt


def test_chat_template_from_a_jinja_file(tmp_path):
    path = tmp_path / "plain.jinja"
    path.write_text("{% for m in messages %}{{ m['role'] }}:\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
                    "{% if add_generation_prompt %}assistant:\n{% endif %}")
    tokenizer = templated_tokenizer(str(path))
    ids, labels = chat_sample(tokenizer, CONVERSATION[1:3])
    assert tokenizer.decode(ids) == "user:\nWhat is 3 plus 4?</s>\nassistant:\n7.</s>\n"
    assert tokenizer.decode([t for t in labels if t != IGNORE_INDEX]) == "7.</s>\n"
    # relative paths are read from the repo root, wherever the run starts
    relative = templated_tokenizer("trainer/data/templates/zephyr.jinja")
    assert relative.chat_template == templated_tokenizer("zephyr").chat_template


def test_chat_template_replaces_the_tokenizers_own_and_none_keeps_it():
    shipped = load_tokenizer(ModelConfig(tokenizer=str(TOKENIZER_DIR))).chat_template
    assert apply_chat_template(load_tokenizer(ModelConfig(tokenizer=str(TOKENIZER_DIR))),
                               DataConfig()).chat_template == shipped
    assert templated_tokenizer("chatml").chat_template != shipped


def test_the_exported_tokenizer_carries_the_chat_template(tmp_path):
    """export_hf saves the run's tokenizer object with save_pretrained: inference loads the same template."""
    from transformers import AutoTokenizer

    tokenizer = templated_tokenizer("llama-2")
    tokenizer.save_pretrained(str(tmp_path / "hf"))
    reloaded = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert reloaded.chat_template == tokenizer.chat_template
    prompt = CONVERSATION[:2]
    assert reloaded.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) == \
        tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("value", ["llama2", "templates/missing.jinja"])
def test_error_unknown_chat_template_names_the_key_the_names_and_the_fix(value):
    message = error_message(templated_tokenizer, value)
    assert "data.chat_template" in message and repr(value) in message
    assert all(name in message for name in ("chatml", "llama-2", "zephyr")) and "Jinja file" in message


# ---------------------------------------------------------------------------------------- packing

def test_sft_packing_keeps_every_real_token_exactly_once(tokenizer):
    source = str(TINY / "sft.jsonl")
    unpacked = build_datasets(data_cfg(source, seq_len=96), tokenizer, seed=3)
    packed = build_datasets(data_cfg(source, seq_len=96, packing=True), tokenizer, seed=3)
    assert len(packed.train) < len(unpacked.train) / 3
    # Greedy packing keeps sample order, so the streams of real tokens (and labels) are identical.
    stream = [t for row in unpacked.train for t in real_tokens(row)]
    assert [t for row in packed.train for t in real_tokens(row)] == stream
    labels = [lab for row in unpacked.train for lab, m in zip(row["labels"], row["attention_mask"]) if m]
    assert [lab for row in packed.train for lab, m in zip(row["labels"], row["attention_mask"]) if m] == labels
    for row in packed.train:  # whole samples only: each block starts with BOS and ends with EOS
        tokens = real_tokens(row)
        assert tokens[0] == tokenizer.bos_token_id and tokens[-1] == tokenizer.eos_token_id
        assert row["attention_mask"] == sorted(row["attention_mask"], reverse=True)
    stats = packed.stats["train"]
    assert stats["tokens"] == len(stream) and stats["sequences"] == len(packed.train)
    assert stats["packing_efficiency"] == pytest.approx(len(stream) / (len(packed.train) * 96))
    assert stats["padded_tokens"] == len(packed.train) * 96 - len(stream)


def test_pretrain_packing_gives_full_blocks_and_exact_stats(tmp_path, tokenizer):
    texts = [f"The capital of France is Paris. {i} plus {i} is {2 * i}." * (1 + i % 3) for i in range(40)]
    source = write_jsonl(tmp_path / "pretrain.jsonl", [{"text": t} for t in texts])
    cfg = data_cfg(source, task="pretrain", seq_len=32)
    samples = tokenize_records(load_records(source), "text", cfg, tokenizer)
    blocks, stats = pack_pretrain(samples, 32)
    stream = [t for text in texts for t in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
    n_blocks = len(stream) // 32
    assert len(blocks) == n_blocks
    assert [t for row in blocks for t in row["input_ids"]] == stream[:n_blocks * 32]
    assert all(row["labels"] == row["input_ids"] and row["attention_mask"] == [1] * 32 for row in blocks)
    assert stats["dropped_tokens"] == len(stream) % 32 and stats["tokens"] == n_blocks * 32
    assert stats["packing_efficiency"] == 1.0 and stats["padded_tokens"] == 0
    built = build_datasets(cfg, tokenizer, seed=0)  # same numbers through the whole pipeline
    assert built.stats["train"]["sequences"] == n_blocks and built.stats["train"]["records"] == 40


def test_truncate_cuts_long_records_and_counts_them(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "Q: hi\nA:", "response": " one two three " * 20}])
    data = build_datasets(data_cfg(source, seq_len=16, truncate=True), tokenizer, seed=0)
    assert data.stats["train"]["truncated_records"] == 1
    assert len(data.train[0]["input_ids"]) == 16


def test_num_workers_tokenize_the_same(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": f"Q: {i}?\nA:", "response": f" {i}."} for i in range(30)])
    one = build_datasets(data_cfg(source, packing=True), tokenizer, seed=0)
    two = build_datasets(data_cfg(source, packing=True, num_workers=2), tokenizer, seed=0)
    assert one.train.to_dict() == two.train.to_dict()


# ------------------------------------------------------------------------------------- eval split

def test_eval_split_is_seeded_and_disjoint(tmp_path, tokenizer):
    records = [{"prompt": f"Q: {i}?\nA:", "response": f" {i}."} for i in range(100)]
    source = write_jsonl(tmp_path / "sft.jsonl", records)

    def eval_prompts(seed):
        cfg = data_cfg(source, eval_source=None, eval_fraction=0.1)
        data = build_datasets(cfg, tokenizer, seed=seed)
        decode = lambda rows: {tokenizer.decode(real_tokens(r)) for r in rows}  # noqa: E731
        return decode(data.eval), decode(data.train)

    eval_a, train_a = eval_prompts(0)
    assert len(eval_a) == 10 and len(train_a) == 90 and not eval_a & train_a
    assert eval_prompts(0)[0] == eval_a and eval_prompts(1)[0] != eval_a


# ---------------------------------------------------------------------------------------- loader

def numbered_dataset(n: int, seq_len: int = 4):
    """Row i is [i] * seq_len, so a batch's first column tells which rows it holds."""
    rows = np.repeat(np.arange(n)[:, None], seq_len, axis=1)
    return blocks_dataset(rows, rows, np.ones_like(rows))


def row_ids(batch) -> list[int]:
    return batch["input_ids"][:, 0].tolist()


def take(loader, k: int) -> list[list[int]]:
    iterator = iter(loader)
    return [row_ids(next(iterator)) for _ in range(k)]


def test_loader_yields_long_tensors_of_the_right_shape():
    batch = next(iter(MicroBatchLoader(numbered_dataset(10), 3, 0, 1, seed=0)))
    assert set(batch) == {"input_ids", "labels", "attention_mask"}
    assert all(t.shape == (3, 4) and str(t.dtype) == "torch.int64" for t in batch.values())


def test_two_rank_shards_are_disjoint_and_cover_the_epoch():
    dataset = numbered_dataset(21)
    loaders = [MicroBatchLoader(dataset, 3, rank, 2, seed=5) for rank in range(2)]
    assert [loader.batches_per_epoch() for loader in loaders] == [3, 3]  # 7 batches: the 7th is dropped
    shards = [sum(take(loader, 3), []) for loader in loaders]
    assert not set(shards[0]) & set(shards[1])
    order = np.random.default_rng([5, 0]).permutation(21)
    assert sorted(shards[0] + shards[1]) == sorted(order[:18].tolist())


def test_same_seed_same_order_and_different_seed_different_order():
    dataset = numbered_dataset(40)
    first = take(MicroBatchLoader(dataset, 4, 0, 1, seed=1), 10)
    assert take(MicroBatchLoader(dataset, 4, 0, 1, seed=1), 10) == first
    assert take(MicroBatchLoader(dataset, 4, 0, 1, seed=2), 10) != first
    assert sorted(sum(first, [])) == list(range(40))
    second_epoch = take(MicroBatchLoader(dataset, 4, 0, 1, seed=1), 20)[10:]
    assert second_epoch != first and sorted(sum(second_epoch, [])) == list(range(40))


def test_unshuffled_loader_keeps_dataset_order():
    assert take(MicroBatchLoader(numbered_dataset(8), 2, 1, 2, seed=0, shuffle=False), 2) == [[2, 3], [6, 7]]


@pytest.mark.parametrize("consumed", [0, 1, 3, 4, 5, 9])  # 4 batches per epoch: mid, end, across epochs
def test_resume_continues_exactly_where_the_saved_loader_would(consumed):
    dataset = numbered_dataset(17)
    original = MicroBatchLoader(dataset, 2, 1, 2, seed=7)
    assert original.batches_per_epoch() == 4
    iterator = iter(original)
    for _ in range(consumed):
        next(iterator)
    state = json.loads(json.dumps(original.state_dict()))
    assert state == {"epoch": consumed // 4, "batches_in_epoch": consumed % 4}
    expected = [row_ids(next(iterator)) for _ in range(6)]
    resumed = MicroBatchLoader(dataset, 2, 1, 2, seed=7)
    resumed.load_state_dict(state)
    assert take(resumed, 6) == expected


def test_loader_rejects_too_few_sequences_and_foreign_state():
    with pytest.raises(DataError, match="micro-batch"):
        MicroBatchLoader(numbered_dataset(5), 3, 0, 2, seed=0)
    loader = MicroBatchLoader(numbered_dataset(8), 2, 0, 1, seed=0)
    with pytest.raises(DataError, match="batches per epoch"):
        loader.load_state_dict({"epoch": 0, "batches_in_epoch": 9})


# ---------------------------------------------------------------------------------------- formats

def test_json_parquet_txt_and_directory_sources(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps([{"text": "one"}, {"text": "two"}]))
    pq.write_table(pa.table({"text": ["three"]}), tmp_path / "b.parquet")
    (tmp_path / "c.txt").write_text("four\n\nfive\n")
    write_jsonl(tmp_path / "d.jsonl", [{"text": "six"}])
    assert load_records(str(tmp_path / "c.txt"))["_origin"] == [f"{tmp_path / 'c.txt'} line 1",
                                                                 f"{tmp_path / 'c.txt'} line 3"]
    assert load_records(str(tmp_path))["text"] == ["one", "two", "three", "four", "five", "six"]


# ------------------------------------------------------------------------------------ data errors

def test_data_error_is_a_value_error_and_a_user_error():
    from trainer.errors import UserError

    assert issubclass(DataError, ValueError) and issubclass(DataError, UserError)


def test_error_missing_path(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    assert missing in error_message(load_records, missing)


def test_error_malformed_jsonl_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "ok"}\n\n{"text": "broken\n{"text": "ok"}\n')
    message = error_message(load_records, str(path))
    assert f"{path} line 3" in message and "invalid JSON" in message


def test_error_non_object_jsonl_line(tmp_path):
    path = tmp_path / "list.jsonl"
    path.write_text('{"text": "ok"}\n["not", "an", "object"]\n')
    assert f"{path} line 2" in error_message(load_records, str(path))


@pytest.mark.parametrize("task, record, expected", [
    ("pretrain", {"content": "x"}, "'text'"),
    ("sft", {"prompt": "x", "answer": "y"}, "'response'"),
])
def test_error_missing_columns_names_found_and_expected(tmp_path, tokenizer, task, record, expected):
    source = write_jsonl(tmp_path / "records.jsonl", [record])
    message = error_message(build_datasets, data_cfg(source, task=task), tokenizer, 0)
    assert f"{source} line 1" in message and expected in message
    assert str(sorted(record)) in message or str(list(record)) in message


def test_error_wrong_field_type_names_the_line(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "records.jsonl", [{"text": "fine"}, {"text": None}])
    message = error_message(build_datasets, data_cfg(source, task="pretrain"), tokenizer, 0)
    assert f"{source} line 2" in message and "'text'" in message


def test_error_mixed_field_types_names_the_line(tmp_path):
    source = write_jsonl(tmp_path / "mixed.jsonl", [{"text": "a"}, {"text": "b"}, {"text": 3}])
    assert f"{source} line 3" in error_message(load_records, source)


def test_error_missing_relative_path_is_not_sent_to_the_hub(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)
    assert "data/nothere" in error_message(load_records, "data/nothere")


def test_error_empty_file(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    assert str(path) in error_message(load_records, str(path))


def test_error_empty_after_eval_split(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "one.jsonl", [{"prompt": "Q: a?\nA:", "response": " b."}])
    message = error_message(build_datasets, data_cfg(source, eval_source=None, eval_fraction=0.1), tokenizer, 0)
    assert source in message and "eval" in message


def test_error_eval_split_too_short_for_one_block(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "short.jsonl", [{"text": f"Sentence number {i}."} for i in range(20)])
    cfg = data_cfg(source, task="pretrain", eval_source=None, eval_fraction=0.1, seq_len=32)
    message = error_message(build_datasets, cfg, tokenizer, 0)
    assert source in message and "line" in message and "eval" in message


def test_error_record_longer_than_seq_len(tmp_path, tokenizer):
    records = [{"prompt": "Q: a?\nA:", "response": " b."}, {"prompt": "Q: long?\nA:", "response": " yes" * 40}]
    source = write_jsonl(tmp_path / "sft.jsonl", records)
    message = error_message(build_datasets, data_cfg(source, seq_len=16), tokenizer, 0)
    prompt, response = tokenizer([records[1]["prompt"], records[1]["response"]], add_special_tokens=False)["input_ids"]
    length = 1 + len(prompt) + len(response) + 1  # BOS + prompt + response + EOS
    assert f"{source} line 2" in message and f"{length} tokens" in message and "seq_len 16" in message


def test_error_chat_records_without_chat_template(tmp_path):
    from transformers import AutoTokenizer

    plain = AutoTokenizer.from_pretrained(str(TOKENIZER_DIR))
    plain.chat_template = None
    source = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    message = error_message(build_datasets, data_cfg(source), plain, 0)
    assert f"{source} line 1" in message and "no chat_template" in message
    assert "set data.chat_template: chatml (or llama-2, zephyr, or a .jinja file)" in message


def test_error_chat_record_without_assistant_names_the_line(tmp_path, tokenizer):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    bad = {"messages": [{"role": "user", "content": "hi"}]}
    source = write_jsonl(tmp_path / "chat.jsonl", [good, bad])
    assert f"{source} line 2" in error_message(build_datasets, data_cfg(source), tokenizer, 0)


def test_error_tokenizer_not_configured_or_missing(tmp_path):
    assert "model.tokenizer" in error_message(load_tokenizer, ModelConfig())
    missing = str(tmp_path / "no_tokenizer")
    assert missing in error_message(load_tokenizer, ModelConfig(tokenizer=missing))
