"""DeepSpeed's autotuner, from our side: the tuning config `deepspeed --autotuning` reads, the `--set` items that
make a preset run one of its experiments, and the batch of the config it found best.

How DeepSpeed 0.19.8's autotuner works (deepspeed/autotuning/autotuner.py, scheduler.py), which shapes this:
- it reads the JSON after `--deepspeed_config` in the user script's arguments, and launches each experiment
  with that argument replaced by the experiment's config, base64-encoded (`train.py` decodes it);
- `zero_optimization.stage` may be a list (the stages to try); every experiment's ZeRO block is replaced by
  `{"stage": N}` or its own templates, so offload blocks never reach an experiment: offload cannot be tuned;
- `train_micro_batch_size_per_gpu` may be a list: exactly those micro-batches are tried, each with
  accumulation = max(list) x gradient_accumulation_steps / micro-batch -- so a list of divisors of the
  per-rank share keeps the preset's global batch in every experiment;
- each experiment's engine stops itself after `end_profile_step` and writes metrics.json (latency in us,
  throughput in samples/s, FLOPS_per_gpu) into results_dir/<experiment>/; the best config goes to
  results_dir/ds_config_optimal.json.
"""
from __future__ import annotations

import base64
import binascii
import copy
import json
import os
from typing import Any

from ..config import AUTO
from ..errors import UserError
from ..files import read_json_object


BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def autotuning_block(results_dir: str, exps_dir: str, mp_size: int = 1, metric: str = "throughput",
                     fast: bool = True, start_profile_step: int = 3, end_profile_step: int = 5,
                     tuner_type: str = "gridsearch") -> dict:
    """The `autotuning` block (keys as deepspeed/autotuning/config.py reads them)."""
    return {"enabled": True, "fast": fast, "metric": metric, "start_profile_step": start_profile_step,
            "end_profile_step": end_profile_step, "tuner_type": tuner_type, "mp_size": mp_size,
            "results_dir": results_dir, "exps_dir": exps_dir, "overwrite": True}


def tuning_config(ds: dict, stages: list[int], micro_batches: list[int], per_rank_batch: int, block: dict) -> dict:
    """The config `deepspeed --autotuning` reads: the resolved preset's DeepSpeed config with its ZeRO block cut to
    the stages to try (DeepSpeed's defaults otherwise, as the autotuner's experiments have), the micro-batches to
    try, the accumulation that makes max(micro_batches) x accumulation = the per-rank share of the global batch,
    and the autotuning block."""
    if per_rank_batch % max(micro_batches):
        raise ValueError(f"micro-batches {micro_batches} must divide the per-rank batch {per_rank_batch}")
    config = {k: copy.deepcopy(v) for k, v in ds.items() if k not in BATCH_KEYS and k != "autotuning"}
    config["zero_optimization"] = {"stage": list(stages)}
    config["train_micro_batch_size_per_gpu"] = list(micro_batches)
    config["gradient_accumulation_steps"] = per_rank_batch // max(micro_batches)
    config["autotuning"] = block
    return config


def experiment_configs(tuning: dict) -> list[dict]:
    """The concrete configs the autotuner can make from `tuning` in fast mode (one stage and micro-batch each,
    ZeRO block `{"stage": N}`), for checking them against the installed DeepSpeed before any GPU is used."""
    out = []
    per_rank = tuning["train_micro_batch_size_per_gpu"][-1] * tuning["gradient_accumulation_steps"]
    for stage in tuning["zero_optimization"]["stage"]:
        for micro in tuning["train_micro_batch_size_per_gpu"]:
            config = {k: copy.deepcopy(v) for k, v in tuning.items() if k != "autotuning"}
            config.update(zero_optimization={"stage": stage}, train_micro_batch_size_per_gpu=micro,
                          gradient_accumulation_steps=per_rank // micro)
            out.append(config)
    return out


def decode_launcher_config(value: str) -> dict:
    """A `--deepspeed_config` value as DeepSpeed takes it: a JSON file, or the base64 JSON the autotuner passes."""
    if os.path.isfile(value):  # False, not OSError, for a base64 string longer than a file name may be
        return read_json_object(value, "--deepspeed_config")
    try:
        decoded = json.loads(base64.urlsafe_b64decode(value.encode()).decode())
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise UserError(f"--deepspeed_config {value[:60]!r}: neither a file nor base64 JSON (the form DeepSpeed's "
                        f"autotuner passes); give a DeepSpeed .json file") from None
    if not isinstance(decoded, dict):
        raise UserError("--deepspeed_config: the decoded config is not a JSON object")
    return decoded


def experiment_overrides(config: dict) -> list[str]:
    """`--set` items that make a preset run `config` (an autotuner experiment) as its whole DeepSpeed section:
    the template dropped (its keys were not in the experiment), the batch triad moved to the train section
    (the trainer solves and checks it at the real world size)."""
    micro, accum = config.get("train_micro_batch_size_per_gpu"), config.get("gradient_accumulation_steps")
    if not isinstance(micro, int) or not isinstance(accum, int):
        raise UserError(f"--deepspeed_config: train_micro_batch_size_per_gpu={micro!r} and "
                        f"gradient_accumulation_steps={accum!r} must be whole numbers (an autotuner experiment sets "
                        f"both)")
    section = {k: v for k, v in config.items() if k not in BATCH_KEYS}
    section.update({key: AUTO for key in BATCH_KEYS})
    return ["deepspeed_template=null", f"deepspeed:={json.dumps(section)}", f"train.micro_batch_size={micro}",
            f"train.grad_accum={accum}", "train.global_batch_size=null"]


def without_autotuning(config: dict) -> dict:
    """An experiment's config as the autotuner compares it with ds_config_optimal.json (its autotuning block gone)."""
    return {k: v for k, v in config.items() if k != "autotuning"}


def preset_section(optimal: dict) -> tuple[dict, int, int]:
    """(deepspeed section, micro-batch, accumulation) of a preset that runs the autotuner's optimal config:
    the batch triad is the train section's (filled back as "auto"), the autotuning block gone."""
    section: dict[str, Any] = {k: copy.deepcopy(v) for k, v in optimal.items()
                               if k not in BATCH_KEYS and k != "autotuning"}
    section.update({key: AUTO for key in BATCH_KEYS})
    return section, int(optimal["train_micro_batch_size_per_gpu"]), int(optimal["gradient_accumulation_steps"])
