"""Which keys the installed DeepSpeed reads, checked against the DeepSpeed that is installed.

Blocks DeepSpeed parses with pydantic models (zero_optimization, bf16, fp16, tensor_parallel, monitors, ...)
are checked against those models; blocks it parses with plain dict lookups (activation_checkpointing, aio,
flops_profiler, ...), where DeepSpeed 0.19.8 silently ignores typos, are checked against the keys DeepSpeed
is seen to look up when it parses a config. Nothing is copied by hand: every key, model, removed key, optimizer and
scheduler comes from the installed DeepSpeed, learned once per DeepSpeed (trainer/ds/learned.py) so that checking
a config does not import DeepSpeed and torch.

Values are checked by DeepSpeed's own models where DeepSpeed is imported anyway (train, preflight, autotune: the
live check, with DeepSpeed's own validators), elsewhere by pydantic models rebuilt from the learned ones
(trainer/ds/spec.py): the same types, ranges, enum and literal values and messages, without the validators that
DeepSpeed runs across fields - those the live check still applies before anything trains.
"""
from __future__ import annotations

import ast
import functools
import importlib
import logging
import math
import re
import sys

from ..errors import closest, short
from . import learned
from ..config import AUTO
from .keys import zero


REMOVED_OPTIMIZERS = {"onebitadam", "zerooneadam", "onebitlamb"}
ADAM_PARAMS = {"lr", "betas", "eps", "weight_decay", "torch_adam", "adam_w_mode", "amsgrad", "bias_correction",
               "fused"}


def check_keys(ds: dict, typed: bool = True, live: bool | None = None) -> list[str]:
    """Unknown, removed and mistyped DeepSpeed keys, each named with its path and a fix.

    With typed=False (before "auto" is filled) DeepSpeed's models skip "auto" values, as DeepSpeed does.
    live: check values with DeepSpeed's own models, and build the scheduler (default: when DeepSpeed is imported
    already)."""
    known = learned.facts()
    live = "deepspeed" in sys.modules if live is None else live
    top, removed_top = set(known["top_keys"]), known["removed_top"]
    dict_blocks = {block: set(keys) for block, keys in known["dict_blocks"].items()}
    problems = []
    for key, value in ds.items():
        if key in removed_top:
            problems.append(f"deepspeed.{key}: {removed_top[key]}")
        elif key not in top:
            problems.append(f"deepspeed.{key}: not a DeepSpeed config key{closest(key, top)}")
        elif (key in dict_blocks or key in known["blocks"] or key in ("optimizer", "scheduler")) \
                and not isinstance(value, dict):
            problems.append(f"deepspeed.{key}: expected a mapping of {key} settings, got {value!r}")
        elif key in dict_blocks:
            for sub in value:
                if sub not in dict_blocks[key]:
                    problems.append(f"deepspeed.{key}.{sub}: not read by DeepSpeed (it would be silently ignored)"
                                    f"{closest(sub, dict_blocks[key])}{_renamed_hint(key, sub)}")
    for sub, message in known["removed_zero"].items():
        if isinstance(ds.get("zero_optimization"), dict) and sub in zero(ds):
            problems.append(f"deepspeed.zero_optimization.{sub}: {message}")
    problems += _non_finite(ds, "deepspeed")
    problems += _value_types(ds, known["value_kinds"], typed)
    problems += _check_pydantic_blocks(ds, known, typed, live)
    problems += _check_optimizer(ds, known["optimizers"])
    problems += _check_scheduler(ds, known["schedulers"], typed, live)
    return _dedupe(problems)  # a key reported above (removed, not a mapping) is not repeated less helpfully


# What each kind of value read with dict.get (learned.value_kinds) accepts, and how a refusal says it
KIND_TESTS = {
    "bool": (lambda v: isinstance(v, bool), "must be true or false (DeepSpeed reads it by its truth: 'false' or "
                                            "'no' would be true)"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "must be a whole number"),
    "number": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "must be a number"),
    "str": (lambda v: isinstance(v, str), "must be a string"),
    "mapping": (lambda v: isinstance(v, dict), "must be a mapping"),
    "list": (lambda v: isinstance(v, list), "must be a list"),
}


def _value_types(ds: dict, kinds: dict[str, str], typed: bool) -> list[str]:
    """Values DeepSpeed reads with dict.get, and so never checks, of another kind than its default's: 'maybe' for a
    flag would be true, '8' for a count a string. null is DeepSpeed's own "not given" and passes; before "auto" is
    filled (typed=False) so does "auto"."""
    problems = []
    for path, value in leaf_and_block_paths(ds):
        kind = kinds.get(path)
        if kind and value is not None and not (value == AUTO and not typed) and not KIND_TESTS[kind][0](value):
            problems.append(f"deepspeed.{path}: {short(value)} {KIND_TESTS[kind][1]}")
    return problems


def leaf_and_block_paths(ds: dict, prefix: str = ""):
    """(dotted path, value) of every key of a config, mappings included (a block may be typed as one)."""
    for key, value in ds.items():
        path = f"{prefix}{key}"
        yield path, value
        if isinstance(value, dict):
            yield from leaf_and_block_paths(value, f"{path}.")


def _renamed_hint(block: str, key: str) -> str:
    if (block, key) == ("aio", "thread_count"):
        return "; DeepSpeed 0.19.8 calls it 'intra_op_parallelism' (the seed's 'thread_count' is outdated)"
    return ""


def _check_pydantic_blocks(ds: dict, known: dict, strict: bool, live: bool) -> list[str]:
    import pydantic
    models = known["models"]
    problems = []
    for key, model_key in known["blocks"].items():
        block = ds.get(key)
        if block is None:
            continue
        if not isinstance(block, dict):
            problems.append(f"deepspeed.{key}: expected a mapping, got {block!r}")
            continue
        problems += _deprecated_keys(block, model_key, key, models)
        problems += _unknown_model_keys(block, model_key, key, models)
        # deprecated keys are reported above; left in, DeepSpeed would also log its own warning
        values = {k: v for k, v in block.items() if k not in _deprecated_names(models[model_key])}
        try:
            if live:
                _live_model(models[model_key])(strict=strict, **values)
            elif not models[model_key].get("opaque"):
                _mirrored(known)[model_key](**_without_auto(values, strict))
        except pydantic.ValidationError as err:
            for e in err.errors():
                loc = ".".join(str(p) for p in e["loc"])
                problems.append(f"deepspeed.{key}.{loc}: {_message(e)} (got {short(e.get('input'))})")
        except (TypeError, ValueError, AssertionError) as err:
            problems.append(f"deepspeed.{key}: {err}")
    return _dedupe(problems)


def _live_model(spec: dict) -> type:
    return getattr(importlib.import_module(spec["module"]), spec["class"])


_MIRRORS: dict[tuple, dict] = {}


def _mirrored(known: dict) -> dict[str, type]:
    """The learned models rebuilt as pydantic models (once per process and DeepSpeed)."""
    key = (known["deepspeed"], known["digest"])
    if key not in _MIRRORS:
        from .spec import mirror_models
        _MIRRORS[key] = mirror_models(known["models"])
    return _MIRRORS[key]


def _without_auto(values: dict, strict: bool) -> dict:
    """What DeepSpeedConfigModel.__init__ does before validating: without strict, "auto" values are left out."""
    return values if strict else {k: v for k, v in values.items() if v != "auto" or k == "replace_method"}


def _non_finite(value, path: str) -> list[str]:
    """inf/nan anywhere: DeepSpeed's JSON (and the exported file) cannot hold them."""
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{path}: {value} is not a finite number (JSON has no inf/nan); write a number"]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _non_finite(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _non_finite(v, f"{path}[{i}]")]
    return []


def _deprecated_keys(block: dict, model_key: str, path: str, models: dict) -> list[str]:
    """Keys DeepSpeed still honours with only a deprecation warning (zero_optimization.cpu_offload, ...): the
    trainer's offload rules, the planner and the linter read the new keys, so the old ones are refused."""
    spec = models[model_key]
    problems = []
    for name in sorted(_deprecated_names(spec) & set(block)):
        new = spec["fields"][name]["deprecated"]["new_param"] or "its replacement"
        example = {"cpu_offload": " (e.g. offload_optimizer: {device: cpu})",
                   "cpu_offload_param": " (e.g. offload_param: {device: cpu})"}.get(name, "")
        problems.append(f"deepspeed.{path}.{name}: deprecated; DeepSpeed 0.19.8 still honours it with only a "
                        f"warning, and the trainer's checks read {new}: write {new} instead{example}")
    for sub, sub_model in _nested(spec, block):
        problems += _deprecated_keys(block[sub], sub_model, f"{path}.{sub}", models)
    return problems


def _deprecated_names(spec: dict) -> set[str]:
    return {name for name, field in spec["fields"].items() if field.get("deprecated")}


def _nested(spec: dict, block: dict) -> list[tuple[str, str]]:
    """(key in `block`, model key) for each mapping in `block` that a nested model of `spec` reads."""
    found = []
    for name, field in spec["fields"].items():
        kinds = field["type"].get("of", []) if field["type"]["kind"] == "union" else [field["type"]]
        model = next((k["model"] for k in kinds if k["kind"] == "model"), None)
        for key in dict.fromkeys((name, field.get("alias") or name)):
            if model and isinstance(block.get(key), dict):
                found.append((key, model))
    return found


def _message(error: dict) -> str:
    """pydantic's message, with an enum's repeated values said once ("0, 1, 2, 3 or 3": an alias member)."""
    expected = (error.get("ctx") or {}).get("expected")
    if error.get("type") == "enum" and isinstance(expected, str):
        values = list(dict.fromkeys(v.strip() for v in re.split(r",| or ", expected) if v.strip()))
        return f"Input should be {', '.join(values[:-1])} or {values[-1]}" if len(values) > 1 else error["msg"]
    return error["msg"]


def _unknown_model_keys(block: dict, model_key: str, path: str, models: dict) -> list[str]:
    """Unknown keys with a 'did you mean' (pydantic says only 'extra inputs are not permitted')."""
    spec = models[model_key]
    valid = _model_keys(spec)
    problems = [f"deepspeed.{path}.{k}: not a DeepSpeed key{closest(k, valid)}" for k in block if k not in valid]
    for sub, sub_model in _nested(spec, block):
        problems += _unknown_model_keys(block[sub], sub_model, f"{path}.{sub}", models)
    return problems


def _model_keys(spec: dict) -> set[str]:
    return {key for name, field in spec["fields"].items() for key in (name, field.get("alias") or name)}


def _dedupe(items: list[str]) -> list[str]:
    seen, out = set(), []
    for item in items:
        head = item.split(":")[0]
        if head not in seen:
            seen.add(head)
            out.append(item)
    return out


def _check_optimizer(ds: dict, optimizers: list[str]) -> list[str]:
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
    elif name not in optimizers:
        problems.append(f"deepspeed.optimizer.type: unknown optimizer {opt.get('type')!r}"
                        f"{closest(name, optimizers)}; DeepSpeed has {', '.join(optimizers)}")
    elif name in ("adam", "adamw"):
        for key in (opt.get("params") or {}):
            if key not in ADAM_PARAMS:
                problems.append(f"deepspeed.optimizer.params.{key}: not an Adam parameter{closest(key, ADAM_PARAMS)}")
    return problems


def _check_scheduler(ds: dict, schedulers: dict[str, dict[str, str | None]], typed: bool, live: bool) -> list[str]:
    sched = ds.get("scheduler")
    if sched is None:
        return []
    if not isinstance(sched, dict):
        return [f"deepspeed.scheduler: expected a mapping with 'type' and 'params', got {sched!r}"]
    name = sched.get("type")
    if name not in list(schedulers):  # a list: `type` may be any YAML value, a mapping too
        return [f"deepspeed.scheduler.type: unknown scheduler {name!r}"
                f"{closest(str(name), schedulers)}; DeepSpeed has {', '.join(schedulers)}"]
    accepted = set(schedulers[name])
    if not isinstance(sched.get("params", {}), dict):
        return [f"deepspeed.scheduler.params: expected a mapping of {name} parameters, got {sched['params']!r}"]
    params = sched.get("params") or {}
    problems = [f"deepspeed.scheduler.params.{key}: not a {name} parameter{closest(key, accepted)}"
                for key in params if key not in accepted]
    for key, value in params.items():
        kind = schedulers[name].get(key)
        if kind and value is not None and (typed or value != AUTO) and not _scheduler_value_fits(kind, value):
            problems.append(f"deepspeed.scheduler.params.{key}: {short(value)} {KIND_TESTS[kind][1]} ({name}'s "
                            f"{key})")
    if live and typed and not problems:
        problems += _construct_scheduler(name, params)
    return problems


def _scheduler_value_fits(kind: str, value) -> bool:
    """A learning-rate or momentum bound may also be one value per parameter group (DeepSpeed's _format_param)."""
    test = KIND_TESTS[kind][0]
    return test(value) or (kind == "number" and isinstance(value, list) and bool(value) and all(map(test, value)))


def _construct_scheduler(name: str, params: dict) -> list[str]:
    """DeepSpeed's schedulers check their arguments when built (warmup_num_steps must be a positive integer,
    cycle_first_step_size positive, ...), which the engine does only after the model and data are built. Where
    DeepSpeed (so torch) is imported anyway, build the scheduler here, over a one-parameter optimizer, and report
    what it refuses."""
    import torch
    from deepspeed.runtime import lr_schedules
    from deepspeed.utils import logger
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3, momentum=0.9)
    level = logger.level
    logger.setLevel(logging.ERROR)  # the throw-away build's warnings ("... before it has started") are not the user's
    try:
        getattr(lr_schedules, name)(optimizer, **params)
    except (ValueError, TypeError, AssertionError) as err:
        return [f"deepspeed.scheduler.params: DeepSpeed's {name} refuses these parameters: {err}"]
    finally:
        logger.setLevel(level)
    return []
