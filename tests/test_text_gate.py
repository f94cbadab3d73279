"""One text gate (trainer/text.py) for every string on its way to a tokenizer, by drawn cases: text drawn from the
whole of Unicode passes and the tokenizer takes it; a lone surrogate drawn into any field, at any depth of a chat
message and any position, is refused naming the file, line, field, place and character, by `prepare-data` for every
record format (leaving nothing in --out), by a prompts file and by `--prompt` (where a byte that is not UTF-8
arrives as one), each as `error: ...` with no traceback."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from trainer import text
from trainer.__main__ import main
from trainer.data.prompts import read_prompts
from trainer.data.records import DataError

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "data" / "tiny" / "tokenizer"
DRAWS = 200
PLANES = [(0x20, 0x7E), (0xA0, 0x2FF), (0x300, 0x36F), (0x4E00, 0x9FFF), (0xE000, 0xF8FF), (0xFB00, 0xFFFD),
          (0x1F300, 0x1FAFF), (0x20000, 0x2A6DF), (0x10000, 0x10FFFF)]  # combining marks, private use, astral


def scalar(draw: random.Random) -> str:
    low, high = draw.choice(PLANES)
    code = draw.randint(low, high)
    return chr(code) if not 0xD800 <= code <= 0xDFFF else "x"


def draw_text(draw: random.Random, length: int = 12) -> str:
    return "".join(scalar(draw) for _ in range(draw.randint(0, length)))


def surrogate(draw: random.Random) -> str:
    return chr(draw.choice([draw.randint(0xD800, 0xDBFF), draw.randint(0xDC00, 0xDFFF), draw.randint(0xDC80, 0xDCFF)]))


def draw_messages(draw: random.Random) -> list[dict]:
    return [{"role": role, "content": draw_text(draw)} for role in ("user", "assistant") * draw.randint(1, 2)]


def test_text_drawn_from_all_of_unicode_passes_and_the_tokenizer_takes_it():
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    draw = random.Random(380)
    for _ in range(DRAWS):
        value = draw.choice([draw_text(draw, 40), draw_messages(draw)])
        assert text.refusal(value, "file line 1", "f") is None
        for piece in (value if isinstance(value, list) else [{"content": value}]):
            tokenizer(piece["content"])  # would raise on anything the gate let through wrongly


def test_a_lone_surrogate_anywhere_is_named_by_field_place_and_character():
    draw = random.Random(381)
    for _ in range(DRAWS):
        bad = surrogate(draw)
        if draw.random() < 0.5:
            clean = draw_text(draw)
            at = draw.randint(0, len(clean))
            value, place = clean[:at] + bad + clean[at:], ""
        else:
            value = draw_messages(draw)
            turn = draw.randrange(len(value))
            clean = value[turn]["content"]
            at = draw.randint(0, len(clean))
            value[turn]["content"] = clean[:at] + bad + clean[at:]
            place = f"[{turn}].content"
        message = text.refusal(value, "data.jsonl line 7", "messages")
        assert message.startswith(f"data.jsonl line 7: field 'messages'{place}, character {at}: U+{ord(bad):04X}")


def write_records(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))  # json escapes a lone surrogate as \udXXX


def record_of(kind: str, draw: random.Random) -> dict:
    return {"pretrain": lambda: {"text": draw_text(draw) + " words"},
            "pair": lambda: {"prompt": draw_text(draw) + "Q", "response": draw_text(draw) + " A"},
            "chat": lambda: {"messages": draw_messages(draw)},
            "preference": lambda: {"prompt": draw_text(draw) + "Q", "chosen": " yes" + draw_text(draw),
                                   "rejected": " no" + draw_text(draw)},
            "preference_chat": lambda: {"messages": draw_messages(draw)[:1], "chosen": " yes" + draw_text(draw),
                                        "rejected": " no" + draw_text(draw)}}[kind]()


TASK = {"pretrain": "pretrain", "pair": "sft", "chat": "sft", "preference": "preference",
        "preference_chat": "preference"}


@pytest.mark.parametrize("kind", sorted(TASK))
def test_prepare_data_names_the_file_line_and_field_and_leaves_nothing_in_out(tmp_path, kind, capsys):
    draw = random.Random(f"{kind}-382")
    records = [record_of(kind, draw) for _ in range(40)]
    line = draw.randrange(len(records))
    field = draw.choice(sorted(k for k, v in records[line].items()))
    value = records[line][field]
    if isinstance(value, list):
        turn = draw.randrange(len(value))
        value[turn]["content"] += surrogate(draw)
        place = f"'{field}'[{turn}].content"
    else:
        records[line][field] = value + surrogate(draw)
        place = f"'{field}',"
    source, out = tmp_path / "records.jsonl", tmp_path / "out"
    write_records(source, records)
    code = main(["prepare-data", "--task", TASK[kind], "--tokenizer", str(TOKENIZER), "--source", str(source),
                 "--out", str(out), "--num-proc", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert f"error: {source} line {line + 1}: field {place}" in err, err
    assert not out.exists(), sorted(out.rglob("*"))


def test_a_prompts_file_and_the_prompt_flag_pass_the_gate(tmp_path, capsys):
    draw = random.Random(383)
    for case in range(20):
        lines = [{"prompt": draw_text(draw)} if draw.random() < 0.5 else {"messages": draw_messages(draw)}
                 for _ in range(draw.randint(1, 6))]
        assert len(read_prompts(write_prompts(tmp_path / f"ok{case}.jsonl", lines))) == len(lines)
        bad = draw.randrange(len(lines))
        if "prompt" in lines[bad]:
            lines[bad]["prompt"] += surrogate(draw)
        else:
            lines[bad]["messages"][0]["content"] += surrogate(draw)
        path = write_prompts(tmp_path / f"bad{case}.jsonl", lines)
        with pytest.raises(DataError, match=f"^{path}:{bad + 1}: field '(prompt|messages)"):
            read_prompts(path)
    model = tmp_path / "model"  # refused before a model is read
    model.mkdir()
    for byte in draw.sample(range(0x80, 0x100), 5):  # what Python makes of a command-line byte that is not UTF-8
        code = main(["generate", "--model", str(model), "--prompt", "ok", "--prompt", f"a{chr(0xDC00 + byte)}"])
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err
        assert f"error: --prompt: field 'prompt', character 1: U+{0xDC00 + byte:04X}, a lone surrogate: the byte " \
               f"{byte:#04x} of text that is not UTF-8" in err, err


def write_prompts(path: Path, lines: list[dict]) -> str:
    write_records(path, lines)
    return str(path)


CONFIG_STRINGS = {"train.sample_prompts": "[{}]", "data.chat_template": "{}", "train.output_dir": "{}",
                  "logging.wandb_project": "{}"}


def test_a_config_string_with_a_lone_surrogate_is_refused_at_resolve(capsys):
    """Sample prompts reach the tokenizer mid-training, a chat template every chat sample: every string of the
    config passes the gate when it is resolved, before any work."""
    draw = random.Random(384)
    for key in sorted(CONFIG_STRINGS):
        clean = "".join(draw.choice("abcdefgh") for _ in range(draw.randint(0, 8)))
        at = draw.randint(0, len(clean))
        escape = f"\\u{ord(surrogate(draw)):04x}"  # as a user writes it in YAML
        value = CONFIG_STRINGS[key].format(f'"{clean[:at]}{escape}{clean[at:]}"')
        code = main(["show", "tiny_cpu", "--set", f"{key}={value}"])
        err = capsys.readouterr().err
        place = f"'{key}[0]'" if key == "train.sample_prompts" else f"'{key}'"
        assert code == 2 and "Traceback" not in err and f"field {place}, character {at}: U+" in err, err
