"""Prompts for generation: read from the command line or a JSONL file (errors name file:line), rendered with
the chat template when asked, and encoded as one left-padded batch.

Decoder-only models continue the last position, so a batch of prompts of different lengths is padded on
the left; the attention mask hides the padding and transformers derives the positions from the mask, so a
batched prompt is continued as it would be alone.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .. import text as text_gate
from ..files import loads_unique
from .records import DataError


@dataclass
class Prompt:
    text: str          # what the user wrote (written back in the results)
    origin: str        # where it came from, for messages: "--prompt" or "FILE:LINE"
    messages: list | None = None  # chat messages, when the line gave `messages` instead of `prompt`

    def __post_init__(self):
        """Every prompt, from a file or `--prompt`, passes the one text gate (trainer/text.py) when it is made."""
        field, value = ("messages", self.messages) if self.messages is not None else ("prompt", self.text)
        message = text_gate.refusal(value, self.origin, field)
        if message:
            raise DataError(message)


def read_prompts(path: str) -> list[Prompt]:
    """One JSON object per line with `prompt` (a string) or `messages` (chat messages); blank lines skipped."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataError(f"--prompts {path}: no such file (one JSON object per line: {{\"prompt\": \"...\"}})")
    prompts = []
    with open(file, encoding="utf-8", errors="strict") as handle:
        try:
            lines = list(handle)
        except UnicodeDecodeError as err:
            raise DataError(f"--prompts {path}: not UTF-8 text ({err.reason} at byte {err.start})") from None
    for number, line in enumerate(lines, 1):
        if line.strip():
            prompts.append(_prompt_of_line(line, f"{path}:{number}"))
    if not prompts:
        raise DataError(f"--prompts {path}: the file has no prompts (one JSON object per line: {{\"prompt\": ...}})")
    return prompts


def _prompt_of_line(line: str, where: str) -> Prompt:
    try:
        record = loads_unique(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: not valid JSON ({err.msg} at column {err.colno}); each line must be one object "
                        f"like {{\"prompt\": \"Once upon a time\"}}") from None
    except ValueError as err:  # a key given twice
        raise DataError(f"{where}: {err}") from None
    if not isinstance(record, dict):
        raise DataError(f"{where}: a JSON {type(record).__name__}, expected an object with \"prompt\" or \"messages\"")
    if isinstance(record.get("prompt"), str):
        return Prompt(record["prompt"], where)
    messages = record.get("messages")
    if isinstance(messages, list) and messages and all(isinstance(m, dict) and isinstance(m.get("content"), str)
                                                       for m in messages):
        return Prompt(json.dumps(messages, ensure_ascii=False), where, messages)
    raise DataError(f"{where}: needs \"prompt\" (a string) or \"messages\" (a list of {{\"role\", \"content\"}}); "
                    f"found keys {sorted(record)}")


def render(tokenizer, prompt: Prompt, chat: bool) -> str:
    """The text the model continues: the prompt, or with `chat` the chat template with a generation prompt."""
    if not chat and prompt.messages is None:
        return prompt.text
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{prompt.origin}: " + ("--chat" if chat else "a `messages` prompt") + " needs a chat "
                        "template, and this tokenizer has none: drop --chat, or train with data.chat_template set "
                        "(the export keeps it)")
    messages = prompt.messages or [{"role": "user", "content": prompt.text}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def encode_left_padded(tokenizer, texts: list[str]) -> dict[str, torch.Tensor]:
    """input_ids and attention_mask of the texts, padded on the left to the longest (no special tokens added
    beyond what the tokenizer adds by itself, as in training)."""
    rows = [tokenizer(text, add_special_tokens=True)["input_ids"] for text in texts]
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            input_ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row):] = 1
    return {"input_ids": input_ids, "attention_mask": mask}


def completion_ids(generated: torch.Tensor, stop_ids: list[int]) -> list[int]:
    """The new tokens of one row up to its first stop token (EOS, a chat template's end of turn: kept out of the
    text) or its end; after it transformers pads finished rows with pad tokens, which are not part of the completion."""
    ids = generated.tolist()
    ends = [ids.index(stop) for stop in stop_ids if stop in ids]
    return ids[:min(ends)] if ends else ids
