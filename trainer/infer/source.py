"""What `--model SRC` names, and the model and tokenizer it loads.

SRC may be
  an HF model directory (config.json + weights)          loaded with transformers
  a LoRA adapter directory (adapter_config.json)         its base + the adapter, merged
  a run directory (config.resolved.yaml, checkpoints/)   its HF export `hf/`, or its newest complete
                                                         checkpoint when that is newer than the export
  a checkpoints/ directory or one checkpoint (COMPLETE)  DeepSpeed's files consolidated (consolidate.py);
                                                         architecture and tokenizer from the saved config
  a hub id (org/name)                                    transformers from the hub (needs the network)

A checkpoint is verified (its manifest, and no pickled code: train/integrity.py) before anything in it is read
for loading, the tokenizer and the saved config included: choosing it reads only its name and `latest`. The
model's own Python code runs only with --trust-remote-code (trainer/remote_code.py); a saved config cannot turn
it on.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..config import Config
from ..data.records import looks_like_path
from ..errors import UserError, clip
from ..files import read_json_object, read_yaml_mapping
from ..paths import what_is
from ..presets import REPO_ROOT, config_from_dict
from ..remote_code import load_kwargs, refused, saved_permission_ignored
from ..train import checkpoint

ALLOW_CODE = "pass --trust-remote-code"


@dataclass
class ModelSource:
    kind: str                       # "hf", "lora", "checkpoint" or "hub"
    path: str                       # the directory (or hub id) that is loaded
    described: str                  # one line for the log: what SRC was taken to be
    config: Optional[Config] = None  # the training config saved with a run or checkpoint
    world_size: Optional[int] = None  # the ranks that config was resolved for (its record's derived.world_size)
    trust_remote_code: bool = False  # the user's --trust-remote-code (never a saved config's)


def resolve_source(src: str, trust_remote_code: bool = False, flag: str = "--model") -> ModelSource:
    """What `src` names; `flag` is the option that gave it (--model, or evaluate's --reference), for the errors."""
    source = _resolve(src, flag)
    source.trust_remote_code = trust_remote_code
    if source.config is not None:
        saved = source.config.model.trust_remote_code
        saved_permission_ignored(saved, trust_remote_code, source.described)
        source.config.model.trust_remote_code = trust_remote_code
    return source


def _resolve(src: str, flag: str = "--model") -> ModelSource:
    if not src.strip():  # Path("") is the current directory: never what an empty value meant
        raise UserError(f"{flag} is empty; give an HF model directory, a run directory (train.output_dir), a "
                        f"checkpoint directory or a hub id")
    path = Path(src).expanduser()
    found = what_is(path)
    if found == "missing":
        if looks_like_path(src):
            raise UserError(f"{flag} {src!r}: no such file or directory; give an HF model directory, a run directory "
                            f"(train.output_dir), a checkpoint directory or a hub id")
        return ModelSource("hub", src, f"hub model {src}")
    if found != "a directory":
        raise UserError(f"{flag} {src}: {found}, not a directory; give the directory that holds config.json (an HF "
                        f"model), a run directory, or a checkpoint directory")
    if (path / "config.json").exists() and what_is(path / "config.json") != "a regular file":
        raise UserError(f"{flag} {src}: its config.json is {what_is(path / 'config.json')}, not a file")
    if (path / "config.json").is_file():
        read_json_object(path / "config.json", "model config")  # a JSON object, before transformers reads it
        return ModelSource("hf", str(path), f"HF model {path}")
    if (path / "adapter_config.json").is_file():
        return ModelSource("lora", str(path), f"LoRA adapter {path} (merged into its base)")
    if (path / checkpoint.COMPLETE).is_file() and (path / checkpoint.STATE_FILE).is_file():
        return checkpoint_source(path, f"checkpoint {path}")
    if (path / "latest").is_file() or list(path.glob("step_*")):
        found = checkpoint.find_resume("auto", path)
        if found is None:
            raise UserError(f"{flag} {src}: a checkpoints directory without a complete checkpoint (none has "
                            f"{checkpoint.COMPLETE}); point {flag} at a finished run or an HF export")
        return checkpoint_source(found, f"newest complete checkpoint {found}")
    if (path / "config.resolved.yaml").is_file() or (path / "checkpoints").is_dir():
        return run_source(path, flag)
    raise UserError(f"{flag} {src}: neither an HF model directory (config.json), a LoRA adapter "
                    f"(adapter_config.json), a run directory (config.resolved.yaml, checkpoints/) nor a checkpoint "
                    f"(COMPLETE, {checkpoint.STATE_FILE}); point {flag} at one of those")


def run_source(run_dir: Path, flag: str = "--model") -> ModelSource:
    """A run's HF export, unless a complete checkpoint is newer than it (a run continued past its export)."""
    export = run_dir / "hf"
    newest = checkpoint.find_resume("auto", run_dir / "checkpoints")
    exported = (export / "config.json").is_file() or (export / "adapter_config.json").is_file()
    if exported and (newest is None or export_step(export) >= checkpoint_step(newest)):
        source = _resolve(str(export), flag)
        source.described = f"run {run_dir}: its HF export {export}"
        source.config, source.world_size = run_config(run_dir)
        return source
    if newest is None:
        raise UserError(f"{flag} {run_dir}: the run has no HF export (hf/) and no complete checkpoint yet; "
                        f"train it to its end, or to its first save (train.save_every)")
    return checkpoint_source(newest, f"run {run_dir}: its newest complete checkpoint {newest.name}")


def run_config(run_dir: Path) -> tuple[Optional[Config], Optional[int]]:
    """The run's resolved config (config.resolved.yaml), for evaluating it with its own data settings, and the
    world size it was resolved for."""
    path = run_dir / "config.resolved.yaml"
    if not path.exists():
        return None, None
    raw = read_yaml_mapping(path, "run's saved config")
    return _saved_config(raw, path), saved_world_size(raw)


def saved_world_size(raw: dict) -> Optional[int]:
    """The world size a saved record was resolved for (None in a record that does not say)."""
    world = (raw.get("derived") or {}).get("world_size")
    return world if isinstance(world, int) and not isinstance(world, bool) and world >= 1 else None


# sections a saved record adds to the config: what resolution derived, and which code and stack produced the run
RECORD_ONLY = ("derived", "provenance")


def _saved_config(raw: dict, where: Path) -> Config:
    """A run's saved config; one from before train.eval_sequences evaluated eval_batches micro-batches per rank."""
    train = raw.get("train") or {}
    if "eval_batches" in train:
        derived = raw.get("derived") or {}
        dp = derived.get("data_parallel_size") if isinstance(derived.get("data_parallel_size"), int) else 1
        micro = train.get("micro_batch_size") if isinstance(train.get("micro_batch_size"), int) else 1
        train["eval_sequences"] = train.pop("eval_batches") * micro * dp
    try:
        return config_from_dict({k: v for k, v in raw.items() if k not in RECORD_ONLY}, source=str(where))
    except UserError as err:
        raise UserError(f"--model {where}: its saved config cannot be read by this version ({err})") from None


def export_step(export: Path) -> int:
    """The step an HF export was written at (exports from before the record count as the newest)."""
    try:
        return int(json.loads((export / checkpoint.EXPORT_INFO).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 1 << 62


def checkpoint_step(path: Path) -> int:
    """A checkpoint's step from its name (step_00000100), read before it is verified; its state file after."""
    name = path.name
    if name.startswith("step_") and name[len("step_"):].isdigit():
        return int(name[len("step_"):])
    return checkpoint.read_trainer_state(path)[0].step


def checkpoint_source(path: Path, described: str) -> ModelSource:
    """A checkpoint, verified before any file in it is read for its contents (its saved config and tokenizer
    included): a damaged or planted checkpoint is refused here, before the tokenizer or any weight loads."""
    from ..distributed import comm_device
    checkpoint.verify(path, comm_device())
    _, saved = checkpoint.read_trainer_state(path)
    return ModelSource("checkpoint", str(path), described, _saved_config(saved, path), world_size=saved_world_size(saved))


# --- loading --------------------------------------------------------------------------------------


def load_tokenizer_for(source: ModelSource):
    """The tokenizer the model was trained with; pad falls back to EOS (left padding is set by the caller)."""
    from transformers import AutoTokenizer
    if source.kind != "checkpoint":
        try:
            tokenizer = AutoTokenizer.from_pretrained(source.path, **permission(source, source.path, "tokenizer"))
        except (OSError, ValueError) as err:
            raise refused(err, source.path, ALLOW_CODE) or UserError(
                f"--model {source.path}: cannot load its tokenizer ({err})") from None
    else:
        tokenizer = _checkpoint_tokenizer(source)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _checkpoint_tokenizer(source: ModelSource):
    """The saved config's tokenizer (relative paths as training saw them, or under the repo root), with
    data.chat_template applied as training did; a run's own export when it has one."""
    from ..data import apply_chat_template, load_tokenizer
    cfg = source.config
    run_export = Path(source.path).parent.parent / "hf"
    if (run_export / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer
        try:
            return AutoTokenizer.from_pretrained(str(run_export), **permission(source, str(run_export), "tokenizer"))
        except (OSError, ValueError) as err:
            raise refused(err, str(run_export), ALLOW_CODE) or UserError(
                f"--model {source.path}: cannot load the run's tokenizer {run_export} ({err})") from None
    model_cfg = cfg.model
    path = model_cfg.tokenizer or model_cfg.name_or_path
    if path and not Path(path).expanduser().is_absolute() and not Path(path).exists() and (REPO_ROOT / path).exists():
        import dataclasses
        model_cfg = dataclasses.replace(model_cfg, tokenizer=str(REPO_ROOT / path))
    try:
        return apply_chat_template(load_tokenizer(model_cfg), cfg.data)
    except UserError as err:  # the message says model.trust_remote_code: here the permission is the flag
        raise UserError(str(err).replace("set model.trust_remote_code=true in the preset (or --set "
                                         "model.trust_remote_code=true)", ALLOW_CODE)) from None


def load_model(source: ModelSource, dtype: torch.dtype, attention: str = "sdpa"):
    """The causal LM on CPU in `dtype`, in eval mode, every parameter complete."""
    from transformers import AutoModelForCausalLM
    if source.kind in ("hf", "hub"):
        try:
            model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype, attn_implementation=attention,
                                                         **permission(source, source.path, "model"))
        except Exception as err:  # noqa: BLE001 - truncated safetensors, shapes that do not match, a config of
            # another kind: transformers and safetensors raise their own types; every one is this directory's fault
            raise refused(err, source.path, ALLOW_CODE) or UserError(
                f"--model {source.path}: cannot load it with transformers ({type(err).__name__}: "
                f"{clip(str(err), 400)}); is the directory complete (config.json and every weight file whole)?") \
                from None
    elif source.kind == "lora":
        from ..model import load_lora_merged
        model = load_lora_merged(source.path, dtype, attention, source.trust_remote_code)
    else:
        model = model_from_checkpoint(source, dtype, attention)
    model.config.use_cache = True
    from ..model import returns_as_default  # a config saved with training's output_router_logits (another trainer's)
    for key, value in returns_as_default(model.config.to_dict(), type(model.config)().to_dict()).items():
        setattr(model.config, key, value)
    return model.eval()


def model_from_checkpoint(source: ModelSource, dtype: torch.dtype, attention: str):
    """The saved architecture, filled with the checkpoint's consolidated weights (LoRA: merged)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ..model import apply_lora, hf_config
    from .consolidate import consolidated_state_dict
    cfg = source.config
    if cfg.model.name_or_path:
        hf = _config_of(source, cfg.model.name_or_path, attn_implementation=attention)
    else:
        hf = hf_config(cfg.model, attention)
    with torch.device("meta"):
        shapes = AutoModelForCausalLM.from_config(hf)
        if cfg.model.lora.enabled:
            shapes = apply_lora(shapes, cfg.model)
    expected = {name: tuple(t.shape) for name, t in shapes.state_dict().items()}
    state = consolidated_state_dict(Path(source.path), cfg.deepspeed, expected, verified=True)
    model = AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
    if cfg.model.lora.enabled:
        model = apply_lora(model, cfg.model)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not _tied(k, model)]
    if missing or unexpected:
        raise UserError(f"--model {source.path}: the checkpoint does not match its saved architecture (missing "
                        f"{missing[:3]}, unexpected {unexpected[:3]}); was it written by another trainer version?")
    if cfg.model.lora.enabled:
        model = model.merge_and_unload()
    return model.to(dtype)


def _tied(name: str, model) -> bool:
    """A tied LM head is not saved separately."""
    return name.endswith("lm_head.weight") and bool(getattr(model.config, "tie_word_embeddings", False))


def architecture(source: ModelSource):
    """The transformers config of the model SRC names, read before any weight (for the checks and the planner)."""
    if source.kind == "checkpoint":
        from ..model import hf_config
        cfg = source.config
        if cfg.model.name_or_path:
            return _config_of(source, cfg.model.name_or_path)
        return hf_config(cfg.model, "sdpa")
    path = source.path
    if source.kind == "lora":
        path = json.loads((Path(path) / "adapter_config.json").read_text()).get("base_model_name_or_path") or path
    return _config_of(source, path)


def _config_of(source: ModelSource, path: str, **extra):
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(path, **extra, **permission(source, path, "model"))
    except (OSError, ValueError) as err:
        raise refused(err, path, ALLOW_CODE) or UserError(
            f"--model {source.path}: cannot read its config {path} ({err})") from None


def permission(source: ModelSource, location: str, what: str) -> dict:
    """transformers' trust_remote_code for a load under `source`: the user's flag, explicitly."""
    return load_kwargs(source.trust_remote_code, location, what)
