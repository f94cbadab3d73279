"""The planner's longest trainable sequence for a model on 1, 8 and 32 GPUs, beside the ALST paper's.

    .venv/bin/python scripts/plan_long_context.py [--model 8b] [--gpu h100-80g]

For each GPU count the planner (trainer.plan, DeepSpeed Ulysses sequence parallelism up to every GPU) is asked for the
longest sequence (a multiple of 1,024 tokens, bisected) that some candidate fits at micro-batch 1: without sequence
parallelism, with it, and with it and the activation checkpoints in host memory (DeepSpeed's cpu_checkpointing, which
the planner adds only when nothing fits without it). The planner counts what the trainer runs: tiled logits + loss
by model.tiled_logits' "auto", tiled MLPs (ALST's tiles of ~hidden_size tokens) where checkpointing alone does not
fit, ZeRO-3 with the optimizer and parameters on the CPU, and with --cpu-ram-gb the host RAM all of that needs. The
published figures are Llama-3.1-8B on H100 80GB from Bekman et al., "Arctic Long Sequence Training"
(arXiv:2506.13996, 2025): 32K for plain Hugging Face + DeepSpeed, 500K on 1 GPU, 3.7M on 8, 15M on 32, with tiled
MLP and logits+loss and the checkpoints offloaded. 2026-12-02, host RAM not checked: 474,112 / 3,800,064 /
14,183,424 tokens (0.95 / 1.03 / 0.95 of the paper's); 179,200 / 1,440,768 / 5,570,560 without the checkpoint
offload; 35,840 / 291,840 / 1,161,216 before tiling was counted.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.errors import ConfigError  # noqa: E402
from trainer.plan.decide import make_plan  # noqa: E402
from trainer.plan.inputs import build_inputs  # noqa: E402

ALST = {1: 500_000, 8: 3_700_000, 32: 15_000_000}  # Llama-8B on H100 80GB, the paper's figure 1
STEP = 1024


def plan_at(model, gpu: str, gpus: int, seq_len: int, sequence_parallel: bool, offload: Optional[bool],
            cpu_ram_gb: Optional[float]):
    per_node = min(gpus, 8)
    # pretraining: ALST trains packed samples told apart by position ids, with no (s, s) padding mask
    values = {"model": model, "gpu": gpu, "gpus_per_node": per_node, "nodes": gpus // per_node, "seq_len": seq_len,
              "task": "pretrain"}
    if not sequence_parallel:
        values["sequence_parallel"] = 1
    if offload is not None:
        values["checkpoint_offload"] = offload
    if cpu_ram_gb:
        values["cpu_ram_gb"] = cpu_ram_gb
    try:
        return make_plan(build_inputs(values))
    except ConfigError:  # e.g. beyond the model's positions: raised to the longest it has, below
        return None


def longest(model, gpu: str, gpus: int, sequence_parallel: bool, offload: Optional[bool],
            cpu_ram_gb: Optional[float], positions: int) -> int:
    low, high = 0, positions // STEP  # in units of STEP tokens
    while low < high:
        mid = (low + high + 1) // 2
        plan = plan_at(model, gpu, gpus, mid * STEP, sequence_parallel, offload, cpu_ram_gb)
        if plan is not None and plan.choice is not None:
            low = mid
        else:
            high = mid - 1
    return low * STEP


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="8b")
    parser.add_argument("--gpu", default="h100-80g")
    parser.add_argument("--cpu-ram-gb", type=float, default=None,
                        help="host RAM per node, checked against the offloaded checkpoints (default: not checked)")
    args = parser.parse_args()
    inputs = build_inputs({"model": args.model, "gpu": args.gpu, "seq_len": 1024})
    m = inputs.model.config
    # a longer context than the model was built for is a config change (rope scaling), not a memory question
    model = {**_architecture(m), "max_position_embeddings": 1 << 25}
    ram = f"{args.cpu_ram_gb:g} GB host RAM per node" if args.cpu_ram_gb else "host RAM not checked"
    print(f"{inputs.model.label} on {args.gpu}, micro-batch 1, bf16, {ram}: the planner's longest sequence vs ALST's")
    print(f"{'GPUs':>5} {'no SP':>11} {'+ Ulysses':>11} {'+ ckpt offload':>15} {'host GB/node':>13} "
          f"{'ALST (paper)':>13} {'ratio':>6}")
    for gpus in (1, 8, 32):
        plain = longest(model, args.gpu, gpus, False, False, args.cpu_ram_gb, 1 << 25)
        sp = longest(model, args.gpu, gpus, True, False, args.cpu_ram_gb, 1 << 25)
        offloaded = longest(model, args.gpu, gpus, True, None, args.cpu_ram_gb, 1 << 25)
        chosen = plan_at(model, args.gpu, gpus, offloaded, True, None, args.cpu_ram_gb).choice
        host = chosen.cpu_bytes_per_node / 1e9 if chosen else float("nan")
        paper = ALST[gpus]
        print(f"{gpus:>5} {plain:>11,} {sp:>11,} {offloaded:>15,} {host:>13,.0f} {paper:>13,} "
              f"{offloaded / paper:>6.2f}")
    return 0


def _architecture(m) -> dict:
    return {"hidden_size": m.hidden_size, "num_layers": m.num_layers, "num_heads": m.num_heads,
            "num_kv_heads": m.num_kv_heads, "intermediate_size": m.intermediate_size, "vocab_size": m.vocab_size,
            "tie_word_embeddings": m.tie_word_embeddings}


if __name__ == "__main__":
    raise SystemExit(main())
