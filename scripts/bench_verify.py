"""What the prepared-data check (trainer/data/verify.py) costs at start-up, against a tiny_cpu start-up.

    .venv/bin/python scripts/bench_verify.py                  # 1 GB of shards in /tmp/bench_verify
    .venv/bin/python scripts/bench_verify.py --gb 4 --keep    # 4 GB; keep the files

1 data      a prepared directory of --gb GB of uint16 token shards (--shard-mb each; random ids below the tiny
            tokenizer's vocabulary, documents of 200-3000 tokens) written by the trainer's own writer
            (shards.write_shard, write_manifest), plus a --source-mb MB jsonl source.
2 check     in a fresh process (`--worker`), `build_datasets` on that directory: the whole check (sizes, SHA-256,
            token ids, document ends; rank 0 alone, so its thread pool: min(4, cores)); the seconds it reports
            (`stats["verified"]`), best of --repeats. The files were just written, so they are in the page cache:
            this is the CPU cost; a cold read is bounded by the disk as well.
3 baselines in the same process: hashlib.sha256 of the same files on one thread, and a plain read of them (no hash),
            so the table shows what the check adds to a hash and what a hash adds to a read.
4 source    `contents.sha256_file` over the jsonl: the cost of keying the cache on the source's content, paid
            once per change of the source (the memo vouches for an unchanged file by stat).
5 start-up  tiny_cpu on 2 CPU ranks (deepspeed launcher, --port), train.max_steps=2: wall seconds from launch to
            step 1 in its metrics.jsonl, and the check's own seconds from its `data:` line (its data is the shipped
            tiny corpus, prepared into --workdir by a first, untimed launch, which also builds DeepSpeed's JIT ops).

Prints one table with the ratios. Everything generated stays under --workdir and is deleted unless --keep.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TOKENIZER = REPO / "data" / "tiny" / "tokenizer"


def load_tokenizer():
    from trainer.config import ModelConfig
    from trainer.data import load_tokenizer as load
    return load(ModelConfig(tokenizer=str(TOKENIZER)))


# --- 1 data ---------------------------------------------------------------------------------------------------------

def write_prepared(out: Path, gigabytes: float, shard_mb: int, tokenizer, seed: int) -> dict:
    """A prepared directory as `prepare` writes it, of synthetic ids: (bytes of shards, seconds)."""
    from trainer.data import shards
    started, rng = time.perf_counter(), np.random.default_rng(seed)
    dtype, vocab = shards.token_dtype(len(tokenizer)), len(tokenizer)
    splits, written = {}, 0
    for name, total in (("train", int(gigabytes * 1e9)), ("eval", 8 << 20)):
        entries, left, index = [], total // dtype.itemsize, 0
        while left > 0:
            tokens = min(left, (shard_mb << 20) // dtype.itemsize)
            ids = rng.integers(3, vocab, tokens, dtype=np.int64).astype(dtype)
            lengths = rng.integers(200, 3001, tokens // 200 + 1)
            ends = np.cumsum(lengths)
            ends = np.append(ends[ends < tokens], tokens)
            entries.append(shards.write_shard(out / name, index, ids, ends, None, {"records": len(ends), "first": ""}))
            written += ids.nbytes + ends.nbytes
            left, index = left - tokens, index + 1
        splits[name] = {"shards": entries, "records": sum(e["documents"] for e in entries),
                        "tokens": sum(e["tokens"] for e in entries), "documents": sum(e["documents"] for e in entries)}
    shards.write_manifest(out, {
        "format": shards.FORMAT, "task": "pretrain", "format_of_records": "text", "dtype": dtype.name,
        "vocab_size": vocab, "eos_id": tokenizer.eos_token_id, "eos_appended": True,
        "tokenizer": {"name": str(tokenizer.name_or_path), "fingerprint": shards.tokenizer_fingerprint(tokenizer)},
        "chat_template": None, "seq_len": None, "truncate": False, "identity": {}, "splits": splits})
    return {"bytes": written, "seconds": time.perf_counter() - started}


def write_source(path: Path, megabytes: int, seed: int) -> int:
    rng, words = np.random.default_rng(seed), np.array("the cat sat on a mat while one dog ran to a red barn".split())
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        while f.tell() < megabytes << 20:
            f.writelines(json.dumps({"text": " ".join(rng.choice(words, 400))}) + "\n" for _ in range(1000))
    return path.stat().st_size


# --- 2-4 the worker (a fresh process) ---------------------------------------------------------------------------------

def check_worker(job: dict) -> dict:
    from trainer.config import DataConfig
    from trainer.data import build_datasets
    from trainer.cache.contents import sha256_file
    tokenizer = load_tokenizer()
    cfg = DataConfig(task="pretrain", source=job["prepared"], seq_len=128, cache_dir=job["cache"])
    files = sorted(p for p in Path(job["prepared"]).rglob("*") if p.suffix in (".tokens", ".docs"))
    result = {"check": [], "sha256": [], "read": [], "source": []}
    for _ in range(job["repeats"]):
        result["check"].append(build_datasets(cfg, tokenizer, seed=0).stats["verified"]["seconds"])
        result["sha256"].append(timed(lambda: [sha256_plain(p) for p in files]))
        result["read"].append(timed(lambda: [read_plain(p) for p in files]))
        result["source"].append(timed(lambda: sha256_file(Path(job["source"]))))
    return result


def timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def sha256_plain(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def read_plain(path: Path) -> int:
    total = 0
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            total += len(chunk)
    return total


def run_worker(job: dict, workdir: Path) -> dict:
    result = workdir / "check.json"
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", "--job", json.dumps(job),
                    "--result", str(result)], cwd=REPO, check=True,
                   env={**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"})
    return json.loads(result.read_text())


# --- 5 a tiny_cpu start-up ----------------------------------------------------------------------------------------

def tiny_cpu_startup(workdir: Path, port: int, extensions: str | None) -> dict:
    """tiny_cpu on 2 ranks: seconds from launch to its first step in metrics.jsonl, and the check's own seconds and
    bytes from rank 0's `data:` line. A first launch prepares the tiny corpus into the cache and is not timed."""
    run = workdir / "run"
    overrides = ["train.max_steps=2", "train.warmup_steps=1", "train.eval_every=0", "train.save_every=0",
                 "train.export_hf=false", "logging.log_every=1", f"train.output_dir={run}",
                 f"data.cache_dir={workdir / 'cache'}", "train.eval_sequences=8"]
    args = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(port), "train.py",
            "--preset", "tiny_cpu", *[a for item in overrides for a in ("--set", item)]]
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
           **({"TORCH_EXTENSIONS_DIR": extensions} if extensions else {})}
    first = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True)
    if first.returncode != 0:
        raise SystemExit(f"tiny_cpu failed ({first.returncode}):\n{(first.stdout + first.stderr)[-4000:]}")
    shutil.rmtree(run)
    log = workdir / "startup.log"
    with open(log, "w") as out:
        started, to_step = time.perf_counter(), None
        proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            if to_step is None and '"loss"' in read_or_empty(run / "metrics.jsonl"):
                to_step = time.perf_counter() - started
            time.sleep(0.05)
    text = log.read_text()
    if proc.returncode != 0 or to_step is None:
        raise SystemExit(f"tiny_cpu failed ({proc.returncode}):\n{text[-4000:]}")
    found = re.search(r"'verified': \{[^}]*'bytes': (\d+)[^}]*'seconds': ([0-9.]+)", text)
    return {"seconds": to_step, "check_bytes": int(found.group(1)), "check_seconds": float(found.group(2))}


def read_or_empty(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


# --- the table ----------------------------------------------------------------------------------------------------

def table(data: dict, source_bytes: int, measured: dict, startup: dict) -> list[tuple[str, str]]:
    gb, best = data["bytes"] / 1e9, {key: min(values) for key, values in measured.items()}
    rate = {key: data["bytes"] / best[key] / 1e6 for key in ("check", "sha256", "read")}
    per_gb = best["check"] / gb
    return [
        (f"check of {gb:.2f} GB of shards (page cache), best of {len(measured['check'])}",
         f"{best['check']:.2f} s = {rate['check']:,.0f} MB/s = {per_gb:.2f} s per GB"),
        ("  hashlib.sha256 alone, 1 thread", f"{best['sha256']:.2f} s = {rate['sha256']:,.0f} MB/s"),
        ("  plain read, no hash", f"{best['read']:.2f} s = {rate['read']:,.0f} MB/s"),
        ("  check / sha256 alone", f"{best['check'] / best['sha256']:.2f}x"),
        ("source content hash (contents.sha256_file)",
         f"{source_bytes / best['source'] / 1e6:,.0f} MB/s = {best['source'] / (source_bytes / 1e9):.2f} s per GB"),
        ("tiny_cpu start-up, 2 ranks, launch -> step 1 logged", f"{startup['seconds']:.1f} s"),
        ("  of it the check (tiny corpus, rank 0 and 1 each half)",
         f"{startup['check_seconds']:.3f} s for {startup['check_bytes'] / 1e6:.1f} MB "
         f"({startup['check_seconds'] / startup['seconds']:.1%})"),
        ("1 GB check / tiny_cpu start-up", f"{per_gb / startup['seconds']:.2f}x"),
        ("GB checked in one tiny_cpu start-up's time", f"{startup['seconds'] / per_gb:.1f} GB"),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="GB of train shards (default 1)")
    parser.add_argument("--shard-mb", type=int, default=200, help="MB per shard (default 200: prepare's ~100 M tokens)")
    parser.add_argument("--source-mb", type=int, default=200, help="MB of the jsonl source hashed (default 200)")
    parser.add_argument("--repeats", type=int, default=3, help="measurements of the check (best is printed)")
    parser.add_argument("--port", type=int, default=29690, help="--master_port of the tiny_cpu launch")
    parser.add_argument("--workdir", default="/tmp/bench_verify")
    parser.add_argument("--torch-extensions-dir", help="TORCH_EXTENSIONS_DIR of the tiny_cpu launches: a private one "
                                                       "keeps DeepSpeed's JIT ops from being rebuilt by other checkouts "
                                                       "between the untimed and the timed launch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--skip-startup", action="store_true", help="do not launch tiny_cpu")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        Path(args.result).write_text(json.dumps(check_worker(json.loads(args.job))))
        return 0
    workdir = Path(args.workdir)
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    try:
        print(f"[bench_verify] writing {args.gb} GB of shards and a {args.source_mb} MB source", file=sys.stderr)
        data = write_prepared(workdir / "prepared", args.gb, args.shard_mb, load_tokenizer(), args.seed)
        source_bytes = write_source(workdir / "source" / "corpus.jsonl", args.source_mb, args.seed)
        measured = run_worker({"prepared": str(workdir / "prepared"), "cache": str(workdir / "cache"),
                               "source": str(workdir / "source" / "corpus.jsonl"), "repeats": args.repeats}, workdir)
        startup = ({"seconds": float("nan"), "check_seconds": float("nan"), "check_bytes": 0} if args.skip_startup
                   else tiny_cpu_startup(workdir, args.port, args.torch_extensions_dir))
        rows = table(data, source_bytes, measured, startup)
        width = max(len(what) for what, _ in rows)
        for what, value in rows:
            print(f"{what.ljust(width)}  {value}")
        print(f"\nmachine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}; the check ran on "
              f"min(4, cores) threads in one process; every measurement: {json.dumps(measured)}")
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
