"""What the installed DeepSpeed reads in a config, learned from that DeepSpeed once and kept on disk.

The light commands (show, export, plan, lint, doctor, launch --dry-run) check DeepSpeed keys and values without
importing DeepSpeed (and torch, which it imports: seconds per command). What they need - the top-level keys, the
keys of the blocks DeepSpeed parses by hand, its pydantic models as JSON (trainer/ds/spec.py), removed keys and
their messages, optimizer and scheduler names - is learned from DeepSpeed itself, in a subprocess (or in this
process when DeepSpeed is imported already), and written to
`$XDG_CACHE_HOME/deepspeed-preset-trainer/deepspeed-config/<version>-<digest>.json`.

The file's name holds DeepSpeed's version and a digest of the DeepSpeed files the facts come from, found without
importing DeepSpeed; inside, the digest of every file learned from (nested models' modules too) is checked again on
reading. A file that does not parse, was learned from other files, by another trainer schema or pydantic, or that
another user could have written, is ignored and learned again: it only ever speeds things up.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import UserError

SCHEMA = 4  # bump when what is learned, or how, changes

# Top-level blocks DeepSpeed parses with pydantic models (which also check types and ranges): block -> class
BLOCK_MODELS = {
    "zero_optimization": "deepspeed.runtime.zero.config.DeepSpeedZeroConfig",
    "bf16": "deepspeed.runtime.precision_config.DeepSpeedBF16Config",
    "fp16": "deepspeed.runtime.precision_config.DeepSpeedFP16Config",
    "tensor_parallel": "deepspeed.runtime.tensor_parallel.config.TPTrainingConfig",
    "comms_logger": "deepspeed.comm.config.CommsLoggerConfig",
    "compile": "deepspeed.compile.config.CompileConfig",
    "wandb": "deepspeed.monitor.config.WandbConfig",
    "tensorboard": "deepspeed.monitor.config.TensorBoardConfig",
    "csv_monitor": "deepspeed.monitor.config.CSVConfig",
    "comet": "deepspeed.monitor.config.CometConfig",
    "hybrid_engine": "deepspeed.runtime.config.HybridEngineConfig",
}
# Dict-parsed blocks whose keys we learn by watching DeepSpeed parse (DeepSpeed ignores typos in these).
DICT_BLOCKS = ("activation_checkpointing", "aio", "flops_profiler", "data_types", "checkpoint", "autotuning",
               "torch_autocast", "expert_parallel")
# What a block must hold for DeepSpeed to read its keys at all: AutoEP's parser returns at once for an empty block
PROBE_BLOCKS = {"expert_parallel": {"enabled": False}}
# Modules read besides the models': the config parser (keys, removed keys, optimizers) and the schedulers
OTHER_MODULES = ("deepspeed.runtime.config", "deepspeed.runtime.config_utils", "deepspeed.runtime.lr_schedules",
                 "deepspeed.runtime.constants", "deepspeed.runtime.zero.offload_config",
                 "deepspeed.module_inject.auto_ep_config")


# --- where, and for which DeepSpeed -------------------------------------------------------------------------

def deepspeed_root() -> Path:
    """The installed deepspeed package's directory (found, not imported)."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("DeepSpeed is not installed in this Python environment (`pip install deepspeed`, or "
                        "scripts/setup.sh); the trainer checks configs against it")
    return Path(list(spec.submodule_search_locations)[0])


def module_file(root: Path, module: str) -> Path:
    relative = Path(*module.split(".")[1:])
    package = root / relative / "__init__.py"
    return package if package.is_file() else root / relative.with_suffix(".py")


def file_digests(root: Path, relatives: list[str]) -> dict[str, str]:
    """sha256 of each file (relative to the deepspeed package); a missing file is "missing"."""
    digests = {}
    for relative in sorted(set(relatives)):
        try:
            digests[relative] = hashlib.sha256((root / relative).read_bytes()).hexdigest()
        except OSError:
            digests[relative] = "missing"
    return digests


def key_files(root: Path) -> list[str]:
    """The files the cache's name is keyed by: the block models' modules and OTHER_MODULES."""
    modules = {path.rsplit(".", 1)[0] for path in BLOCK_MODELS.values()} | set(OTHER_MODULES)
    return [str(module_file(root, m).relative_to(root)) for m in sorted(modules)]


def identity() -> dict:
    """DeepSpeed's version and the digest of its key files, pydantic's version and our schema: what a cache
    file must have been learned from."""
    root = deepspeed_root()
    digest = hashlib.sha256(json.dumps(file_digests(root, key_files(root)), sort_keys=True).encode()).hexdigest()
    return {"schema": SCHEMA, "deepspeed": _version("deepspeed"), "pydantic": _version("pydantic"),
            "digest": digest[:16]}


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "deepspeed-preset-trainer" / "deepspeed-config"


def cache_path(ident: dict) -> Path:
    safe = "".join(c if c.isalnum() or c in "._+-" else "_" for c in ident["deepspeed"])
    # the schema in the name too: two trainer checkouts of different schemas (a branch and main) each keep theirs
    # rather than relearning over each other's file at every command
    return cache_dir() / f"{safe}-{ident['digest']}-s{ident['schema']}.json"


# --- the facts ----------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def facts() -> dict:
    """The learned facts about the installed DeepSpeed: from the cache, else learned (and cached)."""
    ident = identity()
    path = cache_path(ident)
    cached = read_cache(path, ident)
    if cached is not None:
        return cached
    learned = learn() if "deepspeed" in sys.modules else learn_in_subprocess()
    learned = {**learned, **ident}
    write_cache(path, learned)
    return learned


def read_cache(path: Path, ident: dict) -> dict | None:
    """The cached facts, or None when the file is missing, damaged, foreign or learned from other files."""
    try:
        info = path.stat()
        if info.st_uid != os.getuid() or info.st_mode & 0o022:  # someone else could have chosen what we accept
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or any(data.get(k) != v for k, v in ident.items()):
            return None
        if file_digests(deepspeed_root(), list(data["files"])) != data["files"]:
            return None
        _check_shape(data)
        return data
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _check_shape(data: dict) -> None:
    """Raise (TypeError, KeyError) unless `data` has every part, of the right kind, that check.py reads."""
    kinds = {"top_keys": list, "dict_blocks": dict, "removed_top": dict, "removed_zero": dict, "models": dict,
             "blocks": dict, "optimizers": list, "schedulers": dict, "value_kinds": dict, "files": dict}
    for name, kind in kinds.items():
        if not isinstance(data[name], kind):
            raise TypeError(name)
    for block, model in data["blocks"].items():
        if not isinstance(data["models"][model]["fields"], dict):
            raise TypeError(block)


def write_cache(path: Path, data: dict) -> None:
    """Write atomically (a reader sees the old file or the new one); a cache that cannot be written is skipped."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(data, handle)  # in DeepSpeed's order: messages list names as it does
            os.replace(tmp, path)  # mkstemp's 0600: only this user reads or writes it
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass


def learn_in_subprocess() -> dict:
    """Learn in a child process, so this one never imports DeepSpeed (nor torch)."""
    with tempfile.TemporaryDirectory(prefix="trainer-learn-") as tmp:
        out = Path(tmp) / "facts.json"
        package_parent = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_parent,
                                                                         os.environ.get("PYTHONPATH")]))}
        try:
            child = subprocess.run([sys.executable, "-c", "import sys, trainer.ds.learned as l; l.main(sys.argv[1])",
                                    str(out)], env=env, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            raise UserError("learning the installed DeepSpeed's config keys took over 10 minutes (importing it "
                            "hangs?); run `python -c 'import deepspeed'` to see why") from None
        if child.returncode != 0 or not out.is_file():
            tail = "\n".join((child.stderr or child.stdout).strip().splitlines()[-3:])
            raise UserError(f"could not learn the installed DeepSpeed's config keys: importing DeepSpeed failed "
                            f"(exit {child.returncode}):\n{tail}")
        return json.loads(out.read_text(encoding="utf-8"))


def main(out: str) -> None:
    """The child of `learn_in_subprocess`: learn and write the facts to `out`."""
    import contextlib
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout when imported
        data = learn()
    Path(out).write_text(json.dumps(data), encoding="utf-8")


def learn() -> dict:
    """Everything check.py needs, read from the DeepSpeed that is installed (imports it)."""
    import importlib

    from deepspeed.runtime import lr_schedules
    from deepspeed.runtime.config import (
        _REMOVED_TOP_LEVEL_CONFIG_KEYS, _REMOVED_ZERO_CONFIG_KEYS, DEEPSPEED_OPTIMIZERS,
    )

    from .spec import model_spec
    models: dict[str, dict] = {}
    blocks = {}
    for block, path in BLOCK_MODELS.items():
        module, name = path.rsplit(".", 1)
        blocks[block] = model_spec(getattr(importlib.import_module(module), name), models)
    top, dict_blocks, defaults = probe_dict_keys()
    root = deepspeed_root()
    modules = {m["module"] for m in models.values()} | set(OTHER_MODULES)
    files = [str(module_file(root, m).relative_to(root)) for m in modules]
    return {
        "top_keys": sorted((top - set(_REMOVED_TOP_LEVEL_CONFIG_KEYS)) | set(BLOCK_MODELS)),
        "dict_blocks": {b: sorted(keys) for b, keys in dict_blocks.items()},
        "removed_top": dict(_REMOVED_TOP_LEVEL_CONFIG_KEYS), "removed_zero": dict(_REMOVED_ZERO_CONFIG_KEYS),
        "models": models, "blocks": blocks,
        "optimizers": list(DEEPSPEED_OPTIMIZERS),
        "value_kinds": value_kinds(defaults, set(BLOCK_MODELS)),
        "schedulers": {name: scheduler_parameters(getattr(lr_schedules, name))
                       for name in lr_schedules.VALID_LR_SCHEDULES},
        "files": file_digests(root, files + key_files(root)),
    }


def probe_dict_keys() -> tuple[set, dict, dict]:
    """Parse a config with DeepSpeedConfig and record which keys it looks up and the default it reads for each:
    (top-level keys, block -> keys, key path -> default)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    from .probe import RecordingDict
    seen: set = set()
    defaults: dict = {}
    # micro x accum without train_batch_size: valid at any world size, also inside a running job
    blocks = {b: dict(PROBE_BLOCKS.get(b, {})) for b in DICT_BLOCKS}
    probe = RecordingDict({**blocks, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}, seen=seen,
                          defaults=defaults)
    with one_rank_process_group():
        DeepSpeedConfig(probe)
    top = {k[0] for k in seen if len(k) == 1}
    blocks = {b: {k[1] for k in seen if len(k) == 2 and k[0] == b} for b in DICT_BLOCKS}
    return top, blocks, defaults


# Keys whose default is None (no type to learn from it), typed by what DeepSpeed's code then does with a value:
# path -> (kind, where DeepSpeed 0.19.8 uses it). Only keys DeepSpeed uses as one type, and only that type.
NONE_DEFAULT_KINDS = {
    "steps_per_print": ("int", "engine.py: (global_steps + 1) % steps_per_print"),
    "activation_checkpointing.number_checkpoints": ("int", "checkpointing.py: a count of layers"),
    "flops_profiler.output_file": ("str", "profiler.py: open(output_file, 'w')"),
}


def value_kinds(defaults: dict, model_blocks: set) -> dict[str, str]:
    """Dotted key path -> the kind of value DeepSpeed reads there ("bool", "int", "number", "str", "mapping",
    "list"), from the default DeepSpeed's parser passes to `dict.get`: DeepSpeed checks none of these values itself,
    so 'false' or 'maybe' for a flag is simply true to it. A default of None says nothing (see NONE_DEFAULT_KINDS),
    nor does "auto" (DeepSpeed fills such a key itself and takes other types too); blocks read by pydantic models
    are typed by their models, not here."""
    kinds = {}
    for path, default in defaults.items():
        kind = None if len(path) == 1 and path[0] in model_blocks else _kind_of(default)
        if kind:
            kinds[".".join(map(str, path))] = kind
    for path, (kind, _) in NONE_DEFAULT_KINDS.items():
        if defaults.get(tuple(path.split(".")), "absent") is None:  # still read, and still without a default
            kinds[path] = kind
    return kinds


def _kind_of(default) -> str | None:
    if isinstance(default, bool):
        return "bool"
    if isinstance(default, int):
        return "int"
    if isinstance(default, float):
        return "number"
    if isinstance(default, str):
        return None if default == "auto" else "str"
    if isinstance(default, dict):
        return "mapping"
    if isinstance(default, (list, tuple)):
        return "list"
    return None


def scheduler_parameters(scheduler: type) -> dict[str, str | None]:
    """A DeepSpeed scheduler's parameters (those a config gives) -> the kind of value it takes: from the literal
    default, else the annotation (WarmupDecayLR's total_num_steps: int), else None (anything)."""
    out = {}
    for name, parameter in inspect.signature(scheduler.__init__).parameters.items():
        if name in ("self", "optimizer", "last_batch_iteration"):
            continue
        kind = _kind_of(parameter.default) if parameter.default is not inspect.Parameter.empty else None
        annotation = {"bool": bool, "int": int, "float": float, "str": str}.get(parameter.annotation,
                                                                                parameter.annotation)
        if kind is None and annotation in (bool, int, float, str):
            kind = _kind_of(annotation())
        out[name] = kind
    return out


@contextlib.contextmanager
def one_rank_process_group():
    """DeepSpeed's config parser reads some keys (sequence_parallel_size) only once it has asked the process group
    for its rank; outside a job that question raises and the keys are never looked up. For the probe the parser
    sees a one-rank group."""
    from deepspeed.runtime import config

    class OneRank:
        @staticmethod
        def get_rank(group=None):
            return 0

        @staticmethod
        def get_world_size(group=None):
            return 1

    real, config.dist = config.dist, OneRank
    try:
        yield
    finally:
        config.dist = real
