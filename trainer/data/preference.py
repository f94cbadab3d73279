"""Preference pairs (data.task=preference): a prompt with a chosen and a rejected response, tokenized into two
sequences that share the prompt. The loss (trainer/train/preference.py) compares the log-probabilities of the two
responses, so only response tokens are labelled; the prompt is context (-100).

Two record forms:
  pair  {prompt, chosen, rejected}: strings; the prompt is encoded with the tokenizer's special tokens (BOS), each
        response without them and ending on EOS, as SFT's prompt/response records are.
  chat  {messages, chosen, rejected}: the conversation so far, and each response as its final turn(s): a string (the
        assistant's content), an assistant message, or a list of messages. The prompt is the conversation rendered
        with the chat template and its generation prompt; a response is what rendering it as well adds (its content
        and end-of-turn tokens).

Fitting to data.seq_len (`fit_pair`): a prompt of seq_len tokens or more leaves no room for a response and is an
error. A pair whose prompt + longer response exceeds seq_len is an error unless data.truncate is on; then the prompt
is cut from the left (its end, next to the response, is kept) until the longer response fits, but never below half
of seq_len (or its own length), and then both responses are cut from the right to what is left. Chosen and rejected
that are identical (as text, or as tokens after fitting) teach nothing and are an error.

Each pair is stored as two consecutive documents of the shard (chosen, then rejected), each with its loss mask.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import DataConfig
from .records import IGNORE_INDEX, DataError
from .tokenize import render_chat, with_eos


@dataclass
class Fitted:
    """One pair fitted to seq_len: the shared prompt and the two responses, as ids; `cut`: tokens removed."""
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    cut: int = 0
    problem: str = ""

    def sequences(self) -> list[tuple[list[int], list[int]]]:
        """(ids, labels) of the chosen sequence, then of the rejected one."""
        masked = [IGNORE_INDEX] * len(self.prompt)
        return [(self.prompt + response, masked + response) for response in (self.chosen, self.rejected)]


def fit_pair(prompt: list[int], chosen: list[int], rejected: list[int], seq_len: int, truncate: bool) -> Fitted:
    """The pair fitted to `seq_len` by the rule in the module docstring, or with `problem` saying why it cannot be."""
    if len(prompt) >= seq_len:
        return Fitted(prompt, chosen, rejected, problem=(
            f"the prompt is {len(prompt)} tokens, which leaves no room for a response within data.seq_len {seq_len}; "
            f"shorten the prompt or raise data.seq_len"))
    longest = max(len(chosen), len(rejected))
    if len(prompt) + longest <= seq_len:
        return Fitted(prompt, chosen, rejected)
    if not truncate:
        return Fitted(prompt, chosen, rejected, problem=(
            f"the pair is {len(prompt) + longest} tokens (prompt {len(prompt)} + longer response {longest}), longer "
            f"than data.seq_len {seq_len}; set data.truncate: true to cut it (the prompt from the left, then the "
            f"responses from the right), raise data.seq_len, or shorten the record"))
    kept = max(seq_len - longest, min(len(prompt), seq_len // 2))
    room = seq_len - kept
    fitted = Fitted(prompt[len(prompt) - kept:], chosen[:room], rejected[:room])
    fitted.cut = (len(prompt) - kept) + (len(chosen) - len(fitted.chosen)) + (len(rejected) - len(fitted.rejected))
    if fitted.chosen == fitted.rejected:
        fitted.problem = (f"chosen and rejected are the same {room} tokens once cut to data.seq_len {seq_len} (they "
                          f"differ only past it); raise data.seq_len or shorten the prompt")
    return fitted


def tokenize_preferences(batch: dict, tokenizer, cfg: DataConfig, chat: bool) -> dict:
    """Each record as a Fitted pair (its problem, when it has one, is reported with its origin by encode.py)."""
    out = []
    for i in range(len(batch[cfg.chosen_field])):
        try:
            prompt, chosen, rejected = (_chat_texts if chat else _plain_texts)(batch, i, cfg, tokenizer)
            if chosen == rejected:
                raise DataError(f"'{cfg.chosen_field}' and '{cfg.rejected_field}' are identical, so the pair "
                                f"prefers nothing; fix or drop the record")
            if chat:
                ids = [_ids(tokenizer, text, special=False) for text in (prompt, chosen, rejected)]
            else:
                eos = tokenizer.eos_token_id
                ids = [_ids(tokenizer, prompt, special=True)] + [with_eos(_ids(tokenizer, text, special=False), eos)
                                                                 for text in (chosen, rejected)]
            out.append(fit_pair(*ids, cfg.seq_len, cfg.truncate))
        except DataError as err:
            out.append(Fitted([], [], [], problem=str(err)))
    return {"pairs": out}


def _ids(tokenizer, text: str, special: bool) -> list[int]:
    return tokenizer(text, add_special_tokens=special, verbose=False)["input_ids"]


def _plain_texts(batch: dict, i: int, cfg: DataConfig, tokenizer) -> tuple[str, str, str]:
    return tuple(_string(batch[name][i], name) for name in (cfg.prompt_field, cfg.chosen_field, cfg.rejected_field))


def _string(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise DataError(f"field '{name}' is {'missing' if value is None else type(value).__name__}, expected a string")
    return value


def _chat_texts(batch: dict, i: int, cfg: DataConfig, tokenizer) -> tuple[str, str, str]:
    """The rendered prompt (with the generation prompt) and what each response's final turns add to it."""
    messages = batch[cfg.messages_field][i]
    if not isinstance(messages, list) or not _are_messages(messages):
        raise DataError(f"field '{cfg.messages_field}' must be a list of {{\"role\": str, \"content\": str}} objects "
                        f"(the conversation before the responses)")
    prompt = render_chat(tokenizer, messages, generation_prompt=True)
    texts = []
    for name in (cfg.chosen_field, cfg.rejected_field):
        turns = _turns(batch[name][i], name)
        whole = render_chat(tokenizer, messages + turns)
        if not whole.startswith(prompt):
            raise DataError(f"the chat template renders the conversation with '{name}' so that it does not start with "
                            f"the prompt rendered alone, so the response tokens cannot be located; use {{prompt, "
                            f"chosen, rejected}} strings or a prefix-stable template")
        texts.append(whole[len(prompt):])
    return prompt, texts[0], texts[1]


def _turns(value: Any, name: str) -> list[dict]:
    """A response's final turns: a string is the assistant's content; a message; or a list of messages."""
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    turns = [value] if isinstance(value, dict) else value
    if not isinstance(turns, list) or not turns or not _are_messages(turns):
        found = "missing" if value is None else f"{type(value).__name__} {repr(value)[:60]}"
        raise DataError(f"field '{name}' is {found}, expected a string, an assistant message {{\"role\", \"content\"}} "
                        f"or a list of them")
    return turns


def _are_messages(values: list) -> bool:
    return all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
               for m in values)
