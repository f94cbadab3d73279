"""One gate for every string on its way to a tokenizer: pretraining text, SFT and chat records, preference records,
prompt files, `--prompt`, and evaluation data all pass `refusal` (or `check`) before they are tokenized.

A Python string can hold any code point, but a tokenizer takes Unicode scalar values only: a lone surrogate
(U+D800-U+DFFF) is valid JSON (`"\\ud800"`, an escape without its pair) and is what Python makes of the bytes of a
command-line argument that is not UTF-8 (U+DC80-U+DCFF, "surrogateescape"). Handed to a fast tokenizer it is a
`TypeError` from Rust, after files were written. The gate names where the string came from (file and line, or the
flag), the field (and the place inside a chat message), the character and its position.
"""
from __future__ import annotations

from typing import Any, Optional

from .errors import UserError


def first_unencodable(value: Any, path: str = "") -> Optional[tuple[str, int, str]]:
    """(place inside `value`, character index, character) of the first string character that is not a Unicode
    scalar value, walking strings, lists and dicts (chat messages) in order; None when every one is."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as err:
            return path, err.start, value[err.start]
        return None
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            if (found := first_unencodable(item, f"{path}[{index}]")) is not None:
                return found
    elif isinstance(value, dict):
        for key, item in value.items():
            if (found := first_unencodable(item, f"{path}.{key}" if isinstance(key, str) else f"{path}[{key!r}]")):
                return found
    return None


def describe(character: str) -> str:
    code = ord(character)
    if 0xDC80 <= code <= 0xDCFF:
        return (f"U+{code:04X}, a lone surrogate: the byte {code - 0xDC00:#04x} of text that is not UTF-8 (a "
                f"command-line argument or file in another encoding), or a JSON escape \\u{code:04x} without its "
                f"pair")
    return f"U+{code:04X}, a lone surrogate (a JSON escape \\u{code:04x} without its pair)"


def refusal(value: Any, where: str, field: str) -> Optional[str]:
    """The message refusing `value` (from `where`, a file and line or a flag; in `field`), or None when a tokenizer
    can take every string of it."""
    found = first_unencodable(value)
    if found is None:
        return None
    place, index, character = found
    return (f"{where}: field {field!r}{place}, character {index}: {describe(character)}; no tokenizer can encode "
            f"it (it is not a Unicode scalar value): fix the text (the character itself, or a valid escape pair)")


def check(value: Any, where: str, field: str) -> None:
    """`refusal` as a UserError (printed without a traceback)."""
    message = refusal(value, where, field)
    if message:
        raise UserError(message)
