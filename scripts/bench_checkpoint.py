"""Checkpoint save time against the disk: how long `trainer.train.checkpoint.save` takes per ZeRO stage, next to
the time one sequential stream takes to write the same number of bytes, durably, on the same disk.

    .venv/bin/python scripts/bench_checkpoint.py [--hidden 768 --layers 8 --vocab 32000] [--stages 0 1 2 3]
        [--ranks 2] [--writer torch] [--dir /path/on/the/disk/to/measure] [--port 30390]

The driver launches `deepspeed --num_gpus R scripts/bench_checkpoint.py --worker ...` once; the worker builds a
Llama of the given shape (fp32, Adam: every stage has optimizer moments to save), takes one optimizer step per
stage, and times on rank 0 the trainer's full save (DeepSpeed's files, fsync by every rank, manifest with SHA-256
unless --no-checksums, rename, COMPLETE). The baseline writes the same total bytes as one file in 64 MiB blocks
and fsyncs it (best of two). ratio = save / sequential: 1.0 would be a save as fast as the disk streams.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
BLOCK = 64 << 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--writer", default="torch", help="train.checkpoint_writer to save with")
    parser.add_argument("--no-checksums", action="store_true", help="manifest with sizes only (no SHA-256)")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir under runs/)")
    parser.add_argument("--port", type=int, default=30390)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    (REPO / "runs").mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir or REPO / "runs"))
    report = work / "report.json"
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", str(args.ranks), "--master_port",
           str(args.port), __file__, "--worker", "--out", str(report), "--hidden", str(args.hidden), "--layers",
           str(args.layers), "--vocab", str(args.vocab), "--writer", args.writer, "--stages",
           *map(str, args.stages), *(["--no-checksums"] if args.no_checksums else []), "--dir", str(work)]
    print(" ".join(cmd), flush=True)
    try:
        subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        rows = json.loads(report.read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{rows[0]['params'] / 1e6:.0f}M parameters, fp32 + Adam, {args.ranks} ranks, writer {args.writer}")
    print("| ZeRO stage | checkpoint | save | sequential write | ratio |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['stage']} | {row['bytes'] / 2**30:.2f} GiB | {row['save_s']:.2f} s | {row['seq_s']:.2f} s "
              f"| {row['save_s'] / row['seq_s']:.2f} |")
    return 0


# ============================================================================================ worker

def worker(args) -> int:
    import deepspeed
    import torch
    import torch.distributed as dist

    from trainer import ds as dsc
    from trainer.distributed import end_distributed
    from trainer.model import build_model
    from trainer.presets import load_preset
    from trainer.resolve import resolve
    from trainer.train import checkpoint
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    work, rows = Path(args.dir), []
    for stage in args.stages:
        cfg = resolve(load_preset("tiny_cpu", [
            f"model.hidden_size={args.hidden}", f"model.num_layers={args.layers}", "model.num_heads=12",
            "model.num_kv_heads=4", f"model.intermediate_size={args.hidden * 8 // 3 // 64 * 64}",
            f"model.vocab_size={args.vocab}", "model.max_position_embeddings=128", "data.seq_len=64",
            "train.micro_batch_size=1", "train.grad_accum=1", f"hardware.gpus_per_node={world}",
            dsc.set_override("zero_optimization.stage", stage),
            dsc.set_override("zero_optimization.reduce_bucket_size", 5e7),
            dsc.set_override("zero_optimization.allgather_bucket_size", 5e7),
            dsc.set_override("optimizer.params.torch_adam", True),
        ]), world).config
        model, hf_ds_config = build_model(cfg, rank)
        params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=dsc.with_checkpoint_writer(cfg.deepspeed, args.writer))
        tokens = torch.randint(0, args.vocab, (1, 64))
        engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        engine.step()  # the optimizer's moments exist: a save writes what a real one does
        ckpt_dir = work / f"stage{stage}"
        dist.barrier()
        start = time.perf_counter()
        saved = checkpoint.save(engine, ckpt_dir, checkpoint.TrainState(step=1), {"bench": True}, keep_last=1,
                                checksums=not args.no_checksums)
        save_s = time.perf_counter() - start
        if rank == 0:
            total = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file())
            seq_s = min(sequential_write(work / "sequential.bin", total) for _ in range(2))
            rows.append({"stage": stage, "bytes": total, "save_s": save_s, "seq_s": seq_s, "params": params})
            print(f"stage {stage}: {total / 2**30:.2f} GiB saved in {save_s:.2f} s; sequential {seq_s:.2f} s",
                  flush=True)
            shutil.rmtree(ckpt_dir)
        dist.barrier()
        engine.destroy()
        del engine, model, hf_ds_config
    if rank == 0:
        Path(args.out).write_text(json.dumps(rows))
    end_distributed()  # removes this rank's DeepSpeed shared-memory buffer
    return 0


def sequential_write(path: Path, total: int) -> float:
    """Seconds to write `total` bytes to `path` in 64 MiB blocks and fsync (the disk's streaming rate)."""
    block = os.urandom(1 << 20) * (BLOCK >> 20)
    start = time.perf_counter()
    with open(path, "wb") as handle:
        left = total
        while left > 0:
            written = handle.write(block[:min(left, BLOCK)])
            left -= written
        handle.flush()
        os.fsync(handle.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return elapsed


if __name__ == "__main__":
    sys.exit(main())
