"""Which keys the installed DeepSpeed reads, checked against the DeepSpeed that is installed.

Blocks DeepSpeed parses with pydantic models (zero_optimization, bf16, fp16, tensor_parallel, monitors, ...)
are checked against those models; blocks it parses with plain dict lookups (activation_checkpointing, aio,
flops_profiler, ...), where DeepSpeed 0.19.8 silently ignores typos, are checked against the keys DeepSpeed
is seen to look up when it parses a config (`_probe_dict_keys`). Nothing is copied by hand, so the check
follows whatever DeepSpeed is installed.
"""
from __future__ import annotations

import functools
import inspect
import math
import re

from ..errors import closest, short
from .keys import zero


REMOVED_OPTIMIZERS = {"onebitadam", "zerooneadam", "onebitlamb"}


def _pydantic_blocks() -> dict[str, type]:
    """Top-level blocks DeepSpeed parses with pydantic models (which also check types and ranges)."""
    from deepspeed.comm.config import CommsLoggerConfig
    from deepspeed.compile.config import CompileConfig
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.config import HybridEngineConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    return {"zero_optimization": DeepSpeedZeroConfig, "bf16": DeepSpeedBF16Config, "fp16": DeepSpeedFP16Config,
            "tensor_parallel": TPTrainingConfig, "comms_logger": CommsLoggerConfig, "compile": CompileConfig,
            "wandb": WandbConfig, "tensorboard": TensorBoardConfig, "csv_monitor": CSVConfig, "comet": CometConfig,
            "hybrid_engine": HybridEngineConfig}


# Dict-parsed blocks whose keys we learn by watching DeepSpeed parse (DeepSpeed ignores typos in these).
_DICT_BLOCKS = ("activation_checkpointing", "aio", "flops_profiler", "data_types", "checkpoint",
                "autotuning", "torch_autocast")


class _RecordingDict(dict):
    """A dict that records every key looked up in it (and in nested dicts), to learn what DeepSpeed reads."""

    def __init__(self, data, path=(), seen=None):
        super().__init__(data)
        self._path, self._seen = path, seen

    def _child(self, key, value):
        if isinstance(value, dict) and not isinstance(value, _RecordingDict):
            value = _RecordingDict(value, self._path + (key,), self._seen)
            dict.__setitem__(self, key, value)
        return value

    def __getitem__(self, key):
        self._seen.add(self._path + (key,))
        return self._child(key, dict.__getitem__(self, key))

    def get(self, key, default=None):
        self._seen.add(self._path + (key,))
        return self._child(key, dict.__getitem__(self, key)) if dict.__contains__(self, key) else default

    def __contains__(self, key):
        self._seen.add(self._path + (key,))
        return dict.__contains__(self, key)

    def keys(self):  # DeepSpeed also asks `KEY in param_dict.keys()`
        return _RecordingKeys(self)


class _RecordingKeys:
    def __init__(self, owner: _RecordingDict):
        self._owner = owner

    def __contains__(self, key):
        return key in self._owner

    def __iter__(self):
        return iter(dict.keys(self._owner))

    def __len__(self):
        return len(self._owner)


@functools.lru_cache(maxsize=1)
def _probe_dict_keys() -> tuple[frozenset, dict]:
    """Parse a config with DeepSpeedConfig and record which keys it looks up: (top-level keys, block -> keys)."""
    from deepspeed.runtime.config import _REMOVED_TOP_LEVEL_CONFIG_KEYS, DeepSpeedConfig
    seen: set = set()
    # micro x accum without train_batch_size: valid at any world size, also inside a running job
    probe = _RecordingDict({**{b: {} for b in _DICT_BLOCKS}, "train_micro_batch_size_per_gpu": 1,
                            "gradient_accumulation_steps": 1}, seen=seen)
    DeepSpeedConfig(probe)
    top = {k[0] for k in seen if len(k) == 1} - set(_REMOVED_TOP_LEVEL_CONFIG_KEYS)
    top |= set(_pydantic_blocks())
    blocks = {b: frozenset(k[1] for k in seen if len(k) == 2 and k[0] == b) for b in _DICT_BLOCKS}
    return frozenset(top), blocks


def check_keys(ds: dict, typed: bool = True) -> list[str]:
    """Unknown, removed and mistyped DeepSpeed keys, each named with its path and a fix.

    With typed=False (before "auto" is filled) DeepSpeed's models skip "auto" values, as DeepSpeed does."""
    from deepspeed.runtime.config import _REMOVED_TOP_LEVEL_CONFIG_KEYS, _REMOVED_ZERO_CONFIG_KEYS
    top, dict_blocks = _probe_dict_keys()
    problems = []
    for key, value in ds.items():
        if key in _REMOVED_TOP_LEVEL_CONFIG_KEYS:
            problems.append(f"deepspeed.{key}: {_REMOVED_TOP_LEVEL_CONFIG_KEYS[key]}")
        elif key not in top:
            problems.append(f"deepspeed.{key}: not a DeepSpeed config key{closest(key, top)}")
        elif (key in dict_blocks or key in _pydantic_blocks() or key in ("optimizer", "scheduler")) \
                and not isinstance(value, dict):
            problems.append(f"deepspeed.{key}: expected a mapping of {key} settings, got {value!r}")
        elif key in dict_blocks:
            for sub in value:
                if sub not in dict_blocks[key]:
                    problems.append(f"deepspeed.{key}.{sub}: not read by DeepSpeed (it would be silently ignored)"
                                    f"{closest(sub, dict_blocks[key])}{_renamed_hint(key, sub)}")
    for sub, message in _REMOVED_ZERO_CONFIG_KEYS.items():
        if isinstance(ds.get("zero_optimization"), dict) and sub in zero(ds):
            problems.append(f"deepspeed.zero_optimization.{sub}: {message}")
    problems += _non_finite(ds, "deepspeed")
    problems += _check_pydantic_blocks(ds, strict=typed)
    problems += _check_optimizer(ds)
    problems += _check_scheduler(ds)
    return _dedupe(problems)  # a key reported above (removed, not a mapping) is not repeated less helpfully


def _renamed_hint(block: str, key: str) -> str:
    if (block, key) == ("aio", "thread_count"):
        return "; DeepSpeed 0.19.8 calls it 'intra_op_parallelism' (the seed's 'thread_count' is outdated)"
    return ""


def _check_pydantic_blocks(ds: dict, strict: bool) -> list[str]:
    import pydantic
    problems = []
    for key, model in _pydantic_blocks().items():
        block = ds.get(key)
        if block is None:
            continue
        if not isinstance(block, dict):
            problems.append(f"deepspeed.{key}: expected a mapping, got {block!r}")
            continue
        problems += _deprecated_keys(block, model, key)
        if key == "zero_optimization":
            problems += _unknown_model_keys(block, model, "zero_optimization")
        else:
            problems += _unknown_model_keys_flat(block, model, key)
        try:
            # deprecated keys are reported above; left in, DeepSpeed would also log its own warning
            model(strict=strict, **{k: v for k, v in block.items() if k not in _deprecated_names(model)})
        except pydantic.ValidationError as err:
            for e in err.errors():
                loc = ".".join(str(p) for p in e["loc"])
                problems.append(f"deepspeed.{key}.{loc}: {_message(e)} (got {short(e.get('input'))})")
        except (TypeError, ValueError, AssertionError) as err:
            problems.append(f"deepspeed.{key}: {err}")
    return _dedupe(problems)


def _non_finite(value, path: str) -> list[str]:
    """inf/nan anywhere: DeepSpeed's JSON (and the exported file) cannot hold them."""
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{path}: {value} is not a finite number (JSON has no inf/nan); write a number"]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _non_finite(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _non_finite(v, f"{path}[{i}]")]
    return []


def _deprecated_keys(block: dict, model, path: str) -> list[str]:
    """Keys DeepSpeed still honours with only a deprecation warning (zero_optimization.cpu_offload, ...): the
    trainer's offload rules, the planner and the linter read the new keys, so the old ones are refused."""
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig
    )
    problems = []
    nested = {"offload_optimizer": DeepSpeedZeroOffloadOptimizerConfig, "offload_param": DeepSpeedZeroOffloadParamConfig}
    for name in sorted(_deprecated_names(model) & set(block)):
        new = model.model_fields[name].json_schema_extra.get("new_param", "its replacement")
        example = {"cpu_offload": " (e.g. offload_optimizer: {device: cpu})",
                   "cpu_offload_param": " (e.g. offload_param: {device: cpu})"}.get(name, "")
        problems.append(f"deepspeed.{path}.{name}: deprecated; DeepSpeed 0.19.8 still honours it with only a "
                        f"warning, and the trainer's checks read {new}: write {new} instead{example}")
    for sub, sub_model in nested.items():
        if path == "zero_optimization" and isinstance(block.get(sub), dict):
            problems += _deprecated_keys(block[sub], sub_model, f"{path}.{sub}")
    return problems


def _deprecated_names(model) -> set[str]:
    return {name for name, info in model.model_fields.items()
            if isinstance(info.json_schema_extra, dict) and info.json_schema_extra.get("deprecated")}


def _message(error: dict) -> str:
    """pydantic's message, with an enum's repeated values said once ("0, 1, 2, 3 or 3": an alias member)."""
    expected = (error.get("ctx") or {}).get("expected")
    if error.get("type") == "enum" and isinstance(expected, str):
        values = list(dict.fromkeys(v.strip() for v in re.split(r",| or ", expected) if v.strip()))
        return f"Input should be {', '.join(values[:-1])} or {values[-1]}" if len(values) > 1 else error["msg"]
    return error["msg"]


def _unknown_model_keys(block: dict, model, path: str) -> list[str]:
    """Unknown keys with a 'did you mean' (pydantic says only 'extra inputs are not permitted')."""
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig, DeepSpeedZeroOffloadParamConfig
    )
    valid = _model_keys(model)
    problems = [f"deepspeed.{path}.{k}: not a DeepSpeed key{closest(k, valid)}" for k in block if k not in valid]
    for sub, sub_model in (("offload_optimizer", DeepSpeedZeroOffloadOptimizerConfig),
                           ("offload_param", DeepSpeedZeroOffloadParamConfig)):
        if isinstance(block.get(sub), dict):
            problems += _unknown_model_keys_flat(block[sub], sub_model, f"{path}.{sub}")
    return problems


def _unknown_model_keys_flat(block: dict, model, path: str) -> list[str]:
    valid = _model_keys(model)
    return [f"deepspeed.{path}.{k}: not a DeepSpeed key{closest(k, valid)}" for k in block if k not in valid]


def _model_keys(model) -> set[str]:
    keys = set()
    for name, info in model.model_fields.items():
        keys.add(name)
        if info.alias:
            keys.add(info.alias)
    return keys


def _dedupe(items: list[str]) -> list[str]:
    seen, out = set(), []
    for item in items:
        head = item.split(":")[0]
        if head not in seen:
            seen.add(head)
            out.append(item)
    return out


def _check_optimizer(ds: dict) -> list[str]:
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS
    opt = ds.get("optimizer")
    if opt is None:
        return []
    if not isinstance(opt, dict):
        return [f"deepspeed.optimizer: expected a mapping with 'type' and 'params', got {opt!r}"]
    problems = [f"deepspeed.optimizer.{k}: not a DeepSpeed key{closest(k, ['type', 'params'])}"
                for k in opt if k not in ("type", "params", "legacy_fusion")]
    if not isinstance(opt.get("params", {}), dict):
        problems.append(f"deepspeed.optimizer.params: expected a mapping (lr, betas, ...), got {opt['params']!r}")
        return problems
    name = str(opt.get("type", "")).lower()
    if name in REMOVED_OPTIMIZERS:
        problems.append(
            f"deepspeed.optimizer.type: {opt['type']!r} was removed from DeepSpeed (0.19.8 has no 1-bit/0-1 "
            f"optimizers; the seed predates this). For cheaper cross-node gradients use ZeRO++ quantized "
            f"gradients: zero_optimization.stage 3 with zero_quantized_gradients: true (and zero_hpz_partition_size)")
    elif name not in DEEPSPEED_OPTIMIZERS:
        problems.append(f"deepspeed.optimizer.type: unknown optimizer {opt.get('type')!r}"
                        f"{closest(name, DEEPSPEED_OPTIMIZERS)}; DeepSpeed has {', '.join(DEEPSPEED_OPTIMIZERS)}")
    elif name in ("adam", "adamw"):
        valid = {"lr", "betas", "eps", "weight_decay", "torch_adam", "adam_w_mode", "amsgrad", "bias_correction",
                 "fused"}
        for key in (opt.get("params") or {}):
            if key not in valid:
                problems.append(f"deepspeed.optimizer.params.{key}: not an Adam parameter{closest(key, valid)}")
    return problems


def _check_scheduler(ds: dict) -> list[str]:
    from deepspeed.runtime import lr_schedules
    sched = ds.get("scheduler")
    if sched is None:
        return []
    if not isinstance(sched, dict):
        return [f"deepspeed.scheduler: expected a mapping with 'type' and 'params', got {sched!r}"]
    name = sched.get("type")
    if name not in lr_schedules.VALID_LR_SCHEDULES:
        return [f"deepspeed.scheduler.type: unknown scheduler {name!r}"
                f"{closest(str(name), lr_schedules.VALID_LR_SCHEDULES)}; DeepSpeed has "
                f"{', '.join(lr_schedules.VALID_LR_SCHEDULES)}"]
    accepted = set(inspect.signature(getattr(lr_schedules, name).__init__).parameters) - {
        "self", "optimizer", "last_batch_iteration"}
    if not isinstance(sched.get("params", {}), dict):
        return [f"deepspeed.scheduler.params: expected a mapping of {name} parameters, got {sched['params']!r}"]
    return [f"deepspeed.scheduler.params.{key}: not a {name} parameter{closest(key, accepted)}"
            for key in (sched.get("params") or {}) if key not in accepted]
