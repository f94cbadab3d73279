"""Benchmark the prepared-data layer (trainer/data) against the issue's targets, on synthetic corpora.

    .venv/bin/python scripts/bench_data.py                        # 20 M and 200 M tokens in /tmp/bench_data
    .venv/bin/python scripts/bench_data.py --tokens 50e6 --keep   # a smaller large corpus; keep the files
    .venv/bin/python scripts/bench_data.py --small-tokens 15e6 --tokens 60e6 --repeats 5 --fast-baseline

Two jsonl corpora of {"text": ...} documents (200-3000 words each, drawn with a seeded numpy RNG from the
words of the shipped tiny corpus with their frequencies, sized to about --small-tokens and --tokens tokens
of data/tiny/tokenizer) are written to --workdir. Every measurement runs in a fresh subprocess of this
file (`--worker NAME`), so imports and earlier work do not leak into it:

  1 prepare      `trainer.data.prepare.prepare` over the jsonl (eval_fraction 0.05, --num-proc processes), at
                 each --records-per-shard, against a bare loop: the same tokenizer's
                 `backend_tokenizer.encode_batch` over the same texts (read and json-parsed from the same
                 file, batches of 1,000) in as many forked processes. Both run with
                 TOKENIZERS_PARALLELISM=false, so one process = one core. The contenders run --repeats
                 rounds, interleaved (the order rotates each round); the table shows each one's best wall
                 time and the ratio of the best times (same text, same tokens: bare s / prepare s). Tokens per
                 CPU-second (process + waited children) is printed too. Peak RSS: the driver samples every
                 process of the contender's tree (psutil, every 20 ms) and sums them (shared pages count in
                 every process that maps them, as `ps` shows them); the worst round is shown. prepare calls
                 `encode_batch_fast` (the same ids without character offsets); --fast-baseline adds a bare loop
                 calling it too, as information.
  2 RSS          RSS (psutil) after imports and the tokenizer, then after `build_datasets` on the prepared
                 directory, a MicroBatchLoader (micro 8 x seq 128, dp 2 rank 0: tiny_cpu's shape) and
                 --batches micro-batches of its shuffled order (spread over the whole corpus). The growth
                 must be <= 100 MB and the same (+-10%) for both corpora; the issue measured the old
                 in-memory path at ~150 bytes per token per rank.
  3 start        time from calling build_datasets to the first micro-batch, in that fresh process (the
                 shards are in the page cache: they were just written).
  4 loader rate  micro-batches/s of the same loader over --loader-seconds, against tiny_cpu's consumption
                 of one micro-batch per rank per optimizer step of --tiny-step-s seconds.
  5 disk         bytes of the prepared directory (all files) / tokens (train + eval), uint16 ids.

Everything generated stays under --workdir and is deleted at the end unless --keep.
"""
from __future__ import annotations

import argparse
import collections
import gc
import importlib
import json
import operator
import os
import platform
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

TOKENIZER = REPO / "data" / "tiny" / "tokenizer"
WORDS_FROM = REPO / "data" / "tiny" / "pretrain.jsonl"
MIN_WORDS, MAX_WORDS = 200, 3000
SEQ_LEN, MICRO, DP_SIZE, DP_RANK = 128, 8, 2, 0          # tiny_cpu's micro-batch on 2 ranks
EVAL_FRACTION = 0.05                                      # tiny_cpu's
OLD_BYTES_PER_TOKEN = 150                                 # the measurement of the old path
RECORDS_PER_SHARD = 100_000                               # prepare-data's default (trainer/data/__init__.py)
CREATED = ("corpora", "prepared", "tmp", "hf", "cache", "results")  # what --workdir gets (and loses at the end)


# ============================================================================================ corpus

def word_table(path: Path = WORDS_FROM) -> tuple[list[str], np.ndarray]:
    """The shipped corpus's words, and a lookup table in which each word appears in proportion to its count
    (uniform draws from it are draws by frequency, much faster than rng.choice with p)."""
    counts = collections.Counter()
    with open(path) as f:
        for line in f:
            counts.update(json.loads(line)["text"].split())
    words = [w for w, _ in counts.most_common() if w.isprintable() and '"' not in w and "\\" not in w]
    weights = np.array([counts[w] for w in words], dtype=np.float64)
    repeats = np.maximum(1, np.round(weights / weights.sum() * 65536)).astype(np.int64)
    return words, np.repeat(np.arange(len(words)), repeats)


def documents(rng: np.random.Generator, words: list[str], table: np.ndarray, lengths: np.ndarray) -> list[str]:
    idx = table[rng.integers(0, len(table), int(lengths.sum()))]
    drawn = operator.itemgetter(*idx.tolist())(words)
    ends = np.cumsum(lengths).tolist()
    return [" ".join(drawn[a:b]) for a, b in zip([0] + ends[:-1], ends)]


def tokens_per_word(tokenizer, words: list[str], table: np.ndarray, seed: int) -> tuple[float, float]:
    """(tokens per word, tokens per document) of this tokenizer on a 300-document sample, as prepare counts
    them (its special tokens plus the EOS prepare appends)."""
    rng = np.random.default_rng(seed + 1)
    lengths = rng.integers(MIN_WORDS, MAX_WORDS + 1, 300)
    ids = tokenizer(documents(rng, words, table, lengths), verbose=False)["input_ids"]
    slope, intercept = np.polyfit(lengths, [len(x) + 1 for x in ids], 1)
    return float(slope), float(intercept)


def document_lengths(rng: np.random.Generator, tokens: int, per_word: float, per_doc: float) -> np.ndarray:
    """Words per document, varied uniformly in [MIN_WORDS, MAX_WORDS], until about `tokens` tokens."""
    bound = int(tokens / (per_word * MIN_WORDS + per_doc)) + 2
    lengths = rng.integers(MIN_WORDS, MAX_WORDS + 1, bound)
    estimate = np.cumsum(lengths * per_word + per_doc)
    return lengths[:int(np.searchsorted(estimate, tokens)) + 1]


def write_corpus(path: Path, tokens: int, seed: int, tokenizer) -> dict:
    """Write the jsonl (reused when an earlier --keep run wrote the same one); returns its description."""
    meta_path = path.with_suffix(".meta.json")
    wanted = {"tokens": tokens, "seed": seed, "min_words": MIN_WORDS, "max_words": MAX_WORDS}
    if path.is_file() and meta_path.is_file() and json.loads(meta_path.read_text())["wanted"] == wanted:
        return {**json.loads(meta_path.read_text()), "reused": True}
    started = time.perf_counter()
    words, table = word_table()
    per_word, per_doc = tokens_per_word(tokenizer, words, table, seed)
    rng = np.random.default_rng(seed)
    lengths = document_lengths(rng, tokens, per_word, per_doc)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for start in range(0, len(lengths), 1000):  # ~1.6 M words per draw
            f.writelines(f'{{"text": "{text}"}}\n' for text in documents(rng, words, table, lengths[start:start + 1000]))
    meta = {"wanted": wanted, "documents": len(lengths), "words": int(lengths.sum()), "bytes": path.stat().st_size,
            "tokens_per_word": per_word, "estimated_tokens": int(lengths.sum() * per_word + len(lengths) * per_doc),
            "seconds": time.perf_counter() - started}
    meta_path.write_text(json.dumps(meta))
    return meta


# ============================================================================================ workers

def cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def peak_rss_bytes() -> int:
    own, children = (resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return max(own, children) * 1024  # KiB on Linux


def load_tiny_tokenizer():
    from trainer.config import ModelConfig
    from trainer.data import load_tokenizer
    return load_tokenizer(ModelConfig(tokenizer=str(TOKENIZER)))


def data_config(source: str, cache_dir: str):
    from trainer.config import DataConfig
    return DataConfig(task="pretrain", source=source, seq_len=SEQ_LEN, eval_fraction=EVAL_FRACTION,
                      cache_dir=cache_dir)


def prepare_worker(job: dict) -> dict:
    from trainer.data.prepare import prepare
    tokenizer = load_tiny_tokenizer()
    out = Path(job["out"])
    shutil.rmtree(out, ignore_errors=True)  # a leftover would be reused shard by shard, not timed
    wall, cpu = time.perf_counter(), cpu_seconds()
    manifest = prepare(data_config(job["jsonl"], job["cache_dir"]), job["jsonl"], tokenizer, out,
                       job["records_per_shard"], job["num_proc"], progress=True)
    wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
    splits = manifest["splits"]
    return {"seconds": wall, "cpu_seconds": cpu, "tokens": sum(s["tokens"] for s in splits.values()),
            "documents": sum(s["documents"] for s in splits.values()), "dtype": manifest["dtype"],
            "shards": sum(len(s["shards"]) for s in splits.values()), "peak_rss": peak_rss_bytes()}


_ENCODE = None  # the bare loop's tokenizers.Tokenizer method, inherited by its forked processes


def byte_ranges(path: Path, parts: int) -> list[tuple[str, int, int]]:
    """`parts` ranges of the file that start and end on line boundaries."""
    size, cuts = path.stat().st_size, [0]
    with open(path, "rb") as f:
        for k in range(1, parts):
            f.seek(max(cuts[-1], size * k // parts))
            f.readline()
            cuts.append(f.tell())
    return [(str(path), a, b) for a, b in zip(cuts, cuts[1:] + [size])]


def encode_range(part: tuple[str, int, int]) -> tuple[int, int]:
    """(tokens, documents) of the lines in [start, end): read, json-parsed and encoded 1,000 at a time."""
    path, start, end = part
    tokens = docs = 0
    with open(path, "rb") as f:
        f.seek(start)
        position, texts = start, []
        while position < end and (line := f.readline()):
            position += len(line)
            if line.strip():
                texts.append(json.loads(line)["text"])
            if len(texts) == 1000 or position >= end:
                tokens += sum(len(e.ids) for e in _ENCODE(texts))
                docs, texts = docs + len(texts), []
    return tokens, docs


def baseline_worker(job: dict) -> dict:
    import multiprocessing
    global _ENCODE
    _ENCODE = getattr(load_tiny_tokenizer().backend_tokenizer, job.get("method", "encode_batch"))
    ranges = byte_ranges(Path(job["jsonl"]), job["num_proc"])
    wall, cpu = time.perf_counter(), cpu_seconds()
    if job["num_proc"] == 1:
        counts = [encode_range(ranges[0])]
    else:
        with multiprocessing.get_context("fork").Pool(job["num_proc"]) as pool:
            counts = pool.map(encode_range, ranges)
    wall, cpu = time.perf_counter() - wall, cpu_seconds() - cpu
    return {"seconds": wall, "cpu_seconds": cpu, "tokens": sum(c[0] for c in counts),
            "documents": sum(c[1] for c in counts)}


def memory(process) -> dict:
    """RSS (psutil) and its anonymous / file-backed parts (/proc, Linux)."""
    out = {"rss": process.memory_info().rss}
    try:
        for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) * 1024
    except OSError:
        pass
    return out


def load_worker(job: dict) -> dict:
    started = time.perf_counter()
    import psutil
    importlib.import_module("torch")  # the loader yields tensors: imported before the first measurement
    from trainer.data import MicroBatchLoader, build_datasets
    tokenizer = load_tiny_tokenizer()
    cfg = data_config(job["prepared"], job["cache_dir"])
    process, imports = psutil.Process(), time.perf_counter() - started
    gc.collect()
    before = memory(process)
    clock = time.perf_counter()
    data = build_datasets(cfg, tokenizer, seed=1234)
    loader = MicroBatchLoader(data.train, MICRO, DP_RANK, DP_SIZE, grad_accum=1)
    batches = iter(loader)
    next(batches)
    first = time.perf_counter() - clock
    for _ in range(job["batches"] - 1):
        next(batches)
    gc.collect()
    after = memory(process)
    return {"imports_seconds": imports, "start_seconds": first, "before": before, "after": after,
            "spread": spread(loader, job["batches"]), "batches_per_s": loader_rate(batches, job["loader_seconds"]),
            "train_sequences": len(data.train)}


def spread(loader, batches: int) -> dict:
    """Where the first `batches` micro-batches of this rank read: share of the corpus spanned, shards touched."""
    ids = np.concatenate([loader.global_ids(k) for k in range(batches)])
    _, samples = loader.stream.sample_ids(ids)
    split = loader.stream.sources[0].samples.split
    starts = samples * SEQ_LEN
    shards = np.unique(np.searchsorted(split.shard_starts, starts, side="right") - 1)
    return {"first": float(starts.min() / split.total_tokens), "last": float(starts.max() / split.total_tokens),
            "shards_touched": len(shards), "shards": len(split.shard_starts)}


def loader_rate(batches, seconds: float) -> float:
    count, clock = 0, time.perf_counter()
    while time.perf_counter() - clock < seconds:
        next(batches)
        count += 1
    return count / (time.perf_counter() - clock)


WORKERS = {"prepare": prepare_worker, "baseline": baseline_worker, "load": load_worker}


class TreeMemory:
    """The peak, over the life of a process, of the RSS of it and all its descendants summed, and of the largest
    single process: sampled every `interval` seconds in a thread of the driver (a worker cannot see its own
    children's peak: RUSAGE_CHILDREN reports only the largest waited child)."""

    def __init__(self, pid: int, interval: float = 0.02):
        import psutil
        self.psutil, self.process, self.interval = psutil, psutil.Process(pid), interval
        self.peak = self.largest = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.stopped.is_set():
            try:
                tree = [self.process, *self.process.children(recursive=True)]
            except self.psutil.Error:
                return
            sizes = []
            for member in tree:
                try:
                    sizes.append(member.memory_info().rss)
                except self.psutil.Error:  # ended between the listing and the reading
                    pass
            self.peak, self.largest = max(self.peak, sum(sizes)), max([self.largest, *sizes])
            self.stopped.wait(self.interval)

    def stop(self) -> dict:
        self.stopped.set()
        self.thread.join()
        return {"tree_peak_rss": self.peak, "largest_rss": self.largest}


def run_worker(name: str, job: dict, workdir: Path) -> dict:
    """This file as `--worker NAME` in a fresh process, its process tree's memory sampled; its result comes back
    through a JSON file."""
    result = workdir / "results" / f"{name}-{len(list((workdir / 'results').glob('*.json')))}.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "TOKENIZERS_PARALLELISM": "false", "TMPDIR": str(workdir / "tmp"),
           "HF_DATASETS_CACHE": str(workdir / "hf"), "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--job", json.dumps(job),
               "--result", str(result)]
    process = subprocess.Popen(command, env=env, cwd=REPO)
    sampler = TreeMemory(process.pid)
    if process.wait() != 0:
        raise subprocess.CalledProcessError(process.returncode, command)
    return {**json.loads(result.read_text()), **sampler.stop()}


# ============================================================================================ driver

def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=float, default=200e6, help="tokens of the large corpus (default 200e6)")
    parser.add_argument("--small-tokens", type=float, default=20e6, help="tokens of the small corpus (default 20e6)")
    parser.add_argument("--workdir", default="/tmp/bench_data", help="where corpora and prepared data are written")
    parser.add_argument("--num-proc", type=int, default=os.cpu_count() or 1, help="prepare processes (default: all cores)")
    parser.add_argument("--records-per-shard", type=shard_sizes, default=[RECORDS_PER_SHARD, 1_000],
                        help=f"documents per prepared shard, comma-separated: prepare runs at each (default "
                             f"{RECORDS_PER_SHARD},1000: prepare-data's default, and small shards)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds of bare loop and prepare, interleaved; the best of each counts (default 3)")
    parser.add_argument("--batches", type=int, default=200, help="micro-batches read before the RSS measurement")
    parser.add_argument("--loader-seconds", type=float, default=5.0, help="how long the loader rate is measured")
    parser.add_argument("--tiny-step-s", type=float, default=0.35,
                        help="tiny_cpu's seconds per optimizer step (one micro-batch per rank); default 0.35, "
                             "measured on the 2-core development machine")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic corpora")
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    parser.add_argument("--skip-prepare-compare", action="store_true", help="do not run the bare tokenizers loop")
    parser.add_argument("--fast-baseline", action="store_true",
                        help="also run the bare loop with encode_batch_fast (what prepare calls: no offsets), as info")
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def shard_sizes(text: str) -> list[int]:
    return [int(float(part)) for part in text.split(",") if part.strip()]


def say(message: str) -> None:
    print(f"[bench_data] {message}", file=sys.stderr, flush=True)


def tokens_label(tokens: float) -> str:
    return f"{tokens / 1e6:.1f} M"


def measure_corpus(label: str, tokens: int, args, workdir: Path, tokenizer) -> dict:
    jsonl = workdir / "corpora" / f"{label}.jsonl"
    say(f"{label}: writing ~{tokens_label(tokens)} tokens of jsonl")
    corpus = write_corpus(jsonl, tokens, args.seed, tokenizer)
    how = "reused from an earlier --keep run" if corpus.get("reused") else f"in {corpus['seconds']:.0f} s"
    say(f"{label}: {corpus['documents']:,} documents, {corpus['bytes'] / 1e9:.2f} GB {how}")
    jobs = {"baseline": {"jsonl": str(jsonl), "num_proc": args.num_proc}} if not args.skip_prepare_compare else {}
    if args.fast_baseline and jobs:
        jobs["baseline fast"] = {**jobs["baseline"], "method": "encode_batch_fast"}
    for size in args.records_per_shard:
        jobs[f"prepare {size}"] = {"jsonl": str(jsonl), "out": str(workdir / "prepared" / f"{label}-{size}"),
                                   "num_proc": args.num_proc, "cache_dir": str(workdir / "cache"),
                                   "records_per_shard": size}
    runs: dict[str, list[dict]] = {name: [] for name in jobs}
    names = list(jobs)
    for round_ in range(args.repeats):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:  # rotated: none always first
            run = run_worker(name.split()[0], jobs[name], workdir)
            runs[name].append(run)
            say(f"{label}: round {round_ + 1}/{args.repeats}: {name}: {run['seconds']:.1f} s, tree peak "
                f"{mb(run['tree_peak_rss'])}")
    best = {name: {**min(found, key=lambda r: r["seconds"]),
                   "worst_tree_peak_rss": max(r["tree_peak_rss"] for r in found),
                   "worst_largest_rss": max(r["largest_rss"] for r in found),
                   "all_seconds": [r["seconds"] for r in found]} for name, found in runs.items()}
    first = str(args.records_per_shard[0])
    out = Path(jobs[f"prepare {first}"]["out"])
    result = {"corpus": corpus, "baseline": best.get("baseline"), "baseline_fast": best.get("baseline fast"),
              "prepare": best[f"prepare {first}"],
              "shards": {size: best[f"prepare {size}"] for size in args.records_per_shard}}
    result["disk_bytes"] = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    result["workdir_bytes"] = sum(p.stat().st_size for p in workdir.rglob("*") if p.is_file())
    say(f"{label}: build_datasets + loader in a fresh process (prepared at {first} documents per shard)")
    result["load"] = run_worker("load", {"prepared": str(out), "cache_dir": str(workdir / "cache"),
                                         "batches": args.batches, "loader_seconds": args.loader_seconds}, workdir)
    return result


# --- the table ---------------------------------------------------------------------------------------

def verdict(ok: bool) -> str:
    return "OK" if ok else "MISSED"


def mb(n: float) -> str:
    if abs(n) < 10e6:
        return f"{n / 1e6:.2f} MB"
    return f"{n / 1e6:.1f} MB" if abs(n) < 1e9 else f"{n / 1e9:.1f} GB"


def rate(n: float) -> str:
    return f"{n / 1e6:.2f} M/s" if n >= 1e6 else f"{n / 1e3:.0f} k/s"


def per_core(run: dict, procs: int) -> float:
    return run["tokens"] / run["seconds"] / procs


def prepare_rows(results: list[dict], args) -> list[tuple[str, str, list[str], str]]:
    """Target 1 per shard size: tokens/s and the tree's peak RSS, each against the bare loop's."""
    out, p = [], args.num_proc
    compared = all(r["baseline"] for r in results)
    for size in args.records_per_shard:
        runs = [r["shards"][size] for r in results]
        if not compared:
            out.append((f"1 prepare tokens/s per core, {size:,}/shard", "", [rate(per_core(x, p)) for x in runs],
                        "not compared"))
            continue
        # the same text and the same tokens (prepare counts the EOS it appends too): the ratio of wall times
        speed = [r["baseline"]["seconds"] / x["seconds"] for r, x in zip(results, runs)]
        out.append((f"1 prepare tokens/s per core, {size:,}/shard", ">= 0.95x bare loop",
                    [f"{rate(per_core(x, p))} ({s:.2f}x)" for x, s in zip(runs, speed)],
                    verdict(all(s >= 0.95 for s in speed))))
        memory = [x["worst_tree_peak_rss"] / r["baseline"]["worst_tree_peak_rss"] for r, x in zip(results, runs)]
        out.append((f"  tree peak RSS, {size:,}/shard", "<= 1.5x bare loop",
                    [f"{mb(x['worst_tree_peak_rss'])} ({m:.2f}x)" for x, m in zip(runs, memory)],
                    verdict(all(m <= 1.5 for m in memory))))
        out.append((f"  largest process, {size:,}/shard", "(info)", [mb(x["worst_largest_rss"]) for x in runs], ""))
        cpu = [(x["tokens"] / x["cpu_seconds"]) / ((r["baseline"]["tokens"] + r["baseline"]["documents"]) /
               r["baseline"]["cpu_seconds"]) for r, x in zip(results, runs)]
        out.append(("  tokens per CPU-s, prepare / bare", "(info)", [f"{c:.2f}x" for c in cpu], ""))
        out.append(("  wall s of each round: prepare", "(info)",
                    [" ".join(f"{t:.0f}" for t in x["all_seconds"]) for x in runs], ""))
    if compared:
        out.append(("  bare encode_batch tokens/s per core", "",
                    [rate((r["baseline"]["tokens"] + r["baseline"]["documents"]) / r["baseline"]["seconds"] / p)
                     for r in results], ""))
        out.append(("  bare loop: tree peak RSS / largest", "",
                    [f"{mb(r['baseline']['worst_tree_peak_rss'])} / {mb(r['baseline']['worst_largest_rss'])}"
                     for r in results], ""))
        out.append(("  wall s of each round: bare", "(info)",
                    [" ".join(f"{t:.0f}" for t in r["baseline"]["all_seconds"]) for r in results], ""))
    if compared and all(r["baseline_fast"] for r in results):
        out.append(("  bare encode_batch_fast loop (prepare: x)", "(info)",
                    [f"{rate((r['baseline_fast']['tokens'] + r['baseline_fast']['documents']) / r['baseline_fast']['seconds'] / p)}"
                     f" ({r['baseline_fast']['seconds'] / r['prepare']['seconds']:.2f}x)" for r in results], ""))
    return out


def rows(results: list[dict], args) -> list[tuple[str, str, list[str], str]]:
    """(what, goal, one cell per corpus, verdict) of every line of the table."""
    out = prepare_rows(results, args)
    growth = [r["load"]["after"]["rss"] - r["load"]["before"]["rss"] for r in results]
    spread_ok = abs(growth[-1] - growth[0]) <= 0.10 * abs(growth[0])
    out.append(("2 RSS growth per rank from data", "<= 100 MB, equal +-10%",
                [mb(g) + ("" if i == 0 else f" ({(g - growth[0]) / max(growth[0], 1):+.0%})")
                 for i, g in enumerate(growth)],
                verdict(max(growth) <= 100e6 and spread_ok)))
    anon = [r["load"]["after"].get("RssAnon", 0) - r["load"]["before"].get("RssAnon", 0) for r in results]
    filed = [r["load"]["after"].get("RssFile", 0) - r["load"]["before"].get("RssFile", 0) for r in results]
    out.append(("  of it file-backed (mapped files)", "(info)", [mb(f) for f in filed], ""))
    out.append(("  of it anonymous (private)", "(info)",
                [f"{mb(a)} = {a / r['prepare']['tokens']:.3f} B/token" for a, r in zip(anon, results)], ""))
    out.append(("  old path, 150 B/token (issue)", "(was)",
                [mb(OLD_BYTES_PER_TOKEN * r["prepare"]["tokens"]) for r in results], ""))
    out.append(("  batches read: corpus span, shards", "(info)",
                [f"{s['first']:.0%}-{s['last']:.0%}, {s['shards_touched']}/{s['shards']}"
                 for s in (r["load"]["spread"] for r in results)], ""))
    start = [r["load"]["start_seconds"] for r in results]
    out.append(("3 loader start (build -> 1st batch)", "< 2 s", [f"{s:.2f} s" for s in start],
                verdict(max(start) < 2.0)))
    speed = [r["load"]["batches_per_s"] * args.tiny_step_s for r in results]
    out.append((f"4 loader micro-batches/s (8x{SEQ_LEN}, dp 2)", ">= 100x tiny_cpu",
                [f"{r['load']['batches_per_s']:,.0f}/s = {x:,.0f}x" for r, x in zip(results, speed)],
                verdict(min(speed) >= 100)))
    per_token = [r["disk_bytes"] / r["prepare"]["tokens"] for r in results]
    out.append((f"5 disk bytes per token ({results[0]['prepare']['dtype']})", "<= 2.1",
                [f"{x:.3f} ({mb(r['disk_bytes'])})" for r, x in zip(results, per_token)],
                verdict(max(per_token) <= 2.1)))
    return out


def print_table(results: list[dict], args, conditions: list[str]) -> None:
    header = ("target", "goal", *[f"{tokens_label(r['prepare']['tokens'])} tokens" for r in results], "verdict")
    lines = [header] + [(what, goal, *cells, v) for what, goal, cells, v in rows(results, args)]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for i, line in enumerate(lines):
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip())
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print()
    for line in conditions:
        print(line)


def conditions(args, results: list[dict], load_start: tuple) -> list[str]:
    first = results[0]
    checks = [f"{tokens_label(r['prepare']['tokens'])}: prepared {r['prepare']['tokens']:,} tokens = bare "
              f"{r['baseline']['tokens']:,} + {r['baseline']['documents']:,} EOS"
              f" ({'same' if r['prepare']['tokens'] == r['baseline']['tokens'] + r['baseline']['documents'] else 'DIFFERENT'})"
              for r in results if r["baseline"]]
    return [
        f"machine: {os.cpu_count()} cores, {platform.machine()}, Linux {platform.release()}, Python {platform.python_version()}; load average "
        f"{load_start[0]:.1f} at the start, {os.getloadavg()[0]:.1f} at the end (other processes share the cores)",
        f"prepare and bare loop: {args.num_proc} process(es), TOKENIZERS_PARALLELISM=false (1 core each), "
        f"{', '.join(f'{n:,}' for n in args.records_per_shard)} documents per shard, eval_fraction {EVAL_FRACTION}; "
        f"best of {args.repeats} interleaved rounds; per core = tokens / wall s / {args.num_proc}; the bare loop's "
        f"time includes reading and json-parsing the file; targets 2-5 read the data prepared at "
        f"{args.records_per_shard[0]:,} documents per shard",
        f"corpora: {MIN_WORDS}-{MAX_WORDS} words per document from the tiny corpus's {len(word_table()[0])} words, "
        f"{first['corpus']['tokens_per_word']:.2f} tokens/word; " + "; ".join(checks),
        "file-backed RSS: pages of files mapped into the process (the loader reads shards with os.pread, so none of "
        "the corpus should be; what remains is the libraries' own mapped files)",
        f"RSS: growth from before build_datasets (after imports and tokenizer) to after {args.batches} micro-batches "
        f"(micro {MICRO} x seq {SEQ_LEN}, dp {DP_SIZE} rank {DP_RANK}), fresh process per corpus, shards in page cache",
        f"target 4: tiny_cpu consumes 1 micro-batch per rank per {args.tiny_step_s} s step (--tiny-step-s; 0.35 s "
        f"is what the 2-core development machine measures) = {1 / args.tiny_step_s:.2f}/s; loader timed for "
        f"{args.loader_seconds:g} s after the RSS measurement",
    ]


def cleanup(workdir: Path) -> None:
    for name in CREATED:
        shutil.rmtree(workdir / name, ignore_errors=True)
    try:
        workdir.rmdir()  # only when nothing else is in it
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    if args.worker:
        Path(args.result).write_text(json.dumps(WORKERS[args.worker](json.loads(args.job))))
        return 0
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    workdir, load_start = Path(args.workdir), os.getloadavg()
    for name in CREATED:
        (workdir / name).mkdir(parents=True, exist_ok=True)
    try:
        tokenizer = load_tiny_tokenizer()
        results = []
        for label, tokens in (("small", int(args.small_tokens)), ("large", int(args.tokens))):
            results.append(measure_corpus(label, tokens, args, workdir, tokenizer))
            if label == "small":
                estimate = results[0]["prepare"]["seconds"] * args.tokens / results[0]["prepare"]["tokens"]
                say(f"large: prepare estimated at ~{estimate:.0f} s from the small corpus's rate")
        print_table(results, args, conditions(args, results, load_start))
    finally:
        if not args.keep:
            cleanup(workdir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
