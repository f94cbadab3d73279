"""DeepSpeed's autotuning results dir -> a new preset that trains with the best config, the measured throughput
in its header.

What the autotuner leaves in results_dir (deepspeed/autotuning/autotuner.py, scheduler.py, 0.19.8):
  ds_config_optimal.json      the best experiment's ds_config.json without its autotuning block
  cmd_optimal.txt, summary.txt
  <experiment>/ds_config.json, exp.json, cmd.txt, stdout.log, stderr.log, metrics.json (the engine's
                              "latency" in us per optimizer step, "throughput" in samples/s, "FLOPS_per_gpu")
  profile_model_info/model_info.json
The best experiment is the one whose ds_config.json (autotuning block aside) is ds_config_optimal.json.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import yaml

from .. import ds as dsc
from ..errors import UserError
from ..files import read_json_object, read_yaml_mapping
from ..numbers import POSITIVE
from ..presets import apply_overrides, config_from_dict, preset_path
from ..resolve import resolve


OPTIMAL = "ds_config_optimal.json"


@dataclass(frozen=True)
class Best:
    experiment: str
    results_dir: Path
    metrics: dict        # the experiment's metrics.json
    optimal: dict        # ds_config_optimal.json

    @property
    def samples_per_s(self) -> float:
        return float(self.metrics["throughput"])

    @property
    def step_ms(self) -> float:
        return float(self.metrics["latency"]) / 1000


def read_results(results_dir: str | Path) -> Best:
    """The best experiment of a finished autotuning run, or a UserError saying what is missing."""
    results = Path(results_dir)
    if not (results / OPTIMAL).is_file():
        raise UserError(f"{results}: no {OPTIMAL}: the autotuner found no config that ran (or has not run here); "
                        f"see {results / 'summary.txt'} and each experiment's stderr.log under {results}")
    optimal = read_json_object(results / OPTIMAL, "the autotuner's optimal config")
    for experiment in sorted(p for p in results.iterdir() if (p / "metrics.json").is_file()):
        config = read_json_object(experiment / "ds_config.json", "an autotuning experiment's config")
        if dsc.without_autotuning(config) == optimal:
            metrics = read_json_object(experiment / "metrics.json", "an autotuning experiment's metrics")
            bad = [k for k in ("throughput", "latency") if POSITIVE.problem(metrics.get(k))]
            if bad:  # a negative or zero measurement is a failed experiment, never a preset's header
                raise UserError(f"{experiment / 'metrics.json'}: {' and '.join(bad)} "
                                f"{[metrics.get(k) for k in bad]} not a positive measurement: the experiment did not "
                                f"run as measured; see its stderr.log, or run `python -m trainer autotune` again")
            return Best(experiment.name, results, metrics, optimal)
    raise UserError(f"{results / OPTIMAL} matches no experiment with a metrics.json under {results}: a results dir "
                    f"from another run, or edited; run `python -m trainer autotune` again")


def preset_document(source: str, overrides: list[str], best: Best, name: str, searched: list[str]) -> str:
    """The new preset's YAML text with its header: the source preset with the `--set` items
    the autotuner ran with folded in, its DeepSpeed section the optimal config (no template: the experiments
    ran without one), its train section the optimal micro-batch and accumulation."""
    raw = apply_overrides(read_yaml_mapping(preset_path(source), "preset"), overrides)
    section, micro, accum = dsc.preset_section(best.optimal)
    raw = copy.deepcopy(raw)
    raw.pop("deepspeed_template", None)
    raw["deepspeed"] = section
    train = raw.setdefault("train", {})
    train.pop("global_batch_size", None)
    train.update(micro_batch_size=micro, grad_accum=accum)
    raw["description"] = (f"{source} as DeepSpeed's autotuner measured fastest: ZeRO-{dsc.zero_stage(section)}, "
                          f"micro {micro} x accum {accum}, {best.samples_per_s:.1f} samples/s")
    raw["name"] = name
    resolved = resolve(config_from_dict(raw, name))  # a preset that does not resolve is not written
    raw.pop("name")
    return _header(source, name, best, resolved, searched) + yaml.safe_dump(raw, sort_keys=False)


def _header(source: str, name: str, best: Best, resolved, searched: list[str]) -> str:
    from ..launch.command import command_for
    from ..plan.estimate import gb, plan_for_resolved
    cfg, batch = resolved.config, resolved.batch
    hw, model = cfg.hardware, cfg.model
    shot = plan_for_resolved(resolved)
    tokens = best.samples_per_s * cfg.data.seq_len
    lines = [
        f"{name} — {source} with the DeepSpeed config DeepSpeed's autotuner measured fastest.",
        f"Hardware: {hw.nodes} node(s) x {hw.gpus_per_node} {hw.gpu} (as {source}).",
        f"Model: as {source} ({model.family}, hidden {model.hidden_size} x {model.num_layers} layers"
        f"{', ' + model.name_or_path if model.name_or_path else ''}).",
        f"Trade-off: ZeRO-{dsc.zero_stage(resolved.ds)}, micro-batch {batch.micro_batch_size} x accumulation "
        f"{batch.grad_accum} (global batch {batch.global_batch_size}), measured best among:",
        *[f"  {line}" for line in searched],
        f"Measured: {best.samples_per_s:.2f} samples/s ({tokens:.0f} tokens/s at seq_len {cfg.data.seq_len}), "
        f"{best.step_ms:.1f} ms per optimizer step: DeepSpeed's autotuner, experiment {best.experiment} in "
        f"{best.results_dir}.",
        f"Expected memory per GPU: ~{gb(shot.gpu_total)} GB of {gb(shot.gpu_budget)} usable (the planner's estimate).",
        f"Launch: {command_for(resolved, name, [])}",
    ]
    return "".join(f"# {line}\n" for line in lines)
