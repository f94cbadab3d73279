"""The indexes a message's words are looked up in: the trainer's settings (the schema's fields, their types and
choices), DeepSpeed's keys (learned from the installed DeepSpeed: each model's fields, each block's path), the names
libraries write the settings' values in (FlashAttention for flash_attention_2), and PEFT's table of default LoRA
targets per model family. stated.py reads a message against them; they hold no knowledge of any one message.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import re
import typing
from importlib import metadata
from pathlib import Path
from typing import Optional

from ... import config as schema
from ...ds import learned
from ...errors import UserError
from ..findings import Found

FILLER = {"the", "of", "per", "a", "an", "for", "to", "in", "your"}
SYNONYMS = {"number": "num", "numbers": "num"}

@functools.lru_cache(maxsize=1)
def schema_fields() -> dict[str, tuple]:
    """Every field of the trainer's config as `section.field` -> its choices (a Literal's values; () for none)."""
    return {path: tuple(str(v) for v in typing.get_args(hint)) if typing.get_origin(hint) is typing.Literal else ()
            for path, hint in schema_types().items()}


@functools.lru_cache(maxsize=1)
def deepspeed_fields() -> dict[str, str]:
    """Every key DeepSpeed's pydantic models know (learned from the installed DeepSpeed) -> the model's name."""
    try:
        models = learned.facts()["models"]
    except (UserError, OSError, ImportError):  # no DeepSpeed to learn from: the index is empty, the rest still works
        return {}
    fields = {name: model["name"] for model in models.values() for name in model.get("fields", {})}
    aliases = {info["alias"]: model["name"] for model in models.values()  # stage3_prefetch_bucket_size, as configs say
               for info in (model.get("fields") or {}).values() if isinstance(info, dict) and info.get("alias")}
    return {**aliases, **fields}


@functools.lru_cache(maxsize=1)
def deepspeed_sections() -> dict[str, str]:
    """DeepSpeed's config sections as their pydantic model's name -> the section (DeepSpeedBF16Config -> bf16), learned
    from the installed DeepSpeed."""
    try:
        blocks = learned.facts().get("blocks", {})
    except (UserError, OSError, ImportError):
        return {}
    return {path.rsplit(".", 1)[-1]: block for block, path in blocks.items()}


def sections_with(field: str) -> list[str]:
    """The DeepSpeed sections whose model has `field` (its name or its alias), e.g. loss_scale_window -> [fp16]."""
    try:
        models = learned.facts()["models"]
    except (UserError, OSError, ImportError):
        return []
    names = deepspeed_sections()
    return [names[m["name"]] for m in models.values() if m["name"] in names and any(
        name == field or (isinstance(info, dict) and info.get("alias") == field)
        for name, info in (m.get("fields") or {}).items())]


def deepspeed_path_of(model: str, field: str) -> Optional[str]:
    """The DeepSpeed config path of a pydantic model's field (DeepSpeedZeroConfig, stage3_prefetch_bucket_size ->
    zero_optimization.stage3_prefetch_bucket_size); the field alone for the top-level config's own."""
    try:
        blocks = learned.facts().get("blocks", {})
    except (UserError, OSError, ImportError):
        return None
    block = next((b for b, path in blocks.items() if path.rsplit(".", 1)[-1] == model), None)
    if block:
        return f"{block}.{field}"
    return field if deepspeed_fields().get(field) == model else None


@functools.lru_cache(maxsize=1)
def _phrases() -> dict[tuple, str]:
    """A key's name as the words a message writes it in (num_generations: ("num", "generations")) -> the path the
    trainer accepts (the schema's) or DeepSpeed's key; keys of two words or more only."""
    out: dict[tuple, str] = {}
    for name in deepspeed_fields():
        if "_" in name:
            out.setdefault(tuple(name.lower().split("_")), name)
    for path in schema_fields():
        leaf = path.rsplit(".", 1)[-1]
        if "_" in leaf:
            out[tuple(leaf.split("_"))] = path
    return out


def named_key(phrase: str) -> Optional[str]:
    """The key whose name the words of `phrase` spell (the longest run of them), or None."""
    words = [SYNONYMS.get(w, w) for w in re.findall(r"[a-z0-9]+", phrase.lower()) if w not in FILLER]
    index = _phrases()
    for size in range(min(4, len(words)), 1, -1):
        for start in range(len(words) - size + 1):
            if (hit := index.get(tuple(words[start:start + size]))) is not None:
                return hit
    return None


@functools.lru_cache(maxsize=1)
def deepspeed_paths() -> tuple[str, ...]:
    """Every DeepSpeed key as block.field (zero_optimization.stage), from the installed DeepSpeed's models."""
    try:
        facts = learned.facts()
    except (UserError, OSError, ImportError):
        return ()
    models = facts.get("models", {})
    return tuple(f"{block}.{name}" for block, model in facts.get("blocks", {}).items()
                 for name in models.get(model, {}).get("fields", []))


def setting_named(phrase: str) -> Optional[str]:
    """The setting a message's words name: a key spelt out (named_key), else a DeepSpeed key whose section and
    field the words give in order ("ZeRO stage" -> deepspeed.zero_optimization.stage), ending with its field."""
    hit = named_key(phrase)
    if hit:
        return hit if "." in hit else next((f"deepspeed.{p}" for p in deepspeed_paths() if p.endswith(f".{hit}")), hit)
    words = [SYNONYMS.get(w, w) for w in re.findall(r"[a-z0-9]+", phrase.lower()) if w not in FILLER]
    if len(words) < 2:
        return None
    for path in deepspeed_paths():
        parts = re.split(r"[._]", path)
        if parts[-1] == words[-1] and _in_order(words, parts):
            return f"deepspeed.{path}"
    return None


def _in_order(words: list[str], parts: list[str]) -> bool:
    remaining = iter(parts)
    return all(any(word == part for part in remaining) for word in words)


SPELLINGS = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32"}


def spelt(name: str) -> str:
    """A feature's name without case, separators or a plural: FlashAttention, flash_attention, Flash-Attention and
    flash attention are one; 'Liger kernels' is 'liger'."""
    bare = re.sub(r"[^a-z0-9]", "", name.lower())
    bare = SPELLINGS.get(bare, bare)
    return bare[:-1] if bare.endswith("s") and len(bare) > 4 else bare


@functools.lru_cache(maxsize=1)
def feature_names() -> dict[str, tuple[str, str]]:
    """How a message may name a setting's value -> (schema path, value): each choice that is no English word
    (flash_attention_2: also without its version suffix), and each on/off feature of the model section (liger,
    gradient_checkpointing, tiled_mlp) -> 'true', the value a refusal is about."""
    out: dict[str, tuple[str, str]] = {}
    for path, choices in schema_fields().items():
        for choice in choices:
            if re.search(r"[\d_]", choice):
                out.setdefault(spelt(choice), (path, choice))
                out.setdefault(spelt(re.sub(r"_\d+$", "", choice)), (path, choice))
    for path, kind in schema_types().items():
        if path.startswith("model.") and kind is bool:
            out.setdefault(spelt(path.rsplit(".", 1)[1]), (path, "true"))
    return out


@functools.lru_cache(maxsize=1)
def schema_types() -> dict[str, object]:
    """Every field of the trainer's config as `section.field` -> its type hint."""
    out: dict[str, object] = {}

    def walk(cls, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for fld in dataclasses.fields(cls):
            hint = hints.get(fld.name)
            if dataclasses.is_dataclass(hint):
                walk(hint, f"{prefix}{fld.name}.")
            else:
                out[f"{prefix}{fld.name}"] = hint
    walk(schema.Config, "")
    return out


MODEL_NAME = re.compile(r"(?:model_name_or_path|name_or_path|from_pretrained\(\s*)[\s=:\"']*(?P<name>[\w./-]+)")


@functools.lru_cache(maxsize=1)
def peft_default_targets() -> dict:
    """PEFT's table of LoRA target modules per model type, read from the installed PEFT's source (importing PEFT
    would import torch)."""
    try:
        source = Path(metadata.distribution("peft").locate_file("peft/utils/constants.py")).read_text()
        tree = ast.parse(source)
    except (metadata.PackageNotFoundError, OSError, SyntaxError):
        return {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_"
                                                "MAPPING" for t in node.targets):
            try:
                table = ast.literal_eval(node.value)
            except ValueError:
                return {}
            return {k: v for k, v in table.items() if isinstance(v, list)}
    return {}


def model_targets(f: Found) -> Optional[tuple[str, list[str]]]:
    """(model type, its default LoRA targets) for the model the log loads, by the longest type its name holds."""
    names = [m.group("name").rstrip("/").rsplit("/", 1)[-1].lower() for m in f.log.all(MODEL_NAME)]
    table = peft_default_targets()
    for name in names:
        bare = re.sub(r"[-_]", "", name)
        types = sorted((t for t in table if len(t) >= 3 and re.sub(r"[-_]", "", t.lower()) in bare), key=len)
        if types:
            return types[-1], table[types[-1]]
    return None
