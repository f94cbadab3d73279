"""What a chat template asks of the tokenizer and of generation: its markers as single tokens, and the token a turn
ends on.

A shipped template declares, in its opening Jinja comment,
    special tokens: <|im_start|> <|im_end|>    (markers that must be one token each; none for templates on EOS)
    end of turn: <|im_end|>                    (or eos_token)
Markers the tokenizer lacks are added as special tokens (TRL's setup_chat_format does the same for ChatML); the
model's embeddings grow to match (trainer.model.fit_embeddings). The end of turn is found by rendering, for any
template (a shipped one, a user's .jinja file, a model's own): the special token the template writes right after an
assistant message's content. Generation stops on it, and the export's generation_config.json lists it with EOS.
"""
from __future__ import annotations

import re

DECLARATION = re.compile(r"^\s*(special tokens|end of turn):[ \t]*(.*?)\s*$", re.MULTILINE)
SENTINEL = "\u2063answer\u2063"  # an assistant content no template rewrites and no reply contains


def declared(template: str) -> dict[str, list[str]]:
    """{'special tokens': [...], 'end of turn': [...]} from the template's opening comment (empty when undeclared)."""
    opening = re.match(r"\s*\{#-?(.*?)-?#\}", template, re.DOTALL)
    if not opening:
        return {}
    return {key: value.split() for key, value in DECLARATION.findall(opening.group(1))}


def add_markers(tokenizer, template: str) -> list[str]:
    """The template's declared markers that were not single tokens, now added as special tokens (in order)."""
    vocabulary = tokenizer.get_vocab()
    missing = [m for m in declared(template).get("special tokens", []) if m not in vocabulary]
    if missing:
        tokenizer.add_special_tokens({"extra_special_tokens": missing}, replace_extra_special_tokens=False)
    return missing


def end_of_turn(tokenizer) -> str | None:
    """The special token the chat template writes right after an assistant message (None: no template, or it
    writes none there)."""
    text = _rendered_reply(tokenizer)
    if text is None:
        return None
    after = text[text.index(SENTINEL) + len(SENTINEL):].lstrip()
    specials = sorted({*tokenizer.all_special_tokens, *(t.content for t in tokenizer.added_tokens_decoder.values())},
                      key=len, reverse=True)
    return next((token for token in specials if token and after.startswith(token)), None)


def _rendered_reply(tokenizer) -> str | None:
    if not getattr(tokenizer, "chat_template", None):
        return None
    messages = [{"role": "user", "content": "question"}, {"role": "assistant", "content": SENTINEL}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses this conversation declares nothing here
        return None
    return text if SENTINEL in text else None


def stop_token_ids(tokenizer) -> list[int]:
    """The ids generation ends on: the tokenizer's EOS, then the chat template's end of turn when it is another."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    marker = end_of_turn(tokenizer)
    if marker is not None:
        marker_id = tokenizer.convert_tokens_to_ids(marker)
        if marker_id is not None and marker_id not in ids:
            ids.append(marker_id)
    return ids
