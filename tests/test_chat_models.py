"""Chat models that stop, and warmup and grad norm as users read them (issue 37, items 2, 5 and 9), trained for real
in one 2-rank launch: a tiny model learns four answers with the ChatML, Zephyr and Llama-2 templates (ChatML's
markers added to the tiny tokenizer as special tokens), and `generate --chat --greedy` on each export ends each
answer where the turn ends; a 3-step ZeRO-0 pretraining with train.warmup_steps=0 trains from step 1 and logs the lr
it applied and a grad norm."""
from __future__ import annotations

import json

import pytest

from conftest import TINY
from distributed import read_metrics, run_cli, run_many

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

ANSWERS = {"What color is the sky?": "The sky is blue.", "What does the cow say?": "The cow says moo.",
           "What is 3 plus 4?": "7.", "Where do fish live?": "Fish live in water."}
TEMPLATES = ("chatml", "zephyr", "llama-2")
CHAT_STEPS = 60
MAX_NEW = 24


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_models")
    chats = root / "chats.jsonl"
    records = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
               for q, a in ANSWERS.items()] * 16
    chats.write_text("".join(json.dumps(r) + "\n" for r in records))
    chat = TINY + ["data.task=sft", f"data.source={chats}", f"train.max_steps={CHAT_STEPS}", "train.lr=3e-3",
                   "train.warmup_steps=0", "train.eval_every=0", "train.save_every=0", "logging.log_every=10",
                   "train.export_hf=true", f"data.cache_dir={root / 'cache'}"]
    specs = [{"name": name, "preset": "tiny_cpu",
              "overrides": chat + [f"data.chat_template={name}", f"train.output_dir={root / name}"]}
             for name in TEMPLATES]
    specs.append({"name": "no_warmup", "preset": "tiny_cpu", "overrides": TINY + [
        "deepspeed.zero_optimization.stage=0", "train.warmup_steps=0", "train.max_steps=3", "train.eval_every=0",
        "train.save_every=0", f"train.output_dir={root / 'no_warmup'}", f"data.cache_dir={root / 'cache'}"]})
    output, _ = run_many(specs, root)
    return root, output


@pytest.mark.parametrize("template", TEMPLATES)
def test_each_chat_sft_ends_its_answer_where_the_turn_ends(runs, template, tmp_path):
    root, _ = runs
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": q}) + "\n" for q in ANSWERS))
    proc = run_cli("generate", "--model", str(root / template), "--prompts", str(prompts), "--chat", "--greedy",
                   "--max-new-tokens", str(MAX_NEW), "--format", "jsonl")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert {r["prompt"]: r["completion"].strip() for r in rows} == ANSWERS
    assert all(r["tokens"] < MAX_NEW for r in rows)  # it stopped, not the token limit


def test_the_chatml_export_has_im_end_as_one_special_token_and_in_eos_token_id(runs):
    from transformers import AutoTokenizer
    root, _ = runs
    tokenizer = AutoTokenizer.from_pretrained(str(root / "chatml" / "hf"))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer("<|im_end|>", add_special_tokens=False)["input_ids"] == [im_end]
    generation = json.loads((root / "chatml" / "hf" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tokenizer.eos_token_id, im_end]


def test_no_warmup_trains_from_step_one_and_logs_the_lr_it_applied_and_the_zero0_grad_norm(runs):
    root, _ = runs
    rows = read_metrics(root / "no_warmup")[0]
    assert [r["step"] for r in rows] == [1, 2, 3]
    # the HF linear decay with no warmup: step k applies lr * (3 - (k - 1)) / 3
    assert [r["lr"] for r in rows] == pytest.approx([1e-3, 2e-3 / 3, 1e-3 / 3])
    assert all(r["grad_norm"] is not None and r["grad_norm"] > 0 for r in rows)
    assert rows[2]["loss"] < rows[0]["loss"]
