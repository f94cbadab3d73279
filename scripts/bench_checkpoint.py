"""Checkpoint save and load time against the disk: how long `trainer.train.checkpoint.save` and a resume
(`checkpoint.verify` + `checkpoint.load`) take per ZeRO stage, next to the time one sequential stream takes to write
the same number of bytes durably, and to read them back cold, on the same disk.

    .venv/bin/python scripts/bench_checkpoint.py [--hidden 768 --layers 8 --vocab 32000] [--stages 0 1 2 3]
        [--ranks 2] [--writer torch] [--repeats 2] [--dir /path/on/the/disk/to/measure] [--port 30390]

The driver launches `deepspeed --num_gpus R scripts/bench_checkpoint.py --worker ...` once; the worker builds a
Llama of the given shape (fp32, Adam: every stage has optimizer moments to save), takes one optimizer step per
stage, and times on rank 0:
- save: the trainer's full save (finite-weights check, DeepSpeed's files, fsync, manifest with SHA-256 unless
  --no-checksums, rename, COMPLETE, latest), from a barrier before to the barrier after it;
- load: what a resume does before its first step with the checkpoint -- every rank verifies it (sizes, SHA-256,
  pickle vetting) and the engine loads it -- with the checkpoint's pages dropped from the page cache first
  (posix_fadvise DONTNEED on every file), as on a node that did not write it.
The baselines write the same total bytes as one file in 64 MiB blocks and fsync it, then drop it from the page
cache and read it back in 64 MiB blocks. Each measurement is repeated --repeats times, interleaved with its
baseline, and the best of each is kept. ratio = trainer / sequential: 1.0 would be as fast as the disk streams.

Measured 2026-12-02 (`--layers 2`, 63M parameters, 2 CPU ranks on 2 cores shared with a full test suite, load
average ~11; before verification read ahead while hashing):
| ZeRO stage | checkpoint | save | sequential write | save ratio | load | sequential read | load ratio |
|---|---|---|---|---|---|---|---|
| 0 | 0.69 GiB | 3.71 s | 2.81 s | 1.32 | 5.01 s | 1.18 s | 4.24 |
| 1 | 0.92 GiB | 1.78 s | 2.44 s | 0.73 | 0.97 s | 0.73 s | 1.33 |
| 2 | 0.92 GiB | 1.57 s | 2.88 s | 0.54 | 1.23 s | 0.69 s | 1.78 |
| 3 | 0.69 GiB | 1.22 s | 1.32 s | 0.92 | 0.84 s | 0.75 s | 1.12 |
Ratios below 1 mean the one-stream baseline was slowed by other jobs' I/O; ZeRO-0 has one file (rank 0 writes,
hashes and verifies it alone). Rerun on a quiet machine before quoting these.
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
    parser.add_argument("--repeats", type=int, default=2, help="saves and loads per stage, best kept (default: 2)")
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
           str(args.layers), "--vocab", str(args.vocab), "--writer", args.writer, "--repeats", str(args.repeats),
           "--stages", *map(str, args.stages), *(["--no-checksums"] if args.no_checksums else []), "--dir", str(work)]
    print(" ".join(cmd), flush=True)
    try:
        subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        rows = json.loads(report.read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    checksums = "sizes only" if args.no_checksums else "SHA-256"
    print(f"\n{rows[0]['params'] / 1e6:.0f}M parameters, fp32 + Adam, {args.ranks} ranks, writer {args.writer}, "
          f"manifest {checksums}, best of {args.repeats}")
    print("| ZeRO stage | checkpoint | save | sequential write | save ratio | load | sequential read | load ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['stage']} | {row['bytes'] / 2**30:.2f} GiB | {row['save_s']:.2f} s | {row['write_s']:.2f} s "
              f"| {row['save_s'] / row['write_s']:.2f} | {row['load_s']:.2f} s | {row['read_s']:.2f} s "
              f"| {row['load_s'] / row['read_s']:.2f} |")
    return 0


# ============================================================================================ worker

def worker(args) -> int:
    import deepspeed
    import torch.distributed as dist

    from trainer.distributed import end_distributed
    deepspeed.init_distributed(dist_backend="gloo")
    rank, rows = dist.get_rank(), []
    for stage in args.stages:
        row = measure_stage(args, stage)
        if rank == 0:
            rows.append(row)
            print(f"stage {stage}: {row['bytes'] / 2**30:.2f} GiB saved in {row['save_s']:.2f} s (sequential write "
                  f"{row['write_s']:.2f} s), loaded in {row['load_s']:.2f} s (sequential read {row['read_s']:.2f} s)",
                  flush=True)
    if rank == 0:
        Path(args.out).write_text(json.dumps(rows))
    end_distributed()  # removes this rank's DeepSpeed shared-memory buffer
    return 0


def measure_stage(args, stage: int) -> dict:
    """Best of --repeats saves and loads of one engine at `stage`, each next to its sequential baseline."""
    import deepspeed
    import torch
    import torch.distributed as dist

    from trainer import ds as dsc
    from trainer.distributed import comm_device
    from trainer.model import build_model
    from trainer.presets import load_preset
    from trainer.resolve import resolve
    from trainer.train import checkpoint
    rank, world = dist.get_rank(), dist.get_world_size()
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
    work = Path(args.dir)
    row = {"stage": stage, "params": params, "save_s": float("inf"), "load_s": float("inf"),
           "write_s": float("inf"), "read_s": float("inf")}
    for repeat in range(args.repeats):
        ckpt_dir = work / f"stage{stage}_{repeat}"
        saved, save_s = timed(lambda: checkpoint.save(engine, ckpt_dir, checkpoint.TrainState(step=1),
                                                      {"bench": True}, keep_last=1,
                                                      checksums=not args.no_checksums))
        if rank == 0:
            drop_from_page_cache(saved)
        _, load_s = timed(lambda: (checkpoint.verify(saved, comm_device()), checkpoint.load(engine, saved, ckpt_dir)))
        if rank == 0:
            row["bytes"] = sum(f.stat().st_size for f in saved.rglob("*") if f.is_file())
            write_s, read_s = sequential(work / "sequential.bin", row["bytes"])
            row.update(save_s=min(row["save_s"], save_s), load_s=min(row["load_s"], load_s),
                       write_s=min(row["write_s"], write_s), read_s=min(row["read_s"], read_s))
            shutil.rmtree(ckpt_dir)
        dist.barrier()
    engine.destroy()
    del engine, model, hf_ds_config
    return row


def timed(work):
    """(work(), seconds) from a barrier before it to a barrier after it: the slowest rank's time."""
    import torch.distributed as dist
    dist.barrier()
    start = time.perf_counter()
    result = work()
    dist.barrier()
    return result, time.perf_counter() - start


def drop_from_page_cache(path: Path) -> None:
    """Evict the (fsynced, so clean) pages of every file under `path`: the next read comes from the disk."""
    for file in [path] if path.is_file() else sorted(f for f in path.rglob("*") if f.is_file()):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential(path: Path, total: int) -> tuple[float, float]:
    """Seconds to write `total` bytes to `path` in 64 MiB blocks and fsync (the disk's streaming rate), and to read
    them back in 64 MiB blocks after dropping them from the page cache."""
    block = os.urandom(1 << 20) * (BLOCK >> 20)
    start = time.perf_counter()
    with open(path, "wb") as handle:
        left = total
        while left > 0:
            written = handle.write(block[:min(left, BLOCK)])
            left -= written
        handle.flush()
        os.fsync(handle.fileno())
    write_s = time.perf_counter() - start
    drop_from_page_cache(path)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as handle:
        while handle.read(BLOCK):
            pass
    read_s = time.perf_counter() - start
    path.unlink()
    return write_s, read_s


if __name__ == "__main__":
    sys.exit(main())
