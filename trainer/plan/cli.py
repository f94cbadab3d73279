"""`python -m trainer plan`: the command's flags, the run, writing `-o`."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from .. import numbers, paths
from ..flag_needs import needs
from .. import ds as dsc
from ..files import check_target, finite_json, write_text_atomic
from ..hardware import GPUS
from ..pictures import check_suffix, save_png
from .decide import make_plan
from .inference_inputs import inference_inputs_from_args
from .inference_plan import make_inference_plan
from .inputs import inputs_from_args
from .models import NAMED_MODELS, _parse_count
from .preset_file import check_preset_target, write_preset
from .report import inference_to_json, plan_to_json, print_inference, print_plan


# What a flag needs to do anything (trainer/flag_needs.py), declared beside each flag below.
TRAINING = ("a training plan (--inference plans generation: no optimizer, gradients, activations or reference "
            "model)", lambda args: not args.inference)
INFERENCE = ("--inference (it sizes generation, not training)", lambda args: args.inference)
RAW_COUNT = ("a raw parameter count as --model (a named size, preset or config.json brings its own architecture)",
             lambda args: args.scenario is not None or raw_count(args.model))
NVME = ("--nvme-gb above 0 (no NVMe, nothing is offloaded there)",
        lambda args: args.scenario is not None or bool(args.nvme_gb))


def raw_count(model) -> bool:
    """--model is a parameter count (the one kind of --model that takes --hidden-size and --num-layers)."""
    return model is not None and _parse_count(str(model).strip()) is not None and \
        str(model).strip().lower() not in NAMED_MODELS and not Path(str(model).strip()).exists()


def plan_arguments(parser: argparse.ArgumentParser) -> None:
    needs(parser.add_argument("scenario", nargs="?", metavar="SCENARIO",
                              help="scenario file (scenarios/NAME.yaml); flags override its values"), *TRAINING)
    parser.add_argument("--model", help=f"named size ({', '.join(NAMED_MODELS)}), preset name, HF config.json, "
                                        f"or a parameter count (with --hidden-size and --num-layers)")
    needs(parser.add_argument("--hidden-size", type=numbers.COUNT, help="hidden size, with a raw parameter count"),
          *RAW_COUNT)
    needs(parser.add_argument("--num-layers", type=numbers.COUNT, help="layers, with a raw parameter count"),
          *RAW_COUNT)
    parser.add_argument("--gpu", help=f"GPU type: {', '.join(g for g in GPUS if g != 'cpu')}")
    parser.add_argument("--gpus-per-node", type=numbers.RANKS_PER_NODE)
    parser.add_argument("--nodes", type=numbers.COUNT)
    parser.add_argument("--cpu-ram-gb", type=numbers.GIGABYTES, help="host RAM per node (GB); unknown = not checked")
    parser.add_argument("--nvme-gb", type=numbers.GIGABYTES, help="local NVMe per node (GB); 0 or absent = none")
    needs(parser.add_argument("--nvme-path", help="NVMe mount for ZeRO-Infinity (default /local_nvme)"), *NVME)
    needs(parser.add_argument("--task", help="pretrain, full (fine-tune), lora, dpo (full preference tuning) or "
                                             "dpo-lora (default full)"), *TRAINING)
    needs(parser.add_argument("--reference", help="dpo tasks: the reference model as adapter (LoRA base, dpo-lora), "
                                                  "engine (a frozen copy) or precomputed (log-probs computed once); "
                                                  "default: adapter for dpo-lora, else the planner's choice"),
          *TRAINING)
    needs(parser.add_argument("--seq-len", type=numbers.SEQUENCE_TOKENS, help="tokens per sequence (default 2048)"),
          *TRAINING)
    needs(parser.add_argument("--micro-batch", type=numbers.COUNT,
                              help="required micro-batch per GPU (default: the largest that fits)"), *TRAINING)
    needs(parser.add_argument("--global-batch", type=numbers.COUNT, help="target sequences per optimizer step"),
          *TRAINING)
    needs(parser.add_argument("--sequence-parallel", type=numbers.COUNT, metavar="N",
                              help="DeepSpeed Ulysses group size (default: 1, or the smallest that fits a long "
                                   "sequence)"), *TRAINING)
    needs(parser.add_argument("--expert-parallel", type=numbers.COUNT, metavar="N",
                              help="MoE: DeepSpeed AutoEP group size, each GPU holding experts / N (default 1)"),
          *TRAINING)
    needs(parser.add_argument("--no-activation-checkpointing", action="store_true",
                              help="never plan checkpointing"), *TRAINING)
    needs(parser.add_argument("--checkpoint-offload", choices=("auto", "on", "off"), default="auto",
                              help="checkpointed layer inputs in host memory (DeepSpeed cpu_checkpointing, ALST's "
                                   "checkpoint offload); auto (default): only when nothing fits without it"),
          *TRAINING)
    parser.add_argument("--json", action="store_true", help="print only the plan as one JSON object")
    needs(parser.add_argument("-o", "--output", type=paths.output_file("DeepSpeed config"),
                              help="write the chosen DeepSpeed config (JSON) here"), *TRAINING)
    needs(parser.add_argument("--write-preset", metavar="presets/NAME.yaml",
                              type=paths.output_file("preset", suffixes=(".yaml", ".yml")),
                              help="write the launch line as a preset file (the nearest shipped preset with the "
                                   "plan's --set items in it, and the usual header); `presets`, `show`, `lint` "
                                   "and train.py --preset take it at once"), *TRAINING)
    needs(parser.add_argument("--chart", metavar="PLAN.png", type=paths.output_file("chart", suffixes=(".png",)),
                              help="draw every candidate's memory against the budget here"), *TRAINING)
    inference = parser.add_argument_group("inference (--inference): weights + KV cache on the GPU, or ZeRO-Inference")
    inference.add_argument("--inference", action="store_true", help="plan generation instead of training")
    needs(inference.add_argument("--batch", type=numbers.COUNT, help="sequences generated together (default 1)"),
          *INFERENCE)
    needs(inference.add_argument("--context", type=numbers.COUNT,
                                 help="tokens per sequence in the KV cache: prompt + generated"), *INFERENCE)
    needs(inference.add_argument("--tp", type=numbers.COUNT,
                                 help="AutoTP tensor-parallel GPUs per model copy (default 1)"), *INFERENCE)
    needs(inference.add_argument("--dtype", help="bf16, fp16 or fp32 (default bf16; fp16 on V100)"), *INFERENCE)


def plan(args) -> int:
    if args.inference:
        return plan_inference(args)
    # DeepSpeed logs to stdout on import (config validation below imports it): keep stdout for the plan.
    if args.output is not None:  # '' too
        check_target(args.output)  # a bad -o is refused before the plan is made
    if args.chart is not None:
        check_suffix(args.chart, "--chart", (".png",))
        check_target(args.chart, "--chart")
    if args.write_preset is not None:
        check_preset_target(args.write_preset)
        check_target(args.write_preset, "--write-preset")
    with contextlib.redirect_stdout(sys.stderr):
        inputs = inputs_from_args(args)
        result = make_plan(inputs, args.output)
        if args.output and result.deepspeed is not None:
            write_config(result.deepspeed, args.output)
        if args.write_preset and result.choice is not None:
            print(f"wrote {write_preset(result, args.write_preset)}", file=sys.stderr)
    if args.chart:  # a plan that fits nowhere is drawn too: the chart shows by how much
        from .chart import plan_figure  # matplotlib is imported here, by --chart only
        print(f"wrote {save_png(plan_figure(result), args.chart, '--chart')}", file=sys.stderr)
    if args.json:
        print(json.dumps(plan_to_json(result), indent=2))
    else:
        print_plan(result)
    return 0 if result.choice is not None else 1


def plan_inference(args) -> int:
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's import-time log stays off stdout
        result = make_inference_plan(inference_inputs_from_args(args))
    if args.json:
        print(json.dumps(inference_to_json(result), indent=2))
    else:
        print_inference(result)
    return 0 if result.placement.mode != "none" else 1


def write_config(ds: dict, output: str) -> None:
    problems = dsc.check_keys(ds)
    if problems:  # a planner bug: the builders produced something DeepSpeed would reject
        raise RuntimeError(f"planned DeepSpeed config has problems: {problems}")
    out = write_text_atomic(output, finite_json(ds))
    print(f"wrote {out}", file=sys.stderr)
