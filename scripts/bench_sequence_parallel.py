"""Ulysses sequence parallelism on 2 CPU ranks: what SP=2 costs in speed and what it buys in sequence length.

    .venv/bin/python scripts/bench_sequence_parallel.py [--seq-len 2048] [--cap-mb 600] [--ladder 1024 2048 ...]
        [--steps 6] [--port 29760]

One launch of 2 ranks (`deepspeed --num_gpus 2 scripts/bench_sequence_parallel.py --worker SPEC`) trains, one run
after another, a small Llama (hidden 128, 2 layers, 4 heads, 1024 vocab, fp32, ZeRO-2, sdpa) on the shipped tiny
pretraining text:
- speed: --steps steps at --seq-len with the same global batch (4 sequences per step) at SP=1 (2 data-parallel
  ranks, micro-batch 1, accumulation 2) and SP=2 (one group, micro-batch 2, accumulation 2: each rank holds half
  of 2 sequences, the same tokens per rank); tokens/s is the median of the steps after the first;
- length: one step at each --ladder length, at SP=1 and SP=2, micro-batch 1 (the peak is the first backward's);
  the longest that trains within --cap-mb.
Memory is each rank's peak resident memory during the run above its resident memory just before it (a thread reads
/proc/self/statm every 2 ms; the process's lifetime peak, ru_maxrss, would carry over from run to run; glibc is told
to give every large block back when it is freed), the larger of the 2 ranks. On CPU ranks that is activations, logits and the allocator's working set; the model and optimizer of
this small model are a few MB.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ["model.hidden_size=128", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
         "model.intermediate_size=352", "model.vocab_size=1024", "model.attn_implementation=sdpa",
         "deepspeed.zero_optimization.stage=2", "train.lr=1e-3", "train.warmup_steps=1", "train.eval_every=1000",
         "train.save_every=0", "train.export_hf=false", "logging.log_every=1", "data.eval_fraction=0.15",
         "model.tiled_logits=0"]


def runs(args) -> list[dict]:
    # first, a run whose numbers are dropped: a process's first training pays one-time costs (imports done lazily,
    # the tokenizer, DeepSpeed's ops, the data cache) that would land in whichever run came first
    out = [{"kind": "warmup", "sp": 1, "seq_len": 1024, "steps": 1,
            "overrides": ["train.micro_batch_size=1", "train.grad_accum=1"]}]
    for sp, micro in ((1, 1), (2, 2)):  # the same 4 sequences per step (micro x accum x world / sp)
        out.append({"kind": "speed", "sp": sp, "seq_len": args.seq_len, "steps": args.steps,
                    "overrides": [f"train.micro_batch_size={micro}", "train.grad_accum=2"]})
    for sp in (1, 2):
        for seq_len in args.ladder:
            out.append({"kind": "ladder", "sp": sp, "seq_len": seq_len, "steps": 1,
                        "overrides": ["train.micro_batch_size=1", "train.grad_accum=1"]})
    return out


def overrides_of(run: dict, out_dir: Path) -> list[str]:
    return MODEL + run["overrides"] + [
        f"deepspeed.sequence_parallel_size={run['sp']}", f"data.seq_len={run['seq_len']}",
        f"model.max_position_embeddings={max(run['seq_len'], 128)}", f"train.max_steps={run['steps']}",
        f"train.output_dir={out_dir}"]


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakResident:
    """The peak resident memory above the level at entry, sampled every 2 ms on a thread."""

    def __enter__(self):
        self.base = self.peak = resident_bytes()
        self.running = True
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()
        return self

    def _watch(self):
        while self.running:
            self.peak = max(self.peak, resident_bytes())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, resident_bytes())

    @property
    def above_base(self) -> int:
        return self.peak - self.base


def worker(spec_path: str) -> None:
    import gc

    import torch.distributed as dist

    from trainer.errors import UserError
    from trainer.train.run import run_training
    spec = json.loads(Path(spec_path).read_text())
    results = []
    for number, run in enumerate(spec["runs"]):
        out_dir = Path(spec["work"]) / f"run{number}"
        gc.collect()
        error = None
        with PeakResident() as peak:
            try:
                run_training("tiny_cpu", overrides_of(run, out_dir))
            except (UserError, RuntimeError) as err:  # a length that does not fit the data or the memory
                error = str(err).splitlines()[0][:200]
        peaks = [None] * dist.get_world_size() if dist.is_initialized() else [peak.above_base]
        if dist.is_initialized():
            dist.all_gather_object(peaks, peak.above_base)
        results.append({**run, "peak_mb_per_rank": [p / 1e6 for p in peaks], "error": error,
                        "tokens_per_s": tokens_per_s(out_dir)})
        if os.environ.get("RANK", "0") == "0":
            print(f"bench: {json.dumps(results[-1])}", flush=True)
    if os.environ.get("RANK", "0") == "0":
        Path(spec["results"]).write_text(json.dumps(results, indent=1))


def tokens_per_s(run_dir: Path):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if '"tokens_per_s"' in line] if (run_dir / "metrics.jsonl").exists() else []
    later = [row["tokens_per_s"] for row in rows if row.get("step", 0) > 1]
    return statistics.median(later) if later else None


def report(results: list[dict], cap_mb: float) -> None:
    speed = {r["sp"]: r for r in results if r["kind"] == "speed"}
    print("\nspeed: same global batch (4 sequences per step), seq_len", speed[1]["seq_len"])
    print(f"{'SP':>3} {'tokens/s (all ranks)':>21} {'peak MB per rank (max)':>23}")
    for sp, r in sorted(speed.items()):
        print(f"{sp:>3} {r['tokens_per_s'] or 0:>21.0f} {max(r['peak_mb_per_rank']):>23.0f}")
    if speed[1]["tokens_per_s"] and speed[2]["tokens_per_s"]:
        print(f"SP=2 / SP=1: tokens/s {speed[2]['tokens_per_s'] / speed[1]['tokens_per_s']:.2f}, peak memory "
              f"{max(speed[2]['peak_mb_per_rank']) / max(speed[1]['peak_mb_per_rank']):.2f}")
    print(f"\nlength: peak MB per rank (max of 2) by seq_len, micro-batch 1; cap {cap_mb:.0f} MB")
    longest = {}
    for sp in (1, 2):
        ladder = sorted((r for r in results if r["kind"] == "ladder" and r["sp"] == sp), key=lambda r: r["seq_len"])
        cells = []
        for r in ladder:
            peak = max(r["peak_mb_per_rank"])
            fits = r["error"] is None and peak <= cap_mb
            cells.append(f"{r['seq_len']}: {peak:.0f}{'' if r['error'] is None else ' (failed)'}")
            if fits:
                longest[sp] = r["seq_len"]
        print(f"SP={sp}: " + ", ".join(cells))
    print(f"longest seq_len within {cap_mb:.0f} MB: SP=1 {longest.get(1)}, SP=2 {longest.get(2)}"
          + (f" -> ratio {longest[2] / longest[1]:.1f}" if longest.get(1) and longest.get(2) else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--cap-mb", type=float, default=256)
    parser.add_argument("--ladder", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--port", type=int, default=29760)
    parser.add_argument("--results", help="reuse a results JSON instead of running (prints the tables again)")
    args, _ = parser.parse_known_args()
    if args.worker:
        worker(args.worker)
        return 0
    if args.results:
        report(json.loads(Path(args.results).read_text()), args.cap_mb)
        return 0
    work = Path(tempfile.mkdtemp(prefix="bench_sp_"))
    spec = {"runs": runs(args), "work": str(work), "results": str(work / "results.json")}
    (work / "spec.json").write_text(json.dumps(spec))
    deepspeed = str(Path(sys.executable).with_name("deepspeed"))
    # glibc returns a freed tensor's memory to the OS only when it was mmap'd; its threshold otherwise grows with the
    # first large free and later tensors stay in the heap, so each run's resident peak would hide under the last's
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    code = subprocess.call([deepspeed, "--num_gpus", "2", "--master_port", str(args.port), __file__, "--worker",
                            str(work / "spec.json")], cwd=ROOT, env=env)
    if code or not (work / "results.json").exists():
        print(f"bench: the launch failed (exit {code}); runs in {work}", file=sys.stderr)
        return 1
    report(json.loads((work / "results.json").read_text()), args.cap_mb)
    print(f"\nresults: {work / 'results.json'} (--results to print again with another --cap-mb)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
