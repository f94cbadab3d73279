"""The model to plan for: a named Llama size, a preset, an HF config.json, an inline architecture, or a raw
parameter count (a Llama-shaped stand-in with the exact count)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .. import numbers, strict
from ..config import ModelConfig
from ..errors import UserError, closest, short
from ..files import read_json_object
from ..moe import MOE_FAMILIES, family_problems
from ..presets import PRESET_DIR, config_from_dict, list_presets, load_preset
from ..resolve import ARCHITECTURE, QWEN3_MOE_ARCHITECTURE


# Named sizes: public Llama architectures (config.json of the meta-llama / huggyllama repos).
NAMED_MODELS: dict[str, tuple[str, ModelConfig]] = {
    "1b": ("Llama-3.2-1B", ModelConfig(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                                        intermediate_size=8192, vocab_size=128256, max_position_embeddings=131072,
                                        tie_word_embeddings=True, rope_theta=500000.0)),
    "7b": ("Llama-2-7B", ModelConfig(name_or_path="meta-llama/Llama-2-7b-hf", hidden_size=4096, num_layers=32,
                                     num_heads=32, num_kv_heads=32, intermediate_size=11008, vocab_size=32000,
                                     max_position_embeddings=4096)),
    "8b": ("Llama-3.1-8B", ModelConfig(name_or_path="meta-llama/Llama-3.1-8B", hidden_size=4096, num_layers=32,
                                       num_heads=32, num_kv_heads=8, intermediate_size=14336, vocab_size=128256,
                                       max_position_embeddings=131072, rope_theta=500000.0)),
    "13b": ("Llama-2-13B", ModelConfig(name_or_path="meta-llama/Llama-2-13b-hf", hidden_size=5120, num_layers=40,
                                       num_heads=40, num_kv_heads=40, intermediate_size=13824, vocab_size=32000,
                                       max_position_embeddings=4096)),
    "30b": ("LLaMA-30B (32.5B params)", ModelConfig(name_or_path="huggyllama/llama-30b", hidden_size=6656,
                                                    num_layers=60, num_heads=52, num_kv_heads=52,
                                                    intermediate_size=17920, vocab_size=32000,
                                                    max_position_embeddings=2048)),
    "70b": ("Llama-2-70B", ModelConfig(name_or_path="meta-llama/Llama-2-70b-hf", hidden_size=8192, num_layers=80,
                                       num_heads=64, num_kv_heads=8, intermediate_size=28672, vocab_size=32000,
                                       max_position_embeddings=4096)),
    "mixtral-8x7b": ("Mixtral-8x7B", ModelConfig(
        name_or_path="mistralai/Mixtral-8x7B-v0.1", family="mixtral", hidden_size=4096, num_layers=32, num_heads=32,
        num_kv_heads=8, intermediate_size=14336, vocab_size=32000, max_position_embeddings=32768,
        rope_theta=1e6, num_experts=8, num_experts_per_tok=2)),
}


@dataclass(frozen=True)
class ModelSpec:
    config: ModelConfig
    label: str
    params_override: Optional[int] = None   # a raw parameter count the user gave (exact), else counted


def model_from_spec(spec: Any, hidden_size: Any, num_layers: Any, flag) -> ModelSpec:
    """A named size, a preset, a config.json, an inline architecture mapping, or a raw parameter count."""
    where = flag("model")
    if spec is None:
        raise UserError(f"{where} is required: a named size ({', '.join(NAMED_MODELS)}), a preset name, a path to "
                        f"an HF config.json, or a parameter count with --hidden-size and --num-layers")
    if isinstance(spec, dict):
        return ModelSpec(_checked_model(config_from_dict({"model": spec}, source=where).model, where), "inline model")
    text = str(spec).strip()
    if _parse_count(text) is None or text.lower() in NAMED_MODELS:
        given = [flag(key) for key, value in (("hidden_size", hidden_size), ("num_layers", num_layers))
                 if value is not None]
        if given:  # a named size, preset or config.json brings its own architecture: they would do nothing
            raise UserError(f"{' and '.join(given)} with {where} {text!r}: only a raw parameter count takes them "
                            f"(a named size, preset or config.json brings its own architecture); leave them out")
    if text.lower() in NAMED_MODELS:
        label, config = NAMED_MODELS[text.lower()]
        return ModelSpec(config, label)
    path = Path(text)
    if path.suffix == ".json" or (path.is_dir() and (path / "config.json").exists()):
        config = model_from_hf_config(path if path.suffix == ".json" else path / "config.json", where)
        # the weights sit beside their config.json: the directory a launch line fine-tunes (model.name_or_path)
        weights = (path.parent if path.suffix == ".json" else path).expanduser().resolve()
        return ModelSpec(dataclasses.replace(config, name_or_path=str(weights)), str(path))
    if (PRESET_DIR / f"{text}.yaml").exists() or (path.suffix in (".yaml", ".yml") and path.exists()):
        preset = load_preset(text)
        return ModelSpec(_checked_model(preset.model, where), f"preset {preset.name}")
    count = _parse_count(text)
    if count is not None:
        return raw_count_model(count, hidden_size, num_layers, flag, text)
    presets = [name for name, _ in list_presets()]
    raise UserError(f"{where}: {text!r} is not a named size ({', '.join(NAMED_MODELS)}), a preset"
                    f"{closest(text, list(NAMED_MODELS) + presets)}, an existing config.json, or a parameter count")


PARAMETERS = numbers.Kind("a parameter count", integer=True, low=1, high=1e15)


def _parse_count(text: str) -> Optional[float]:
    """'6738415616', '6.7e9', '-5' or '1e400' as a number (the range is checked by raw_count_model); None for
    anything that is no number at all (a name, a path)."""
    try:
        return numbers.parse_number(text.replace(",", ""), integer=True)
    except ValueError as err:
        if "too large" in str(err) or "beyond" in str(err) or "not a finite" in str(err):
            return float("inf")  # a number, out of any range: refused with the range below
        return None


def _checked_model(m: ModelConfig, where: str) -> ModelConfig:
    if min(m.hidden_size, m.num_layers, m.num_heads, m.intermediate_size, m.vocab_size) <= 0:
        raise UserError(f"{where}: hidden_size, num_layers, num_heads, intermediate_size and vocab_size must be > 0")
    # each number's range (0 experts, a top-k of 0), and an MoE's experts against its top-k: the trainer's own checks
    problems = strict.out_of_range(m, "model") + (family_problems(m) if m.family in MOE_FAMILIES else [])
    if problems:
        raise UserError(f"{where}: {'; '.join(problems)}")
    if m.num_experts and m.family not in MOE_FAMILIES:
        raise UserError(f"{where}: the planner counts MoE models of the families {', '.join(MOE_FAMILIES)}; "
                        f"{m.family!r} is not counted yet")
    if (not m.head_dim and m.hidden_size % m.num_heads) or (m.num_kv_heads and m.num_heads % m.num_kv_heads):
        raise UserError(f"{where}: hidden_size must divide by num_heads (or head_dim be given) and num_heads by "
                        f"num_kv_heads")
    return m


HF_FIELDS = {**ARCHITECTURE, "model_type": "family"}  # the resolver's reading of config.json, and the family
QWEN3_MOE_FIELDS = QWEN3_MOE_ARCHITECTURE


SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "mixtral", "qwen3_moe")


def model_from_hf_config(path: Path, where: str) -> ModelConfig:
    """A transformers config.json of a Llama-style decoder (llama, mistral, qwen2) or of an MoE (mixtral,
    qwen3_moe: its experts)."""
    raw = read_json_object(path, f"{where} config.json")
    family = raw.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise UserError(f"{where}: {path} has model_type {short(family)}; the planner counts Llama-style decoders "
                        f"and MoEs ({', '.join(SUPPORTED_FAMILIES)}); give a parameter count with --hidden-size and --num-layers")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                           "vocab_size") if k not in raw]
    if missing:
        raise UserError(f"{where}: {path} lacks {', '.join(missing)}")
    return model_from_hf_fields(raw, f"{where} {path}")


def model_from_hf_fields(raw: dict, where: str) -> ModelConfig:
    """The planner's ModelConfig from a transformers config's fields (config.json, or PretrainedConfig.to_dict())."""
    fields = {ours: raw[theirs] for theirs, ours in HF_FIELDS.items() if raw.get(theirs) is not None}
    if raw.get("model_type") == "qwen3_moe":
        dense = raw.get("mlp_only_layers") or []
        if dense or raw.get("decoder_sparse_step", 1) != 1:
            raise UserError(f"{where}: a Qwen3-MoE with dense MLP layers (mlp_only_layers={dense}, decoder_sparse_step="
                            f"{raw.get('decoder_sparse_step', 1)}) is not counted yet; the planner counts every "
                            f"layer as experts")
        fields.update({ours: raw[theirs] for theirs, ours in QWEN3_MOE_FIELDS.items() if raw.get(theirs) is not None})
    return _checked_model(config_from_dict({"model": fields}, source=where).model, where)  # types checked


def raw_count_model(count: float, hidden_size: Any, num_layers: Any, flag, text: str = "") -> ModelSpec:
    """A parameter count with hidden size and layers: a Llama-shaped stand-in (heads of 128, vocab 32000,
    MLP width solved so the count matches) for activations and the largest layer; params stay exact."""
    problem = PARAMETERS.problem(count)
    if problem:
        raise UserError(f"{flag('model')}: parameter count {text or count!r} must be {PARAMETERS.describe()}")
    hidden = positive_int(hidden_size, flag("hidden_size") + " (needed with a raw parameter count)", False)
    layers = positive_int(num_layers, flag("num_layers") + " (needed with a raw parameter count)", False)
    vocab, params = 32000, int(count)
    per_layer = (params - 2 * vocab * hidden - hidden) / layers
    intermediate = int(round((per_layer - 4 * hidden * hidden - 2 * hidden) / (3 * hidden) / 256)) * 256
    if intermediate <= 0:
        raise UserError(f"{flag('model')}: {params} parameters cannot fill {layers} layers of width {hidden} "
                        f"(embeddings alone are {2 * vocab * hidden}); check the count, --hidden-size and --num-layers")
    heads = max(1, hidden // 128)
    config = ModelConfig(hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=heads,
                         intermediate_size=intermediate, vocab_size=vocab, max_position_embeddings=1 << 20)
    return ModelSpec(_checked_model(config, flag("model")), f"{params / 1e9:.2f}B-parameter model", params)


def positive_int(value: Any, where: str, optional: bool, kind: numbers.Kind = numbers.COUNT) -> Optional[int]:
    if value is None and optional:
        return None
    problem = kind.problem(value)  # inf and nan too, not an OverflowError from int()
    if problem:
        raise UserError(f"{where}: {value!r} {problem}")
    return int(value)
