"""Rebuild data/tiny_grpo/: the prompts of preset tiny_grpo_cpu and the small checkpoint it starts from.

    python scripts/make_grpo_start.py            # ~1 min on 2 CPU cores; writes data/tiny_grpo/{train.jsonl,start/}

The task is single-digit addition ("3+5=" -> "8"), checked by the exact_match reward. The start model (a 2-layer
Llama, ~95k parameters, a character tokenizer built with `tokenizers`, < 1 MB) is trained briefly on *noisy*
answers: the right sum in 35% of the samples, a near miss (the sum +-1..3) otherwise, drawn afresh every batch. It
therefore knows the answer but is unsure of it - sampled at temperature 1 it is right about a third of the time -
which is where GRPO's verifiable reward has something to sharpen within minutes on 2 CPU ranks (docs/rl.md).
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "data" / "tiny_grpo"
CHARS = list("0123456789+-= ")
SPECIAL = ["<pad>", "</s>", "<unk>"]
RIGHT = 0.35     # share of right answers in the noisy training targets
STEPS, BATCH, SEED = 1500, 256, 0


def make_tokenizer(path: Path):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {token: i for i, token in enumerate(SPECIAL + CHARS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="</s>",
                                        unk_token="<unk>", clean_up_tokenization_spaces=False)
    tokenizer.save_pretrained(str(path))
    return tokenizer


def records() -> list[dict]:
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]


def noisy_answer(answer: int, rng: random.Random) -> int:
    if rng.random() < RIGHT:
        return answer
    return max(0, answer + rng.choice([-3, -2, -1, 1, 2, 3]))


def main() -> int:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(SEED)
    torch.set_num_threads(2)
    rng = random.Random(SEED)
    start = OUT / "start"
    start.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(start)
    rows = records()
    (OUT / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, use_cache=False)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    eos = tokenizer.eos_token_id
    for step in range(1, STEPS + 1):
        batch = [rows[rng.randrange(len(rows))] for _ in range(BATCH)]
        seqs, starts = [], []
        for r in batch:
            prompt = tokenizer(r["prompt"])["input_ids"]
            answer = tokenizer(str(noisy_answer(int(r["answer"]), rng)))["input_ids"] + [eos]
            seqs.append(prompt + answer)
            starts.append(len(prompt))
        width = max(len(s) for s in seqs)
        ids = torch.full((BATCH, width), tokenizer.pad_token_id)
        labels = torch.full((BATCH, width), -100)
        mask = torch.zeros((BATCH, width), dtype=torch.long)
        for i, (s, first) in enumerate(zip(seqs, starts)):
            ids[i, :len(s)] = torch.tensor(s)
            mask[i, :len(s)] = 1
            labels[i, first:len(s)] = torch.tensor(s[first:])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 250 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    model.save_pretrained(str(start), safe_serialization=True)
    print(f"wrote {start} ({sum(p.stat().st_size for p in start.iterdir()) / 1e3:.0f} kB) and {OUT / 'train.jsonl'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
