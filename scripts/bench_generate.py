"""Generation speed: `trainer generate` (deepspeed.init_inference) against plain transformers `model.generate`.

    .venv/bin/python scripts/bench_generate.py [--model DIR] [--new-tokens 64] [--batch-sizes 1,8] [--repeats 3]

Both contenders run in one process on the same model (an HF directory; default: a ~40M-parameter random Llama
built here with the shipped tokenizer), the same prompts, dtype and greedy decoding, and always generate
--new-tokens tokens (EOS ignored), so they do the same work. They alternate, --repeats rounds, and the median
tokens/s of each is compared (the goal: trainer >= 0.95x transformers at TP=1). Time to first token is the
median over the rounds. With --tp2 (default on when 2+ cores) the same prompts then run through `trainer generate`
on 2 ranks with AutoTP (`deepspeed --num_gpus 2 --module trainer generate --tp 2`), reported beside them, both
as the README's line runs it (no OMP_NUM_THREADS) and with one thread count per rank set by the benchmark.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["Once upon a time", "The little cat sat on the", "She said that", "Tom and his dog went to the park and",
           "A", "In the morning the sun", "Why is the sky blue? Because", "The capital of"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="HF model directory (default: a random ~40M Llama made here)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tp2", action=argparse.BooleanOptionalAction, default=(os.cpu_count() or 1) >= 2)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    with tempfile.TemporaryDirectory() as work:
        model_dir = args.model or make_model(Path(work) / "model")
        rows = []
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            rows.append(compare(model_dir, batch, args.new_tokens, args.repeats))
            if args.tp2:
                rows[-1]["trainer_tp2"] = tp2(model_dir, batch, args.new_tokens, Path(work), args.repeats)
    print_table(rows)
    return 0 if all(r["ratio"] >= 0.95 for r in rows) else 1


def make_model(path: Path, kv_heads: int = 4) -> str:
    """The bench model: a random 8-layer Llama (8 query heads, `kv_heads` key/value heads) and the tiny tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                                  num_key_value_heads=kv_heads, intermediate_size=1376, vocab_size=1024,
                                  max_position_embeddings=512)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(REPO / "data" / "tiny" / "tokenizer").save_pretrained(path)
    return str(path)


def compare(model_dir: str, batch: int, new_tokens: int, repeats: int, dtype: str = "fp32",
            kernel_inject: bool = False) -> dict:
    """Alternating rounds of both contenders in this process; medians of tokens/s and time to first token.
    On CUDA both run on the GPU (scripts/gpu_check.py passes a 16-bit dtype and, once, kernel injection)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.data.prompts import Prompt
    from trainer.distributed import start_distributed
    from trainer.infer.generate import Settings, generate_all
    from trainer.infer.runner import start_runner
    from trainer.infer.source import architecture, load_model, resolve_source
    start_distributed()
    source = resolve_source(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    runner = start_runner(lambda: load_model(source, torch_dtype), architecture(source), 1, dtype, kernel_inject,
                          "off", None)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(device).eval()
    prompts = [Prompt(PROMPTS[i % len(PROMPTS)], "bench") for i in range(batch)]
    settings = Settings(new_tokens, False, 1.0, 1.0, 0, batch, False, ignore_eos=True)
    ours, theirs, first = [], [], []
    for _ in range(repeats + 1):  # the first round warms both up and is not counted
        started = time.perf_counter()
        results = generate_all(runner, tokenizer, prompts, settings)
        ours.append(sum(r.tokens for r in results) / (time.perf_counter() - started))
        first.append(results[0].time_to_first_token_s)
        theirs.append(plain_generate(plain, tokenizer, prompts, new_tokens))
    ours, theirs, first = ours[1:], theirs[1:], first[1:]
    return {"batch": batch, "new_tokens": new_tokens, "trainer": statistics.median(ours),
            "transformers": statistics.median(theirs), "ratio": statistics.median(ours) / statistics.median(theirs),
            "ttft_s": statistics.median(first)}


def plain_generate(model, tokenizer, prompts, new_tokens: int) -> float:
    """Tokens/s of transformers' generate on the same left-padded batch, greedy, EOS ignored, with its KV cache."""
    import torch

    from trainer.data.prompts import encode_left_padded
    batch = {k: v.to(model.device) for k, v in encode_left_padded(tokenizer, [p.text for p in prompts]).items()}
    started = time.perf_counter()
    with torch.no_grad():
        # the KV cache on whatever the directory's generation_config says: exports made before the trainer wrote
        # serving configs carry training's use_cache=false, and a baseline without the cache is 1.6-4.6x slower
        out = model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             use_cache=True, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    elapsed = time.perf_counter() - started
    return (out.shape[1] - batch["input_ids"].shape[1]) * len(prompts) / elapsed


def tp2(model_dir: str, batch: int, new_tokens: int, work: Path, rounds: int) -> dict:
    """`trainer generate --tp 2` on 2 ranks, twice: as the README writes it (no OMP_NUM_THREADS: the trainer gives
    each rank its share of the cores) and with the thread count a benchmark would set itself (cores / 2). Its own
    tokens/s (wall time of generate, from its JSONL), best of `rounds` runs of each, alternating. A third variant,
    every rank taking every core (OMP_NUM_THREADS=cores), is what the README's line ran before the trainer set it."""
    prompts = work / f"prompts_{batch}.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": PROMPTS[i % len(PROMPTS)]}) + "\n" for i in range(batch)))
    bare = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cores = os.cpu_count() or 2
    variants = {"readme": bare, "threads_set": {**bare, "OMP_NUM_THREADS": str(max(cores // 2, 1))},
                "every_core": {**bare, "OMP_NUM_THREADS": str(cores)}}  # what the README's line ran before the fix
    best: dict[str, dict] = {}
    for _ in range(rounds):
        for name, env in variants.items():
            got = _tp2_once(model_dir, batch, new_tokens, work, prompts, env)
            if got["tokens_per_s"] > best.get(name, {}).get("tokens_per_s", 0):
                best[name] = got
    return {**best["threads_set"], "readme_tokens_per_s": best["readme"]["tokens_per_s"],
            "every_core_tokens_per_s": best["every_core"]["tokens_per_s"]}


def _tp2_once(model_dir: str, batch: int, new_tokens: int, work: Path, prompts: Path, env: dict) -> dict:
    out = work / f"tp2_{batch}.jsonl"
    deepspeed = Path(sys.executable).parent / "deepspeed"
    cmd = [str(deepspeed), "--num_gpus", "2", "--master_port", "29790", "--module", "trainer", "generate",
           "--model", model_dir, "--prompts", str(prompts), "--batch-size", str(batch), "--tp", "2",
           "--max-new-tokens", str(new_tokens), "--ignore-eos", "--greedy", "--format", "jsonl", "-o", str(out)]
    subprocess.run(cmd, cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, check=True, capture_output=True, text=True,
                   timeout=1200)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    return {"tokens_per_s": sum(r["tokens_per_s"] for r in rows), "ttft_s": rows[0]["time_to_first_token_s"]}


def print_table(rows: list[dict]) -> None:
    print(f"{'batch':>5} {'new':>4} {'trainer tok/s':>14} {'transformers':>13} {'ratio':>6} {'ttft s':>7} "
          f"{'tp2 tok/s':>10} {'tp2 ttft':>9} {'README tp2':>11} {'ratio':>6} {'every core':>11}")
    for r in rows:
        tp = r.get("trainer_tp2") or {}
        print(f"{r['batch']:>5} {r['new_tokens']:>4} {r['trainer']:>14.1f} {r['transformers']:>13.1f} "
              f"{r['ratio']:>6.3f} {r['ttft_s']:>7.3f} {tp.get('tokens_per_s', float('nan')):>10.1f} "
              f"{tp.get('ttft_s', float('nan')):>9.3f} {tp.get('readme_tokens_per_s', float('nan')):>11.1f} "
              f"{tp.get('readme_tokens_per_s', float('nan')) / tp.get('tokens_per_s', float('nan')):>6.3f} "
              f"{tp.get('every_core_tokens_per_s', float('nan')):>11.1f}")
    if any("trainer_tp2" in r for r in rows):
        readme = all(r["trainer_tp2"]["readme_tokens_per_s"] >= 0.9 * r["trainer_tp2"]["tokens_per_s"] for r in rows)
        print("goal: the README's TP=2 line (no OMP_NUM_THREADS) >= 0.9x TP=2 with the threads set ->",
              "met" if readme else "MISSED")
    print("goal: trainer >= 0.95x transformers at TP=1 ->", "met" if all(r["ratio"] >= 0.95 for r in rows) else
          "MISSED")


if __name__ == "__main__":
    raise SystemExit(main())
