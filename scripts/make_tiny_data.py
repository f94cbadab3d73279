"""Generate the shipped tiny dataset and tokenizer under data/tiny/ (deterministic, byte-identical).

The text is synthetic but learnable: a few fact tables, arithmetic, counting and templated stories,
so a ~3M-parameter model's eval loss falls clearly within a couple of hundred steps on CPU.
Everything is drawn from one `random.Random(0)`; the tokenizer is a byte-level BPE trained on the
generated text and written as an HF tokenizer directory (tokenizer.json + tokenizer_config.json),
loadable with `transformers.AutoTokenizer.from_pretrained`.

    python scripts/make_tiny_data.py [--out data/tiny]
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

PRETRAIN_RECORDS = 4000
SFT_RECORDS = 2000
CHAT_RECORDS = 600
PREFERENCE_RECORDS = 800
VOCAB_SIZE = 1024
PAD, BOS, EOS = "<pad>", "<s>", "</s>"

# Rendered as "<s>user\n...</s>assistant\n...</s>". Roles end with "\n" so the first content token
# never merges with the role header, which keeps assistant-token masking exact.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ message['role'] }}\n{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}assistant\n{% endif %}"
)

CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Japan", "Tokyo"), ("China", "Beijing"), ("Egypt", "Cairo"), ("Kenya", "Nairobi"),
    ("Peru", "Lima"), ("Chile", "Santiago"), ("Canada", "Ottawa"), ("Mexico", "Mexico City"),
    ("Norway", "Oslo"), ("Sweden", "Stockholm"), ("Poland", "Warsaw"), ("Greece", "Athens"),
    ("Portugal", "Lisbon"), ("Ireland", "Dublin"), ("Austria", "Vienna"), ("Russia", "Moscow"),
    ("India", "New Delhi"), ("Thailand", "Bangkok"), ("Cuba", "Havana"), ("Turkey", "Ankara"),
]
ANIMALS = [
    ("cow", "moo"), ("dog", "woof"), ("cat", "meow"), ("duck", "quack"), ("sheep", "baa"),
    ("owl", "hoot"), ("pig", "oink"), ("horse", "neigh"), ("frog", "ribbit"), ("lion", "roar"),
]
COLORS = [
    ("sky", "blue"), ("grass", "green"), ("snow", "white"), ("sun", "yellow"), ("coal", "black"),
    ("blood", "red"), ("orange", "orange"), ("banana", "yellow"), ("leaf", "green"), ("sea", "blue"),
]
NAMES = ["Tom", "Mary", "Sam", "Anna", "Ben", "Lucy", "Max", "Emma", "Leo", "Mia", "Jack", "Zoe"]
FRUITS = {"apple": "apples", "pear": "pears", "plum": "plums", "peach": "peaches", "lemon": "lemons",
          "cherry": "cherries"}
PLACES = ["park", "market", "beach", "farm", "forest", "school", "river", "zoo"]


# --- one (question, answer, statement) triple per fact; statements feed pretrain, Q/A feed sft/chat ---

def capital_fact(rng: random.Random) -> tuple[str, str, str]:
    country, city = rng.choice(CAPITALS)
    return (f"What is the capital of {country}?", f"{city}.", f"The capital of {country} is {city}.")


def arithmetic_fact(rng: random.Random) -> tuple[str, str, str]:
    op = rng.choice(["plus", "minus", "times"])
    a, b = rng.randint(0, 12), rng.randint(0, 12)
    if op == "minus" and b > a:
        a, b = b, a
    result = {"plus": a + b, "minus": a - b, "times": a * b}[op]
    return (f"What is {a} {op} {b}?", f"{result}.", f"{a} {op} {b} is {result}.")


def counting_fact(rng: random.Random) -> tuple[str, str, str]:
    start = rng.randint(1, 20)
    end = start + rng.randint(3, 7)
    seq = ", ".join(str(n) for n in range(start, end + 1))
    return (f"Count from {start} to {end}.", f"{seq}.", f"Counting from {start} to {end}: {seq}.")


def animal_fact(rng: random.Random) -> tuple[str, str, str]:
    animal, sound = rng.choice(ANIMALS)
    return (f"What does the {animal} say?", f"The {animal} says {sound}.", f"The {animal} says {sound}.")


def color_fact(rng: random.Random) -> tuple[str, str, str]:
    thing, color = rng.choice(COLORS)
    return (f"What color is the {thing}?", f"The {thing} is {color}.", f"The {thing} is {color}.")


def count_noun(n: int, fruit: str) -> str:
    return f"{n} {fruit if n == 1 else FRUITS[fruit]}"


def fruit_story(rng: random.Random) -> tuple[str, str, str]:
    name, fruit = rng.choice(NAMES), rng.choice(sorted(FRUITS))
    had = rng.randint(2, 9)
    ate = rng.randint(1, had - 1)
    setup = f"{name} had {count_noun(had, fruit)} and ate {ate}."
    answer = f"{name} has {count_noun(had - ate, fruit)}."
    return (f"{setup} How many {FRUITS[fruit]} does {name} have now?", answer, f"{setup} Now {answer}")


def trip_story(rng: random.Random) -> tuple[str, str, str]:
    first, second = rng.sample(NAMES, 2)
    place = rng.choice(PLACES)
    animal, sound = rng.choice(ANIMALS)
    setup = f"{first} went to the {place} with {second}. They saw a {animal}."
    answer = f"The {animal} said {sound}."
    return (f"{setup} What did the {animal} say?", answer, f"{setup} {answer}")


FACTS = [capital_fact, arithmetic_fact, counting_fact, animal_fact, color_fact, fruit_story, trip_story]


def pretrain_record(rng: random.Random) -> dict:
    sentences = [rng.choice(FACTS)(rng)[2] for _ in range(rng.randint(3, 8))]
    return {"text": " ".join(sentences)}


def sft_record(rng: random.Random) -> dict:
    question, answer, _ = rng.choice(FACTS)(rng)
    # The prompt ends in "A:" and the response starts with a space, so prompt + response reads naturally.
    return {"prompt": f"Q: {question}\nA:", "response": f" {answer}"}


def chat_record(rng: random.Random) -> dict:
    messages = []
    if rng.random() < 0.5:
        messages.append({"role": "system", "content": "You are a helpful assistant."})
    for _ in range(rng.randint(1, 3)):
        question, answer, _ = rng.choice(FACTS)(rng)
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": answer})
    return {"messages": messages}


def write_jsonl(path: Path, records: list[dict]) -> None:
    lines = [json.dumps(r, ensure_ascii=False, sort_keys=True) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def train_tokenizer(texts: list[str]) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=[PAD, BOS, EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    # Llama convention: BOS is prepended when add_special_tokens=True; EOS is appended by the data pipeline.
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return tokenizer


def write_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> None:
    # Written by hand rather than with save_pretrained so the bytes do not depend on the transformers version.
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"), pretty=True)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "model_max_length": 4096, "padding_side": "right",
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")


def preference_record(rng: random.Random) -> dict:
    """A question with its answer (chosen) and the same answer with its words in reverse order (rejected): a rule a
    tiny model learns within a few dozen steps (well-formed answers are preferred), so a preference run's
    rewards/accuracy shows whether it learns at all. Drawn from their own random.Random, after the tokenizer's texts
    (which they leave as they were)."""
    while True:
        question, answer, _ = rng.choice(FACTS)(rng)
        words = answer.split()
        if len(set(words)) > 1:
            return {"prompt": f"Q: {question}\nA:", "chosen": f" {answer}", "rejected": " " + " ".join(words[::-1])}


def texts_for_tokenizer(pretrain: list[dict], sft: list[dict], chat: list[dict]) -> list[str]:
    texts = [r["text"] for r in pretrain]
    texts += [r["prompt"] + r["response"] for r in sft]
    texts += ["\n".join(f"{m['role']}\n{m['content']}" for m in r["messages"]) for r in chat]
    return texts


def generate(out_dir: Path) -> None:
    rng = random.Random(0)
    pretrain = [pretrain_record(rng) for _ in range(PRETRAIN_RECORDS)]
    sft = [sft_record(rng) for _ in range(SFT_RECORDS)]
    chat = [chat_record(rng) for _ in range(CHAT_RECORDS)]
    out_dir.mkdir(parents=True, exist_ok=True)
    write_jsonl(out_dir / "pretrain.jsonl", pretrain)
    write_jsonl(out_dir / "sft.jsonl", sft)
    write_jsonl(out_dir / "chat.jsonl", chat)
    write_tokenizer(train_tokenizer(texts_for_tokenizer(pretrain, sft, chat)), out_dir / "tokenizer")
    preference_rng = random.Random(1)
    write_jsonl(out_dir / "preference.jsonl", [preference_record(preference_rng) for _ in range(PREFERENCE_RECORDS)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "data" / "tiny"))
    generate(Path(parser.parse_args().out))


if __name__ == "__main__":
    main()
