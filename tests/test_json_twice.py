"""A key given twice in one JSON object, in anything a user writes (data records as JSON lines or a JSON document,
prompts files), is a named error at the file and line, never the last value kept in silence (issue 38: prompt
files kept the last of duplicate keys). One reader for all of them (trainer/files.py loads_unique); the objects,
the depth of the twin, the spacing around its colon and the escaping of its name are drawn."""
from __future__ import annotations

import json
import random
import string
from pathlib import Path

import pytest

from trainer.data.prompts import read_prompts
from trainer.data.records import DataError, load_records
from trainer.files import loads_unique

DRAWS = 150


def draw_key(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase + "é_") for _ in range(rng.randint(1, 6)))


def spelled(rng: random.Random, key: str) -> str:
    """The key as JSON text: plain, or with some characters as \\u escapes (the same key to a parser)."""
    return '"' + "".join(f"\\u{ord(c):04x}" if rng.random() < 0.3 else c for c in key) + '"'


def draw_value(rng: random.Random, depth: int, twin: list) -> str:
    """JSON text of a drawn value; `twin` holds one flag: put a key twice in some object of this value."""
    kind = rng.choice(["str", "num", "obj", "list"] if depth < 3 else ["str", "num"])
    if kind == "str":
        return json.dumps(rng.choice(["x", "a\":b", "{\"k\": 1}", "é"]))
    if kind == "num":
        return str(rng.randint(-9, 9))
    if kind == "list":
        return "[" + ", ".join(draw_value(rng, depth + 1, twin) for _ in range(rng.randint(0, 3))) + "]"
    return draw_object(rng, depth + 1, twin)


def draw_object(rng: random.Random, depth: int, twin: list) -> str:
    keys = list(dict.fromkeys(draw_key(rng) for _ in range(rng.randint(1, 4))))
    if twin[0] and (depth >= 2 or rng.random() < 0.5):
        keys.insert(rng.randint(0, len(keys)), rng.choice(keys))
        twin[0] = False
    colon = lambda: rng.choice([":", " :", ": ", "\t:\n"])  # noqa: E731
    return "{" + ", ".join(f"{spelled(rng, k)}{colon()}{draw_value(rng, depth, twin)}" for k in keys) + "}"


def drawn(rng: random.Random, twice: bool) -> tuple[str, bool]:
    twin = [twice]
    text = draw_object(rng, 0, twin)
    return text, twice and not twin[0]  # whether a twin was really put in


def test_a_key_twice_at_any_depth_however_written_is_refused_and_every_other_object_read_as_json_reads_it():
    rng = random.Random(38)
    seen = {True: 0, False: 0}
    for _ in range(DRAWS):
        text, has_twin = drawn(rng, rng.random() < 0.5)
        seen[has_twin] += 1
        if has_twin:
            with pytest.raises(ValueError, match="duplicate key .* in one object"):
                loads_unique(text)
        else:
            assert loads_unique(text) == json.loads(text)
    assert min(seen.values()) > 20, seen


@pytest.mark.parametrize("reader", ["prompts", "jsonl", "json"])
def test_every_reader_of_user_json_names_the_file_and_line_of_the_twin(reader, tmp_path):
    rng = random.Random(f"twice-{reader}")
    for case in range(8):
        lines = [{"prompt": f"p{i}", "text": f"t{i}"} for i in range(rng.randint(1, 6))]
        bad = rng.randrange(len(lines))
        texts = [json.dumps(line) for line in lines]
        field = rng.choice(["prompt", "text"])
        texts[bad] = texts[bad][:-1] + f', {spelled(rng, field)}{rng.choice([":", " : "])} "again"}}'
        path = tmp_path / f"case{case}.{'json' if reader == 'json' else 'jsonl'}"
        path.write_text("[" + ",\n".join(texts) + "]\n" if reader == "json" else "\n".join(texts) + "\n")
        with pytest.raises(DataError) as err:
            read_prompts(str(path)) if reader == "prompts" else load_records(str(path))
        message = str(err.value)
        assert f"duplicate key '{field}'" in message and str(path) in message, message
        if reader == "prompts":
            assert f"{path}:{bad + 1}:" in message, message
        elif reader == "jsonl":
            assert f"{path} line {bad + 1}:" in message, message


def test_prepare_data_refuses_a_twin_however_its_colon_is_spaced(tmp_path, capsys):
    """prepare-data's streaming reader (trainer/data/reading.py): it used to look for a twin only where `":` was
    written without a space, so {"text" : "a", "text" : "b"} was read as "b"."""
    from trainer.__main__ import main
    rng = random.Random(39)
    lines = [json.dumps({"text": f"record {i}"}) for i in range(rng.randint(2, 9))]
    bad = rng.randrange(len(lines))
    lines[bad] = '{"text" : "a", ' + spelled(rng, "text") + ' : "b"}'
    source, out = tmp_path / "records.jsonl", tmp_path / "out"
    source.write_text("\n".join(lines) + "\n")
    tokenizer = str(Path(__file__).resolve().parent.parent / "data" / "tiny" / "tokenizer")
    code = main(["prepare-data", "--task", "pretrain", "--tokenizer", tokenizer, "--source", str(source),
                 "--out", str(out), "--num-proc", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and f"{source} line {bad + 1}: duplicate key 'text'" in err, err
    assert not out.exists()
