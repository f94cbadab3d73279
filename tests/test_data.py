"""Tests of the data pipeline (trainer/data/) and the shipped tiny dataset (data/tiny/).

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
    IGNORE_INDEX, DataError, MicroBatchLoader, Source, Stream, apply_chat_template, build_datasets, chat_sample,
    load_records, load_tokenizer, record_format,
)

TINY = ROOT / "data" / "tiny"
TOKENIZER_DIR = TINY / "tokenizer"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig(tokenizer=str(TOKENIZER_DIR)))


def write_jsonl(path: Path, records: list) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


@pytest.fixture(autouse=True)
def prepared_cache(tmp_path, monkeypatch):
    """Sources are prepared into this test's own cache (data.cache_dir unset falls back to XDG_CACHE_HOME)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def data_cfg(source: str, **overrides) -> DataConfig:
    # eval_source = source by default, so small test files are not split and every record is in train.
    settings = dict(source=source, eval_source=source, seq_len=64, task="sft", packing=False)
    return DataConfig(**{**settings, **overrides})


def rows(stream: Stream) -> list[dict]:
    """Every sample of a one-source stream, in the source's own order, as lists."""
    samples = stream.sources[0].samples
    batch = samples.rows(np.arange(len(samples)))
    return [{key: batch[key][i].tolist() for key in batch} for i in range(len(samples))]


def real_tokens(row: dict) -> list[int]:
    return [t for t, m in zip(row["input_ids"], real_mask(row)) if m]


def real_mask(row: dict) -> list[int]:
    """1 for a document's token, 0 for padding: the attention mask, or for isolated documents (position ids that
    restart, no mask) everything before the padding segment (the last one, all one token with no label)."""
    if "attention_mask" in row:
        return row["attention_mask"]
    if "position_ids" not in row:
        return [1] * len(row["input_ids"])
    starts = [i for i, p in enumerate(row["position_ids"]) if p == 0]
    tail = starts[-1]
    padding = len(starts) > 1 and len(set(row["input_ids"][tail:])) == 1 and set(row["labels"][tail:]) == {IGNORE_INDEX}
    return [1] * tail + [0] * (len(row["input_ids"]) - tail) if padding else [1] * len(row["input_ids"])


def document_starts(row: dict) -> list[int]:
    return [i for i, p in enumerate(row["position_ids"]) if p == 0]


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
    assert len(data.train) > 1000 and len(data.eval[0]) > 50
    first = rows(data.train)[0]
    assert set(first) == {"input_ids", "labels"} and first["labels"] == first["input_ids"]  # no copy, no mask
    assert len(first["input_ids"]) == 128


# ------------------------------------------------------------------------------------ SFT masking

def test_sft_prompt_tokens_are_masked_and_response_tokens_labelled(tmp_path, tokenizer):
    record = {"prompt": "Q: What is 3 plus 4?\nA:", "response": " 7."}
    source = write_jsonl(tmp_path / "sft.jsonl", [record])
    row = rows(build_datasets(data_cfg(source), tokenizer, seed=0).train)[0]
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
    row = rows(build_datasets(data_cfg(source, seq_len=128), tokenizer, seed=0).train)[0]
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
    row = rows(build_datasets(data_cfg(source, seq_len=160), tokenizer, seed=0).train)[0]
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
    unpacked_rows, packed_rows = rows(unpacked.train), rows(packed.train)
    stream = [t for row in unpacked_rows for t in real_tokens(row)]
    assert [t for row in packed_rows for t in real_tokens(row)] == stream
    # a packed document's first label is IGNORE_INDEX (no token of its own precedes it); alone, nothing used it
    labels = [IGNORE_INDEX if i == 0 else lab for row in unpacked_rows
              for i, (lab, m) in enumerate(zip(row["labels"], row["attention_mask"])) if m]
    assert [lab for row in packed_rows for lab, m in zip(row["labels"], real_mask(row)) if m] == labels
    for row in packed_rows:  # whole samples only: each block starts with BOS and ends with EOS
        tokens = real_tokens(row)
        assert tokens[0] == tokenizer.bos_token_id and tokens[-1] == tokenizer.eos_token_id
        assert "attention_mask" not in row  # transformers separates the documents by their position ids
        assert all(row["input_ids"][start] == tokenizer.bos_token_id for start in document_starts(row)[:-1])
    stats = packed.stats["train"]
    assert stats["tokens"] == len(stream) and stats["sequences"] == len(packed.train)
    assert stats["packing_efficiency"] == pytest.approx(len(stream) / (len(packed.train) * 96))
    assert stats["padded_tokens"] == len(packed.train) * 96 - len(stream)


def test_pretrain_samples_are_full_windows_of_the_document_stream(tmp_path, tokenizer):
    """Every train document + EOS, back to back, cut into seq_len windows: the same tokens a plain tokenizer
    loop gives, and the tail shorter than a window is not used."""
    texts = [f"The capital of France is Paris. {i} plus {i} is {2 * i}." * (1 + i % 3) for i in range(40)]
    source = write_jsonl(tmp_path / "pretrain.jsonl", [{"text": t} for t in texts])
    built = build_datasets(data_cfg(source, task="pretrain", seq_len=32), tokenizer, seed=0)
    stream = [t for text in texts for t in tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]]
    n_blocks = len(stream) // 32
    samples = rows(built.train)
    assert len(samples) == n_blocks
    assert [t for row in samples for t in row["input_ids"]] == stream[:n_blocks * 32]
    stats = built.stats["train"]
    assert stats["sequences"] == n_blocks and stats["records"] == 40 and stats["documents"] == 40
    assert stats["dropped_tokens"] == len(stream) % 32 and stats["tokens"] == n_blocks * 32


def test_truncate_cuts_long_records_and_counts_them(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "Q: hi\nA:", "response": " one two three " * 20}])
    data = build_datasets(data_cfg(source, seq_len=16, truncate=True), tokenizer, seed=0)
    assert data.stats["train"]["truncated_records"] == 1
    assert sum(rows(data.train)[0]["attention_mask"]) == 16


def test_num_workers_tokenize_the_same(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": f"Q: {i}?\nA:", "response": f" {i}."} for i in range(30)])
    one = build_datasets(data_cfg(source, packing=True), tokenizer, seed=0)
    two = build_datasets(data_cfg(source, packing=True, num_workers=2), tokenizer, seed=0)
    assert rows(one.train) == rows(two.train)


# ------------------------------------------------------------------------------------- eval split

def test_eval_split_holds_out_whole_documents_by_split_seed(tmp_path, tokenizer):
    records = [{"prompt": f"Q: {i}?\nA:", "response": f" {i}."} for i in range(100)]
    source = write_jsonl(tmp_path / "sft.jsonl", records)

    def eval_prompts(split_seed):
        cfg = data_cfg(source, eval_source=None, eval_fraction=0.1, split_seed=split_seed)
        data = build_datasets(cfg, tokenizer, seed=0)
        decode = lambda stream: {tokenizer.decode(real_tokens(r)) for r in rows(stream)}  # noqa: E731
        return decode(data.eval[0]), decode(data.train)

    eval_a, train_a = eval_prompts(0)
    assert len(eval_a) == 10 and len(train_a) == 90 and not eval_a & train_a
    assert eval_prompts(0)[0] == eval_a and eval_prompts(1)[0] != eval_a


# ---------------------------------------------------------------------------------------- loader

class Numbered:
    """Samples whose row i is [i] * 4, so a batch's first column tells which samples it holds."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def rows(self, ids: np.ndarray) -> dict:
        block = np.repeat(np.asarray(ids, dtype=np.int64)[:, None], 4, axis=1)
        return {"input_ids": block, "labels": block}


def stream(n: int, seed: int = 0, shuffle: bool = True) -> Stream:
    return Stream([Source("numbered", Numbered(n))], seed, shuffle)


def row_ids(batch) -> list[int]:
    return batch["input_ids"][:, 0].tolist()


def take(loader, k: int) -> list[list[int]]:
    iterator = iter(loader)
    return [row_ids(next(iterator)) for _ in range(k)]


def steps(n: int, micro: int, dp: int, accum: int, k: int, seed: int = 5, state=None) -> list[list[int]]:
    """The samples of each of k optimizer steps, gathered over every rank and micro-step, in order."""
    loaders = [MicroBatchLoader(stream(n, seed), micro, rank, dp, accum) for rank in range(dp)]
    for loader in loaders:
        if state:
            loader.load_state_dict(state)
    iterators = [iter(loader) for loader in loaders]
    out = []
    for _ in range(k):
        step = []
        for _ in range(accum):
            for iterator in iterators:
                step += row_ids(next(iterator))
        out.append(sorted(step))
    return out


def test_loader_yields_long_tensors_of_the_right_shape():
    batch = next(iter(MicroBatchLoader(stream(10), 3, 0, 1)))
    assert set(batch) == {"input_ids", "labels"}
    assert all(t.shape == (3, 4) and str(t.dtype) == "torch.int64" for t in batch.values())


def test_ranks_are_disjoint_and_every_epoch_visits_every_sample_once():
    taken = steps(24, micro=3, dp=2, accum=2, k=6)  # 12 samples a step: two epochs
    assert all(len(set(step)) == 12 for step in taken)
    first, second = sum(taken[:2], []), sum(taken[2:4], [])
    assert sorted(first) == sorted(second) == list(range(24))


def test_an_epoch_of_any_length_uses_every_sample_no_tail_dropped():
    taken = sum(take(MicroBatchLoader(stream(21, seed=5), 1, 0, 1), 84), [])  # in global order: 4 epochs
    for epoch in range(4):
        assert sorted(taken[epoch * 21:(epoch + 1) * 21]) == list(range(21)), epoch


def test_the_samples_of_a_step_do_not_depend_on_the_rank_layout():
    """4 ranks x micro 2, 2 ranks x micro 2 x accumulation 2 and 1 rank x micro 4 x accumulation 2 consume the
    same samples in every step of the same global batch of 8: a checkpoint resumes on any layout."""
    reference = steps(50, micro=2, dp=4, accum=1, k=9)
    assert steps(50, micro=2, dp=2, accum=2, k=9) == reference
    assert steps(50, micro=4, dp=1, accum=2, k=9) == reference


def test_resume_on_another_layout_continues_at_the_next_sample():
    straight = steps(30, micro=2, dp=2, accum=1, k=10)
    loader = MicroBatchLoader(stream(30, seed=5), 2, 0, 2, 1)
    iterator = iter(loader)
    for _ in range(4):  # 4 steps on 2 ranks
        next(iterator)
    state = json.loads(json.dumps(loader.state_dict()))
    assert state == {"samples": 16}
    assert steps(30, micro=1, dp=1, accum=4, k=6, state=state) == straight[4:]


def test_same_seed_same_order_and_different_seed_different_order():
    first = take(MicroBatchLoader(stream(40, seed=1), 4, 0, 1), 10)
    assert take(MicroBatchLoader(stream(40, seed=1), 4, 0, 1), 10) == first
    assert take(MicroBatchLoader(stream(40, seed=2), 4, 0, 1), 10) != first
    assert sorted(sum(first, [])) == list(range(40))
    second_epoch = take(MicroBatchLoader(stream(40, seed=1), 4, 0, 1), 20)[10:]
    assert second_epoch != first and sorted(sum(second_epoch, [])) == list(range(40))


def test_unshuffled_loader_keeps_dataset_order():
    assert take(MicroBatchLoader(stream(8, shuffle=False), 2, 1, 2), 2) == [[2, 3], [6, 7]]


def test_loader_refuses_a_position_from_the_old_epoch_loader():
    loader = MicroBatchLoader(stream(8), 2, 0, 1)
    with pytest.raises(DataError, match="pre-shard loader"):
        loader.load_state_dict({"epoch": 0, "batches_in_epoch": 3})
    with pytest.raises(DataError, match="no sample"):
        MicroBatchLoader(stream(0), 2, 0, 1)


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
    assert "set data.chat_template: chatml (or llama-2, llama-3, zephyr, or a .jinja file)" in message


def test_error_chat_record_without_assistant_names_the_line(tmp_path, tokenizer):
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    bad = {"messages": [{"role": "user", "content": "hi"}]}
    source = write_jsonl(tmp_path / "chat.jsonl", [good, bad])
    assert f"{source} line 2" in error_message(build_datasets, data_cfg(source), tokenizer, 0)


def test_error_tokenizer_not_configured_or_missing(tmp_path):
    assert "model.tokenizer" in error_message(load_tokenizer, ModelConfig())
    missing = str(tmp_path / "no_tokenizer")
    assert missing in error_message(load_tokenizer, ModelConfig(tokenizer=missing))


def test_jsonl_reads_the_same_through_arrow_and_line_by_line(tmp_path):
    """Well-formed JSON lines go through Arrow's fast reader; a file with blank lines through the line reader.
    Both give the same records, each with its true line number, and text that looks like a date stays text."""
    records = [{"text": "2020-01-01"}, {"text": "plain", "n": 3}, {"text": "12:00:00"}]
    fast = write_jsonl(tmp_path / "fast.jsonl", records)
    slow = tmp_path / "slow.jsonl"
    slow.write_text("\n".join(json.dumps(r) for r in records[:1]) + "\n\n" +
                    "\n".join(json.dumps(r) for r in records[1:]) + "\n")
    a, b = load_records(fast), load_records(str(slow))
    assert a["text"] == b["text"] == ["2020-01-01", "plain", "12:00:00"] and a["n"] == b["n"] == [None, 3, None]
    assert a["_origin"] == [f"{fast} line {i}" for i in (1, 2, 3)]
    assert b["_origin"] == [f"{slow} line {i}" for i in (1, 3, 4)]
