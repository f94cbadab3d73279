"""The one module that reads and writes DeepSpeed config keys.

Everything else asks through the accessors below (`zero_stage(ds)`, `offload_param_device(ds)`, ...)
or the builders (`zero_block(...)`), so a DeepSpeed key rename is a change in one file.

Three jobs:
1. Know which keys the installed DeepSpeed reads. Blocks DeepSpeed parses with pydantic models
   (zero_optimization, bf16, fp16, tensor_parallel, monitors, ...) are checked against those models;
   blocks it parses with plain dict lookups (activation_checkpointing, aio, flops_profiler, ...) -
   where DeepSpeed 0.19.8 silently ignores typos - are checked against the keys DeepSpeed is seen
   to look up when it parses a config (`_probe_dict_keys`). Nothing is copied by hand, so the check
   follows whatever DeepSpeed is installed.
2. Fill "auto" the way the HF Trainer does, from the trainer's `train`/`model` sections, and solve
   the batch triad. DeepSpeed itself would silently turn a leftover "auto" into a default.
3. Small, named accessors used by the validation rules (`trainer.rules`), the planner and the loop.
"""
from __future__ import annotations

import copy
import functools
import inspect
import json
from dataclasses import dataclass
from typing import Any, Optional

from .config import AUTO, Config
from .errors import closest

# --- accessors ---------------------------------------------------------------------------------


def zero(ds: dict) -> dict:
    return ds.get("zero_optimization") or {}


def zero_stage(ds: dict) -> int:
    return int(zero(ds).get("stage", 0))


def offload_optimizer_device(ds: dict) -> str:
    """'none', 'cpu' or 'nvme'."""
    return str((zero(ds).get("offload_optimizer") or {}).get("device", "none"))


def offload_param_device(ds: dict) -> str:
    return str((zero(ds).get("offload_param") or {}).get("device", "none"))


def offload_block(ds: dict, which: str) -> dict:
    """`which` is 'offload_optimizer' or 'offload_param'."""
    return zero(ds).get(which) or {}


def nvme_offloads(ds: dict) -> list[tuple[str, Optional[str], int]]:
    """(block name, nvme_path, buffer_count) of each offload block that targets NVMe."""
    out = []
    for which in ("offload_optimizer", "offload_param"):
        block = offload_block(ds, which)
        default_buffers = 4 if which == "offload_optimizer" else 5  # DeepSpeed's defaults
        if block.get("device") == "nvme":
            out.append((which, block.get("nvme_path"), int(block.get("buffer_count", default_buffers))))
    return out


def autotp_size(ds: dict) -> int:
    return int((ds.get("tensor_parallel") or {}).get("autotp_size", 0) or 1)


def bf16_enabled(ds: dict) -> bool:
    return bool((ds.get("bf16") or {}).get("enabled", False))


def fp16_enabled(ds: dict) -> bool:
    return bool((ds.get("fp16") or {}).get("enabled", False))


def precision(ds: dict) -> str:
    return "bf16" if bf16_enabled(ds) else "fp16" if fp16_enabled(ds) else "fp32"


def optimizer_type(ds: dict) -> Optional[str]:
    return (ds.get("optimizer") or {}).get("type")


def scheduler_type(ds: dict) -> Optional[str]:
    return (ds.get("scheduler") or {}).get("type")


def micro_batch_size(ds: dict) -> int:
    return int(ds["train_micro_batch_size_per_gpu"])


def grad_accum_steps(ds: dict) -> int:
    return int(ds["gradient_accumulation_steps"])


def hpz_partition_size(ds: dict) -> int:
    return int(zero(ds).get("zero_hpz_partition_size", 1))


def quantized_weights(ds: dict) -> bool:
    return bool(zero(ds).get("zero_quantized_weights", False))


def quantized_gradients(ds: dict) -> bool:
    return bool(zero(ds).get("zero_quantized_gradients", False))


def gather_16bit_on_save(ds: dict) -> bool:
    z = zero(ds)
    return bool(z.get("stage3_gather_16bit_weights_on_model_save", z.get("gather_16bit_weights_on_model_save", False)))


def has_activation_checkpointing(ds: dict) -> bool:
    return "activation_checkpointing" in ds


def aio_block(ds: dict) -> dict:
    return ds.get("aio") or {}


def without_tensor_parallel(ds: dict) -> dict:
    """The config for transformers' HfDeepSpeedConfig: with the `tensor_parallel` block, transformers 5.x
    refuses sharded loading (NotImplementedError), so it gets the config without it (see notes)."""
    return {k: v for k, v in ds.items() if k != "tensor_parallel"}


# DeepSpeed 0.19.8 defaults of the keys below (runtime/zero/config.py), used when a config omits them.
_ZERO_DEFAULTS = {"reduce_bucket_size": int(5e8), "allgather_bucket_size": int(5e8), "prefetch_bucket_size": int(5e7),
                  "max_live_parameters": int(1e9), "max_reuse_distance": int(1e9),
                  "param_persistence_threshold": int(1e5), "sub_group_size": int(1e9)}
_STAGE3_ALIASED = ("prefetch_bucket_size", "max_live_parameters", "max_reuse_distance", "param_persistence_threshold",
                   "gather_16bit_weights_on_model_save")


def zero_key(ds: dict, name: str) -> str:
    """The spelling of a ZeRO key this config uses: stage-3 keys have a `stage3_` alias, and giving both is an
    error, so an override must reuse whichever is present (the prefixed one when neither is)."""
    if name not in _STAGE3_ALIASED:
        return name
    return name if name in zero(ds) else f"stage3_{name}"


def zero_setting(ds: dict, name: str):
    """A ZeRO setting (either spelling), or DeepSpeed's default."""
    z = zero(ds)
    for key in (name, f"stage3_{name}"):
        if key in z and z[key] != AUTO:
            return z[key]
    return _ZERO_DEFAULTS.get(name)


def overlap_comm(ds: dict) -> bool:
    """DeepSpeed's default is on at stage 3 only."""
    return bool(zero(ds).get("overlap_comm", zero_stage(ds) == 3))


def contiguous_gradients(ds: dict) -> bool:
    return bool(zero(ds).get("contiguous_gradients", True))


def offload_pin_memory(ds: dict, which: str) -> bool:
    return bool(offload_block(ds, which).get("pin_memory", False))


def nvme_pipelined(ds: dict) -> bool:
    """Whether optimizer NVMe swaps overlap with compute (pipeline_read and pipeline_write)."""
    block = offload_block(ds, "offload_optimizer")
    return bool(block.get("pipeline_read", False)) and bool(block.get("pipeline_write", False))


def fp16_min_loss_scale(ds: dict) -> float:
    return float((ds.get("fp16") or {}).get("min_loss_scale", 1))


def forces_ds_cpu_optimizer(ds: dict) -> bool:
    """DeepSpeed insists on DeepSpeedCPUAdam for CPU offload unless this is turned off."""
    return bool(ds.get("zero_force_ds_cpu_optimizer", True))


# --- builders (the planner writes configs through these) -------------------------------------


def zero_block(stage: int, offload_optimizer: str = "none", offload_param: str = "none",
               nvme_path: Optional[str] = None) -> dict:
    """A `zero_optimization` block with the seed's recommended settings for that stage and offload."""
    block: dict[str, Any] = {"stage": stage, "contiguous_gradients": True, "overlap_comm": True}
    if stage in (1, 2):
        block.update(reduce_scatter=True, reduce_bucket_size=AUTO, allgather_bucket_size=5e8)
    if stage == 3:
        block.update(reduce_bucket_size=AUTO, stage3_prefetch_bucket_size=AUTO,
                     stage3_param_persistence_threshold=AUTO, stage3_gather_16bit_weights_on_model_save=True)
    if offload_optimizer != "none":
        block["offload_optimizer"] = _offload(offload_optimizer, nvme_path, buffer_count=4)
        if offload_optimizer == "nvme":
            block["offload_optimizer"].update(pipeline_read=True, pipeline_write=True, fast_init=True)
        if stage in (1, 2):
            block["round_robin_gradients"] = True
    if offload_param != "none":
        block["offload_param"] = _offload(offload_param, nvme_path, buffer_count=5)
    if "nvme" in (offload_optimizer, offload_param):
        block["sub_group_size"] = 1e9
    return block


def _offload(device: str, nvme_path: Optional[str], buffer_count: int) -> dict:
    block: dict[str, Any] = {"device": device, "pin_memory": True}
    if device == "nvme":
        block.update(nvme_path=nvme_path or "/local_nvme", buffer_count=buffer_count)
    return block


def aio_defaults() -> dict:
    """The seed's aio block with 0.19.8 key names (`thread_count` is `intra_op_parallelism` now)."""
    return {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1,
            "single_submit": False, "overlap_events": True}


def base_config(stage: int, offload_optimizer: str = "none", offload_param: str = "none",
                nvme_path: Optional[str] = None, precision_name: str = "bf16",
                activation_checkpointing: bool = False) -> dict:
    """A complete DeepSpeed config skeleton ("auto" batch/optimizer values, filled by `fill_auto`)."""
    ds: dict[str, Any] = {
        "train_batch_size": AUTO, "train_micro_batch_size_per_gpu": AUTO, "gradient_accumulation_steps": AUTO,
        "gradient_clipping": AUTO,
        "zero_optimization": zero_block(stage, offload_optimizer, offload_param, nvme_path),
        "optimizer": {"type": "AdamW", "params": {"lr": AUTO, "betas": AUTO, "eps": AUTO, "weight_decay": AUTO}},
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": AUTO, "warmup_max_lr": AUTO,
                                                          "warmup_num_steps": AUTO, "total_num_steps": AUTO}},
    }
    if precision_name == "bf16":
        ds["bf16"] = {"enabled": True}
    elif precision_name == "fp16":
        ds["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                      "hysteresis": 2, "min_loss_scale": 1}
    if "nvme" in (offload_optimizer, offload_param):
        ds["aio"] = aio_defaults()
    if activation_checkpointing:
        ds["activation_checkpointing"] = {"partition_activations": False, "cpu_checkpointing": False}
    return ds


def with_zeropp(ds: dict, hpz_partition_size: int, quantized_weights: bool = True,
                quantized_gradients: bool = True) -> dict:
    """A copy with ZeRO++ on (stage 3 only in 0.19.8): hpZ keeps a node-local secondary copy of the params so
    forward/backward all-gathers stay inside the node; weights and gradients cross nodes quantized."""
    ds = copy.deepcopy(ds)
    ds["zero_optimization"].update(zero_hpz_partition_size=hpz_partition_size,
                                   zero_quantized_weights=quantized_weights,
                                   zero_quantized_gradients=quantized_gradients)
    return ds


# --- `--set` overrides (the planner's launch line and the doctor's proposals) ------------------

_ZERO_SWITCHES = ("stage", "round_robin_gradients", "sub_group_size", "zero_hpz_partition_size",
                  "zero_quantized_weights", "zero_quantized_gradients")


def set_override(path: str, value: Any) -> str:
    """`deepspeed.PATH=VALUE` for `--set` (JSON is YAML flow syntax; null deletes the key)."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"deepspeed.{path}={json.dumps(value)}"


def zero_overrides(current: dict, target: dict) -> list[str]:
    """Overrides that move `current`'s stage, offload devices, round-robin and ZeRO++ settings to `target`'s.

    Tuned fields of an offload block that keeps its device are left alone; keys that would be errors or
    silently ignored after the move (round_robin at stage 3, ZeRO++ below 3, offload_param below 3) are removed."""
    cz, tz = zero(current), zero(target)
    out = []
    for key in _ZERO_SWITCHES:
        if key in tz and cz.get(key) != tz[key]:
            out.append(set_override(f"zero_optimization.{key}", tz[key]))
        elif key not in tz and key in cz and key != "sub_group_size":
            out.append(set_override(f"zero_optimization.{key}", None))
    for which in ("offload_optimizer", "offload_param"):
        now = (cz.get(which) or {}).get("device", "none")
        want = (tz.get(which) or {}).get("device", "none")
        if want == "none" and which in cz:
            out.append(set_override(f"zero_optimization.{which}", None))
        elif want != now:
            out.append(set_override(f"zero_optimization.{which}", tz[which]))
    if "aio" in target and "aio" not in current:
        out.append(set_override("aio", target["aio"]))
    return out


def precision_overrides(current: dict, precision_name: str) -> list[str]:
    """Overrides that make the bf16/fp16 blocks follow `train.precision=precision_name` (set that too)."""
    if precision(current) == precision_name:
        return []
    out = []
    for block in ("bf16", "fp16"):
        if block != precision_name and block in current:
            out.append(set_override(block, None))
    if precision_name == "bf16":
        out.append(set_override("bf16", {"enabled": AUTO}))
    elif precision_name == "fp16":
        fp16 = base_config(0, precision_name="fp16")["fp16"]
        out.append(set_override("fp16", {**fp16, "enabled": AUTO}))
    return out


def activation_checkpointing_overrides(current: dict, enabled: bool) -> list[str]:
    """The DeepSpeed block is only meaningful with model.gradient_checkpointing; drop it when that goes off."""
    if not enabled and has_activation_checkpointing(current):
        return [set_override("activation_checkpointing", None)]
    return []


def gather_on_save_override(current: dict) -> str:
    return set_override(f"zero_optimization.{zero_key(current, 'gather_16bit_weights_on_model_save')}", True)


def min_loss_scale_override(value: float) -> str:
    return set_override("fp16.min_loss_scale", value)


def torch_adam_on_cpu_overrides() -> list[str]:
    """Offload with torch's AdamW on the CPU instead of the compiled DeepSpeedCPUAdam (5-7x slower step)."""
    return [set_override("zero_force_ds_cpu_optimizer", False), set_override("optimizer.params.torch_adam", True)]


# Stage-3 buffers the OOM ladder shrinks, with the floor below which halving stops paying.
_STAGE3_BUFFER_FLOORS = {"prefetch_bucket_size": int(1e7), "max_live_parameters": int(1e8),
                         "max_reuse_distance": int(1e8)}


def smaller_stage3_buffers(current: dict) -> list[str]:
    """Halve the stage-3 prefetch bucket, live-parameter and reuse-distance limits (never below a floor)."""
    out = []
    for name, floor in _STAGE3_BUFFER_FLOORS.items():
        value = int(zero_setting(current, name))
        if value > floor:
            out.append(set_override(f"zero_optimization.{zero_key(current, name)}", max(floor, value // 2)))
    return out


# --- "auto" filling and the batch triad --------------------------------------------------------


@dataclass(frozen=True)
class Batch:
    micro_batch_size: int
    grad_accum: int
    global_batch_size: int   # sequences per optimizer step = micro x accum x data-parallel size
    world_size: int
    data_parallel_size: int  # world / autotp_size

    @property
    def deepspeed_train_batch_size(self) -> int:
        """DeepSpeed 0.19.8 checks its triad against the *global* world size, even under AutoTP."""
        return self.micro_batch_size * self.grad_accum * self.world_size


def solve_batch(cfg: Config, world_size: int, problems: list[str]) -> Optional[Batch]:
    """Solve micro x accum x dp = global from any two of them (train section or DeepSpeed keys)."""
    ds, train = cfg.deepspeed, cfg.train
    tp_value = (ds.get("tensor_parallel") or {}).get("autotp_size", 0)
    if isinstance(tp_value, bool) or not isinstance(tp_value, int) or tp_value < 0:
        problems.append(f"deepspeed.tensor_parallel.autotp_size: {tp_value!r} must be a whole number of ranks "
                        f"(0 or 1 = no tensor parallelism; 'auto' has no rule to fill it)")
        return None
    tp = autotp_size(ds)
    if world_size % tp:
        problems.append(f"deepspeed.tensor_parallel.autotp_size={tp} must divide the world size {world_size}: "
                        f"choose a divisor of {world_size} (normally the GPUs per node)")
        return None
    dp = world_size // tp
    micro = _merge_batch_value(train.micro_batch_size, ds.get("train_micro_batch_size_per_gpu"),
                               "train.micro_batch_size", "train_micro_batch_size_per_gpu", problems)
    accum = _merge_batch_value(train.grad_accum, ds.get("gradient_accumulation_steps"),
                               "train.grad_accum", "gradient_accumulation_steps", problems)
    ds_global = ds.get("train_batch_size")
    ds_global_key = "train_batch_size"
    if isinstance(ds_global, (int, float)) and not isinstance(ds_global, bool) and tp > 1:
        if ds_global % tp:
            problems.append(f"deepspeed.train_batch_size={ds_global} must be a multiple of autotp_size {tp}: under "
                            f"AutoTP DeepSpeed counts every rank, train_batch_size = micro x accum x world size "
                            f"{world_size}")
            return None
        ds_global = ds_global // tp  # DeepSpeed's number counts TP replicas; ours counts distinct samples
        ds_global_key = "train_batch_size/autotp_size"
    total = _merge_batch_value(train.global_batch_size, ds_global,
                               "train.global_batch_size", ds_global_key, problems)
    if None in (micro, accum, total) and [micro, accum, total].count(None) >= 2:
        accum = accum or 1  # DeepSpeed's own rule when fewer than two are given
    if micro is None and total is None:
        micro = 1
    if total is None:
        total = micro * accum * dp
    elif micro is None:
        micro = total // (accum * dp)
    elif accum is None:
        accum = total // (micro * dp)
    if min(micro, accum, total) < 1 or micro * accum * dp != total:
        problems.append(
            f"batch triad inconsistent: global_batch_size {total} != micro_batch_size {micro} x grad_accum {accum} "
            f"x data-parallel size {dp} (world size {world_size}, autotp_size {tp}); "
            f"give two of the three and the third is solved, or make them agree")
        return None
    return Batch(micro, accum, total, world_size, dp)


def _merge_batch_value(train_value, ds_value, train_key: str, ds_key: str, problems: list[str]) -> Optional[int]:
    values = {}
    for key, value in ((train_key, train_value), (f"deepspeed.{ds_key}", ds_value)):
        if value is None or value == AUTO:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
            problems.append(f"{key}: {value!r} must be a positive integer or 'auto'")
            continue
        values[key] = int(value)
    if len(set(values.values())) > 1:
        problems.append(f"{' and '.join(f'{k}={v}' for k, v in values.items())} disagree: set one, or make them equal")
    return next(iter(values.values()), None)


def fill_auto(cfg: Config, batch: Batch, problems: list[str]) -> dict:
    """A copy of cfg.deepspeed with every "auto" filled (HF Trainer semantics) and no "auto" left."""
    ds = copy.deepcopy(cfg.deepspeed)
    train, hidden = cfg.train, cfg.model.hidden_size
    ds["train_micro_batch_size_per_gpu"] = batch.micro_batch_size
    ds["gradient_accumulation_steps"] = batch.grad_accum
    ds["train_batch_size"] = batch.deepspeed_train_batch_size
    _fill(ds, "gradient_clipping", train.grad_clip, problems)
    for block, enabled in (("bf16", train.precision == "bf16"), ("fp16", train.precision == "fp16")):
        if block in ds:
            _fill(ds[block], "enabled", enabled, problems, f"{block}.")
    if train.precision != "fp32" and "enabled" not in (ds.get(train.precision) or {}):
        problems.append(f"train.precision={train.precision} but deepspeed has no '{train.precision}.enabled', so "
                        f"DeepSpeed would silently train in fp32: add deepspeed.{train.precision}: {{enabled: auto}}"
                        + (" with the loss-scaling keys (as in preset 7b_2xv100)" if train.precision == "fp16" else "")
                        + " or set train.precision=fp32")
    opt = (ds.get("optimizer") or {}).get("params")
    if isinstance(opt, dict):
        for key, value in (("lr", train.lr), ("betas", list(train.betas)), ("eps", train.eps),
                           ("weight_decay", train.weight_decay)):
            _fill(opt, key, value, problems, "optimizer.params.")
    sched = (ds.get("scheduler") or {}).get("params")
    if isinstance(sched, dict):
        for key, value in (("warmup_max_lr", train.lr), ("warmup_num_steps", train.warmup_steps),
                           ("total_num_steps", train.max_steps),
                           ("cos_min_ratio", train.min_lr / train.lr if train.lr else 0.0)):
            _fill(sched, key, value, problems, "scheduler.params.")
        for key in ("warmup_min_lr", "warmup_min_ratio"):  # no trainer counterpart: 'auto' means start at 0
            _fill(sched, key, 0.0, problems, "scheduler.params.", mirrors_trainer=False)
    z = ds.get("zero_optimization")
    if isinstance(z, dict):
        for key, value in (("reduce_bucket_size", hidden * hidden),
                           ("stage3_prefetch_bucket_size", int(0.9 * hidden * hidden)),
                           ("stage3_param_persistence_threshold", 10 * hidden)):
            _fill(z, key, value, problems, "zero_optimization.", mirrors_trainer=False)
    for path in find_auto(ds):
        problems.append(f"deepspeed.{path}: 'auto' has no rule to fill it; give a value "
                        f"(DeepSpeed would silently use its default)")
    return ds


def _fill(block: dict, key: str, value, problems: list[str], prefix: str = "", mirrors_trainer: bool = True) -> None:
    """Fill block[key] when it is "auto". When the key mirrors a trainer setting (lr, clipping, ...) an
    explicit value that disagrees is an error, as in the HF Trainer: two sources of truth must agree."""
    if key not in block:
        return
    if block[key] == AUTO:
        block[key] = value
    elif mirrors_trainer and _differs(block[key], value):
        problems.append(f"deepspeed.{prefix}{key}={block[key]!r} disagrees with the trainer's value {value!r}; "
                        f"use 'auto' (filled from the train/model sections) or make them equal")


def _differs(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a != b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(a - b) > 1e-12 * max(abs(a), abs(b), 1)
    return a != b


def find_auto(node: Any, path: str = "") -> list[str]:
    """Dotted paths of every "auto" left in a nested config."""
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in find_auto(v, f"{path}.{k}" if path else str(k))]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in find_auto(v, f"{path}[{i}]")]
    return [path] if node == AUTO else []


# --- key checking against the installed DeepSpeed --------------------------------------------

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
    from deepspeed.runtime.config import DeepSpeedConfig, _REMOVED_TOP_LEVEL_CONFIG_KEYS
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
        if key == "zero_optimization":
            problems += _unknown_model_keys(block, model, "zero_optimization")
        else:
            problems += _unknown_model_keys_flat(block, model, key)
        try:
            model(strict=strict, **block)  # DeepSpeedConfigModel: strict=False drops "auto" values
        except pydantic.ValidationError as err:
            for e in err.errors():
                loc = ".".join(str(p) for p in e["loc"])
                problems.append(f"deepspeed.{key}.{loc}: {e['msg']} (got {e.get('input')!r})")
        except (TypeError, ValueError, AssertionError) as err:
            problems.append(f"deepspeed.{key}: {err}")
    return _dedupe(problems)


def _unknown_model_keys(block: dict, model, path: str) -> list[str]:
    """Unknown keys with a 'did you mean' (pydantic says only 'extra inputs are not permitted')."""
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                       DeepSpeedZeroOffloadParamConfig)
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


# --- rehearsal: the preset's DeepSpeed features on a toy model and the ranks present -------------


def rehearsal_changes(ds: dict, world_size: int, nvme_dir: str, on_cpu: bool) -> tuple[dict, list[str]]:
    """What must change for a CPU/laptop rehearsal, each with a one-line notice. Features stay on; only
    what the present hardware cannot do (or would need GBs for) is swapped."""
    ds = copy.deepcopy(ds)
    notices = []
    z = ds.get("zero_optimization") or {}
    for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
        if key in z and z[key] != AUTO:
            z[key] = AUTO  # 5e8-element buckets would allocate GBs for a toy model
            notices.append(f"zero_optimization.{key} -> 'auto' (sized for the shrunk model)")
    if "allgather_bucket_size" in z:
        z["allgather_bucket_size"] = 2e6
    for which in ("offload_optimizer", "offload_param"):
        block = z.get(which) or {}
        if block.get("device") == "nvme":
            block["nvme_path"] = nvme_dir
            notices.append(f"{which}.nvme_path -> {nvme_dir} (local directory)")
        if which == "offload_param" and "buffer_size" in block:
            block["buffer_size"] = 1e7
    tp = ds.get("tensor_parallel") or {}
    if tp.get("autotp_size", 0) > 1 and world_size % tp["autotp_size"]:
        tp["autotp_size"] = world_size
        notices.append(f"tensor_parallel.autotp_size -> {world_size} (ranks present)")
    if on_cpu:
        if quantized_weights(ds):
            z["zero_quantized_weights"] = False
            notices.append("zero_quantized_weights -> off (not implemented on DeepSpeed's CPU backend)")
        for block in ("bf16", "fp16"):
            if block in ds:
                ds[block]["enabled"] = AUTO  # filled from train.precision, which the rehearsal sets to fp32
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if key in ds:
            ds[key] = AUTO  # solved again from the rehearsal's batch
    return ds, notices
