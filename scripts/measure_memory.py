"""Measured memory next to the planner's, for a preset's shape shrunk in layers (and width on CPU).

    deepspeed --num_gpus 2 --master_port 29650 scripts/measure_memory.py --preset tiny_cpu --stage 2
    deepspeed --num_gpus 2 --master_port 29650 scripts/measure_memory.py --preset tiny_cpu --stage 3

It builds the model the trainer builds (trainer.model.build_model: zero.Init under stage 3), runs
`deepspeed.initialize` and two training steps on random tokens, and after the second backward - when
parameters, gradient partitions, fp32 master weights and Adam moments all exist - counts the bytes of
the tensors the engine's ZeRO optimizer holds:

  stage 1/2  bit16_groups_flat (params), grads_in_partition / averaged_gradients, single_partition_of_fp32_groups
             (master), optimizer.state (moments), ipg_buffer (reduce buckets)
  stage 3    lp_param_buffer / fp16_partitioned_groups_flat + persistent params (params), grad_partitions_flat_buffer,
             fp32_partitioned_groups_flat (master), optimizer.state

and prints them next to `trainer.plan.memory.model_states` for the same shape, world size and precision.
On CPU ranks training runs in fp32 (bf16 is ~13x slower here), so the comparison uses the planner's
fp32 accounting (`precision="fp32"`: 4-byte params and one fp32 gradient); DeepSpeed's own 16-bit
estimate for the same shape is printed beside it for reference. On a GPU it also prints
torch.cuda.max_memory_allocated() next to the planner's per-GPU total (model states + activations +
buffers); the goal there is within 10%.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from trainer import ds as dsc
from trainer.plan import memory as mem
from trainer.presets import load_preset, with_overrides
from trainer.resolve import resolve


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny_cpu")
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), help="ZeRO stage (default: the preset's)")
    parser.add_argument("--layers", type=int, default=2, help="shrink the model to this many layers")
    parser.add_argument("--max-hidden", type=int, default=None,
                        help="shrink the width to at most this (default 512 on CPU, unchanged on GPU)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--json", help="also write {measured, planned} bytes per rank to this file (rank 0)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=-1, help=argparse.SUPPRESS)
    return parser.parse_args()


def shrink_overrides(args, cfg, on_gpu: bool) -> list[str]:
    """Layers (and on CPU the width) shrunk; trained from scratch; fp32 on CPU."""
    m = cfg.model
    out = [f"model.num_layers={min(args.layers, m.num_layers)}", "model.name_or_path=null",
           "model.lora.enabled=false", "train.export_hf=false"]
    if m.name_or_path and not m.tokenizer:
        out.append(f"model.tokenizer={m.name_or_path}")
    max_hidden = args.max_hidden or (None if on_gpu else 512)
    if max_hidden and m.hidden_size > max_hidden:
        factor = m.hidden_size // max_hidden
        heads = max(1, m.num_heads // factor)
        kv = max(1, (m.num_kv_heads or m.num_heads) // factor)
        out += [f"model.hidden_size={m.hidden_size // factor}", f"model.intermediate_size={m.intermediate_size // factor}",
                f"model.num_heads={heads}", f"model.num_kv_heads={kv if heads % kv == 0 else heads}",
                f"model.vocab_size={min(m.vocab_size, 8192)}"]
    if not on_gpu:
        out.append("train.precision=fp32")
    if args.stage is not None:
        out.append(f"deepspeed.zero_optimization.stage={args.stage}")
    return out


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one flat buffer count once)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel() > 0:
            storage = t.untyped_storage()
            seen[(storage.data_ptr(), t.device.type)] = storage.nbytes()
    return sum(seen.values())


def optimizer_state_tensors(opt) -> list[torch.Tensor]:
    return [v for state in opt.optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0]


def census_stage_1_2(opt) -> dict[str, int]:
    """The gradient partition is `grads_in_partition` (contiguous gradients). DeepSpeed sizes it by the whole
    parameters of the partition, so a parameter that straddles the partition boundary is held whole (up to one
    parameter more than the partition, which DeepSpeed's estimator leaves out). Gradients of the last reduce
    bucket that `averaged_gradients` still holds in storages of their own are bucket memory, counted with the
    reduce buffers (the planner prices both as one reduce bucket)."""
    partition = [opt.grads_in_partition] if getattr(opt, "grads_in_partition", None) is not None else []
    averaged = [g for group in (getattr(opt, "averaged_gradients", {}) or {}).values() if group for g in group]
    gradients = storage_bytes(partition) if partition else storage_bytes(averaged)
    held_bucket = storage_bytes(partition + averaged) - gradients if partition else 0
    return {"params": storage_bytes(opt.bit16_groups_flat),
            "gradients": gradients,
            "optimizer": storage_bytes(opt.single_partition_of_fp32_groups) + storage_bytes(
                optimizer_state_tensors(opt)),
            "buffers": storage_bytes(getattr(opt, "ipg_buffer", None) or []) + held_bucket}


def census_stage_3(opt, model) -> dict[str, int]:
    partitions = [getattr(opt, "lp_param_buffer", None)] + list(getattr(opt, "fp16_partitioned_groups_flat", []))
    persistent = [p.ds_tensor for p in model.parameters() if getattr(p, "ds_persist", False)]
    return {"params": storage_bytes([t for t in partitions if t is not None] + persistent),
            "gradients": storage_bytes([opt.grad_partitions_flat_buffer]),
            "optimizer": storage_bytes(opt.fp32_partitioned_groups_flat) + storage_bytes(optimizer_state_tensors(opt)),
            "buffers": 0}


def random_batch(cfg, device) -> dict:
    micro, seq = cfg.train.micro_batch_size, cfg.data.seq_len
    ids = torch.randint(0, cfg.model.vocab_size, (micro, seq), device=device)
    return {"input_ids": ids, "labels": ids}


def main() -> int:
    args = arguments()
    import deepspeed
    from trainer.distributed import start_distributed
    from trainer.model import build_model, unwrap
    from trainer.plan.estimate import gb, plan_for_resolved

    on_gpu = torch.cuda.is_available()
    rank = start_distributed()
    world = dist.get_world_size()
    base = load_preset(args.preset, args.overrides)
    overrides = with_overrides(args.overrides, shrink_overrides(args, base, on_gpu) + [
        f"hardware.gpus_per_node={world}", "hardware.nodes=1"] + ([] if on_gpu else ["hardware.gpu=cpu"]))
    resolved = resolve(load_preset(args.preset, overrides), world)
    cfg, ds = resolved.config, resolved.ds
    stage, precision = dsc.zero_stage(ds), dsc.precision(ds)
    if "nvme" in (dsc.offload_optimizer_device(ds), dsc.offload_param_device(ds)):
        raise SystemExit("NVMe offload is not measured here (its states live on disk)")

    torch.manual_seed(cfg.train.seed)
    model, hf_ds_config = build_model(cfg, rank)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                          if p.requires_grad], config=ds)
    device = engine.device
    measured = {}
    for step in range(2):
        loss = engine(**random_batch(cfg, device)).loss
        engine.backward(loss)
        if step == 1:  # everything exists now: params, gradient partitions, master weights, moments
            opt = engine.optimizer
            measured = census_stage_3(opt, unwrap(engine.module)) if stage == 3 else census_stage_1_2(opt)
        engine.step()
    measured["model states"] = measured["params"] + measured["gradients"] + measured["optimizer"]

    total_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in unwrap(engine.module).parameters())
    planned_params = mem.count_params(cfg.model)
    largest = mem.largest_layer_params(cfg.model)
    planned = mem.model_states(planned_params, largest, stage, world, 1, dsc.offload_optimizer_device(ds) != "none",
                               dsc.offload_param_device(ds) != "none", zero_init=True, precision=precision)
    deepspeed_16bit = mem.model_states(planned_params, largest, stage, world, 1,
                                       dsc.offload_optimizer_device(ds) != "none",
                                       dsc.offload_param_device(ds) != "none", zero_init=True, precision="bf16")
    rows = [("params", planned.params), ("gradients", planned.gradients), ("optimizer", planned.optimizer),
            ("model states", planned.params + planned.gradients + planned.optimizer)]
    buckets = mem.reduce_bucket_bytes(stage, int(dsc.zero_setting(ds, "reduce_bucket_size")), precision,
                                      dsc.overlap_comm(ds))
    if rank == 0 and args.json:
        Path(args.json).write_text(json.dumps({"stage": stage, "precision": precision, "world": world,
                                               "measured": measured, "planned": {**dict(rows), "buffers": buckets},
                                               # stage 1/2 size the gradient buffer by whole parameters: the one
                                               # straddling the partition boundary is held whole
                                               "straddle_bytes": largest * (4 if precision == "fp32" else 2)}))
    if rank == 0:
        m = cfg.model
        print(f"\nmeasure_memory: {args.preset} shrunk to {m.num_layers} layers x {m.hidden_size} wide "
              f"({total_params:,} params; planner counts {planned_params:,}), world {world}, ZeRO-{stage}, "
              f"{precision}, micro {cfg.train.micro_batch_size} x seq {cfg.data.seq_len}, device {device}")
        print(f"{'bytes per rank':<16}{'measured':>14}{'planned':>14}{'ratio':>8}")
        for name, value in rows:
            got = measured[name]
            print(f"{name:<16}{got:>14,}{value:>14,}{got / value if value else float('nan'):>8.3f}")
        held = f"{measured['buffers']:,}" if measured["buffers"] else "released"
        print(f"{'reduce buckets':<16}{held:>14}{buckets:>14,}   (allocated during backward; the last bucket's "
              f"gradients may still be held at the census)")
        if stage == 3:
            print(f"{'working (LL)':<16}{'-':>14}{planned.working:>14,}   (gathered per module during fwd/bwd; "
                  f"not resident at the census)")
        print(f"DeepSpeed's 16-bit estimator for this shape and world: {deepspeed_16bit.gpu_bytes:,} bytes per GPU "
              f"(the planner's {precision} accounting above: {planned.gpu_bytes:,})")
        if on_gpu:
            estimate = plan_for_resolved(resolved)
            peak = torch.cuda.max_memory_allocated()
            print(f"GPU peak: torch.cuda.max_memory_allocated {gb(peak)} GB vs planner total {gb(estimate.gpu_total)} GB "
                  f"(ratio {peak / estimate.gpu_total:.3f}; goal within 10%)")
    del hf_ds_config
    dist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
