"""Tokenization: the tokenizer, the record format (text, prompt/response, chat), and samples with labels.

  pretrain  each text + EOS; labels = input_ids.
  sft       prompt/response records (loss on response + EOS) or chat `messages` records rendered with the
            tokenizer's chat template, or data.chat_template's (loss on what each assistant message adds).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import clip
from ..config import DataConfig, ModelConfig
from ..lazy import lazy_module
from ..named_inputs import model_directory_problem
from ..presets import REPO_ROOT
from ..remote_code import load_kwargs, refused
from .chat_format import add_markers
from .records import IGNORE_INDEX, ORIGIN, DataError, looks_like_path, visible_columns

datasets = lazy_module("datasets")  # reading raw records only: a training from prepared shards never imports it


def load_tokenizer(model_cfg: ModelConfig):
    """AutoTokenizer from model.tokenizer (else model.name_or_path); pad falls back to EOS."""
    from transformers import AutoTokenizer  # imported here: transformers is slow to import

    path = model_cfg.tokenizer or model_cfg.name_or_path
    if not path:
        raise DataError("model.tokenizer and model.name_or_path are both unset; set model.tokenizer to a "
                        "tokenizer directory (e.g. data/tiny/tokenizer) or a hub id")
    problem = model_directory_problem("model.tokenizer" if model_cfg.tokenizer else "model.name_or_path", path)
    if problem or (not Path(path).expanduser().exists() and looks_like_path(path)):
        raise DataError(problem or f"tokenizer {path!r}: no such directory; fix model.tokenizer / model.name_or_path")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **load_kwargs(model_cfg.trust_remote_code, path, "tokenizer"))
    except Exception as e:  # noqa: BLE001 - a broken tokenizer.json fails in Rust with a bare Exception or KeyError
        code = refused(e, path, "set model.trust_remote_code=true in the preset (or --set model.trust_remote_code=true)")
        if code:
            raise DataError(str(code)) from None
        raise DataError(f"cannot load a tokenizer from {path!r} ({type(e).__name__}: {clip(str(e), 300)}); check "
                        f"model.tokenizer / model.name_or_path point at a complete tokenizer directory") from e
    if tokenizer.eos_token is None:
        raise DataError(f"tokenizer {path!r} has no eos_token; samples need one to end on")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# ------------------------------------------------------------------------------------ chat template

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
TEMPLATE_NAMES = ("chatml", "llama-2", "llama-3", "zephyr")  # TEMPLATE_DIR/<name>.jinja
TEMPLATE_CHOICES = "chatml (or llama-2, llama-3, zephyr, or a .jinja file)"


def apply_chat_template(tokenizer, data_cfg: DataConfig):
    """data.chat_template replaces the tokenizer's own template (None keeps it), and the markers it declares that the
    tokenizer lacks become special tokens (chat_format.add_markers). The run exports this same tokenizer object with
    the model (checkpoint.export_hf), so inference renders prompts, and stops, as training taught."""
    if data_cfg.chat_template is not None:
        tokenizer.chat_template = read_chat_template(data_cfg.chat_template)
        add_markers(tokenizer, tokenizer.chat_template)
    return tokenizer


def read_chat_template(value: str) -> str:
    """The Jinja text of a shipped template name, or of a file (absolute, or relative to the repo root)."""
    if value in TEMPLATE_NAMES:
        return (TEMPLATE_DIR / f"{value}.jinja").read_text(encoding="utf-8")
    path = Path(value).expanduser()
    path = path if path.is_absolute() else REPO_ROOT / path
    if not path.is_file():
        raise DataError(f"data.chat_template {value!r} is neither a shipped template ({', '.join(TEMPLATE_NAMES)}) "
                        f"nor a file (there is none at {path}); set data.chat_template to one of those names or to "
                        f"a Jinja file, absolute or relative to the repo root")
    return path.read_text(encoding="utf-8")


def has_chat_template_on_disk(path: str | None) -> bool:
    """Whether `path` is a local tokenizer directory with a chat template. A hub id is unknown until
    downloaded, and base checkpoints ship none (transformers 4.43 dropped the class-level defaults)."""
    directory = Path(path).expanduser() if path else None
    if directory is None or not directory.is_dir():
        return False
    if (directory / "chat_template.jinja").is_file() or (directory / "chat_template.json").is_file():
        return True
    config = directory / "tokenizer_config.json"
    try:
        return bool(config.is_file() and json.loads(config.read_text(encoding="utf-8")).get("chat_template"))
    except (OSError, ValueError):
        return False


# ------------------------------------------------------------------------------------------ tokenize


def record_format(records: datasets.Dataset, data_cfg: DataConfig, tokenizer, source: str) -> str:
    """'text' (pretrain), 'pair' (sft prompt/response), 'chat' (sft messages), 'preference' or 'preference_chat'."""
    return format_of(visible_columns(records), records[0][ORIGIN], data_cfg, tokenizer, source)


def format_of(columns: list[str], first: str, data_cfg: DataConfig, tokenizer, source: str) -> str:
    """The format of records with these fields (`first`: where the first record is, for the messages)."""
    if data_cfg.task == "pretrain":
        if data_cfg.text_field in columns:
            return "text"
        expected = f"'{data_cfg.text_field}' (data.text_field)"
    elif data_cfg.task == "preference":
        responses = data_cfg.chosen_field in columns and data_cfg.rejected_field in columns
        if responses and data_cfg.prompt_field in columns:
            return "preference"
        if responses and data_cfg.messages_field in columns:
            _check_chat_tokenizer(tokenizer, first, source)
            return "preference_chat"
        expected = (f"'{data_cfg.prompt_field}' (or chat '{data_cfg.messages_field}') + '{data_cfg.chosen_field}' + "
                    f"'{data_cfg.rejected_field}' (data.prompt_field or data.messages_field, data.chosen_field, "
                    f"data.rejected_field)")
    elif data_cfg.prompt_field in columns and data_cfg.response_field in columns:
        return "pair"
    elif data_cfg.messages_field in columns:
        _check_chat_tokenizer(tokenizer, first, source)
        return "chat"
    else:
        expected = (f"'{data_cfg.prompt_field}' + '{data_cfg.response_field}' (data.prompt_field + "
                    f"data.response_field) or '{data_cfg.messages_field}' (data.messages_field)")
    raise DataError(f"{source}: records (first at {first}) have columns {columns}, but task "
                    f"'{data_cfg.task}' expects {expected}; rename the fields in the data or set the "
                    f"data.*_field options to the names used")


def _check_chat_tokenizer(tokenizer, first: str, source: str) -> None:
    where = f"{source}: records (first at {first}) are chat messages"
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{where}, but the tokenizer has no chat_template (base checkpoints ship none); set "
                        f"data.chat_template: {TEMPLATE_CHOICES} to the format the model should learn, use a "
                        f"tokenizer with one (model.tokenizer), or convert the records to prompt/response fields")
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"{where}, which needs a fast tokenizer (offset mapping) to find assistant tokens")


def tokenize_pairs(batch: dict, tokenizer, cfg: DataConfig) -> dict:
    prompts, prompt_problems = _strings(batch[cfg.prompt_field], cfg.prompt_field)
    responses, response_problems = _strings(batch[cfg.response_field], cfg.response_field)
    prompt_ids = tokenizer(prompts, verbose=False)["input_ids"]
    response_ids = tokenizer(responses, add_special_tokens=False, verbose=False)["input_ids"]
    out = {"input_ids": [], "labels": [], "_cut": [], "_problem": []}
    problems = [a or b for a, b in zip(prompt_problems, response_problems)]
    for p, r, problem in zip(prompt_ids, response_ids, problems):
        r = with_eos(r, tokenizer.eos_token_id)
        _append_fitted(out, p + r, [IGNORE_INDEX] * len(p) + r, cfg, problem)
    return out


def tokenize_chats(batch: dict, tokenizer, cfg: DataConfig) -> dict:
    out = {"input_ids": [], "labels": [], "_cut": [], "_problem": []}
    for messages in batch[cfg.messages_field]:
        try:
            ids, labels = chat_sample(tokenizer, messages)
            _append_fitted(out, ids, labels, cfg, "")
        except DataError as e:  # reported with the record's origin (encode._encode_samples)
            _append_fitted(out, [], [], cfg, str(e))
    return out


def chat_sample(tokenizer, messages: Any) -> tuple[list[int], list[int]]:
    """Rendered conversation ids; labels are real only on the tokens each assistant message adds."""
    _check_messages(messages)
    text = render_chat(tokenizer, messages)
    spans = _assistant_spans(tokenizer, messages, text)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    ids = encoding["input_ids"]
    labels = [t if _overlaps(span, spans) else IGNORE_INDEX for t, span in zip(ids, encoding["offset_mapping"])]
    return ids, labels


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise DataError("messages must be a list of {\"role\": str, \"content\": str} objects")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError("no assistant message, so nothing to train on; add one or drop the record")


def render_chat(tokenizer, messages: list[dict], generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:  # template errors (e.g. "roles must alternate") are the record's problem
        raise DataError(f"chat template failed: {e}") from e


def _assistant_spans(tokenizer, messages: list[dict], text: str) -> list[tuple[int, int]]:
    # What message i adds = render(messages[:i+1]) minus render(messages[:i]) + the generation prompt,
    # so the assistant header is context and the content + end-of-turn tokens are learnt.
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render_chat(tokenizer, messages[:i], generation_prompt=True)
        through = render_chat(tokenizer, messages[:i + 1])
        if not (text.startswith(before) and text.startswith(through)):
            raise DataError("the chat template renders a conversation prefix that is not a prefix of the "
                            "whole conversation, so assistant tokens cannot be located; use prompt/response "
                            "records or a prefix-stable template")
        spans.append((len(before), len(through)))
    return spans


def _overlaps(offsets: tuple[int, int], spans: list[tuple[int, int]]) -> bool:
    # A token straddling a boundary (e.g. " 7" after "A:") counts as assistant text.
    start, end = offsets
    return any(start < span_end and max(end, start + 1) > span_start for span_start, span_end in spans)


def _strings(values: list, name: str) -> tuple[list[str], list[str]]:
    """Values with non-strings replaced by '' and a per-value problem ('' when it is a string)."""
    problems = ["" if isinstance(v, str) else f"field '{name}' is {'missing' if v is None else type(v).__name__}"
                f", expected a string" for v in values]
    return [v if isinstance(v, str) else "" for v in values], problems


def with_eos(ids: list[int], eos_id: int) -> list[int]:
    # Some tokenizers append EOS themselves; never end a sample on two.
    return ids if ids and ids[-1] == eos_id else ids + [eos_id]


def _append_fitted(out: dict, ids: list[int], labels: list[int], cfg: DataConfig, problem: str) -> None:
    cut = max(0, len(ids) - cfg.seq_len)
    if cut and not cfg.truncate and not problem:
        problem = (f"record is {len(ids)} tokens, longer than data.seq_len {cfg.seq_len}; set "
                   f"data.truncate: true to cut it, raise data.seq_len, or shorten the record")
    if cut and cfg.truncate:
        ids, labels = ids[:cfg.seq_len], labels[:cfg.seq_len]
    out["input_ids"].append(ids)
    out["labels"].append(labels)
    out["_cut"].append(cut if cfg.truncate else 0)
    out["_problem"].append(problem)
