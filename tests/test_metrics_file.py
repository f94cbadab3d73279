"""metrics.jsonl against hostile and huge files: one reader (trainer.metrics_file) for the resume's rewind and for
`report`. A torn or foreign line never stops a resume (it moves to metrics.rewound.jsonl with its bytes) and
never stops a report (it is skipped and named as file:line); report keeps a bounded number of points and marks
whatever the file's length, and draws exactly the history the documented forward rewind gives (checked against
an independent forward implementation on fuzzed files). The real 2-rank resume after a torn line is in
tests/test_experiments.py."""
from __future__ import annotations

import base64
import json
import math
import os
import random
from pathlib import Path

import pytest

import trainer.metrics_file as metrics_file
from distributed import run_cli
from trainer.errors import UserError
from trainer.metrics_file import MAX_LINE_BYTES, REWOUND_FILE, backward, forward
from trainer.pictures import png_bytes
from trainer.report.figure import report_figure
from trainer.report.points import MAX_BUCKETS, MAX_MARKS, Series
from trainer.report.runs import EVAL_PREFIX, SPIKES, TRAIN_KEYS, read_runs
from trainer.train.metrics import rewind_metrics

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def good(step: int, loss: float = 3.0) -> bytes:
    return json.dumps({"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 1.5, "tokens_per_s": 4000.0,
                       "step_time_s": 0.1, "peak_mem_gb": 0.6}).encode()


def resume(step: int) -> bytes:
    return json.dumps({"step": step, "event": "resume", "checkpoint": f"step_{step:08d}", "world_size": 2}).encode()


def run_with(root: Path, name: str, data: bytes) -> Path:
    run = root / name
    run.mkdir()
    (run / "metrics.jsonl").write_bytes(data)
    return run


def gids(figure, gid: str) -> list:
    """Every artist (line or band) drawn with this gid."""
    return [a for ax in figure.axes for a in [*ax.get_lines(), *ax.patches] if a.get_gid() == gid]


def drawn(figure, gid: str) -> tuple[list, list]:
    (line,) = [a for a in gids(figure, gid) if hasattr(a, "get_xdata")]
    return list(line.get_xdata()), list(line.get_ydata())


def same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(x == y or (math.isnan(x) and math.isnan(y)) for x, y in zip(a, b))


# --- the reader ------------------------------------------------------------------------------------

PIECES = [b'{"step": 1, "loss": 2}', b"", b" ", b"\xff\xfe", b'{"step": 3', '{"step": 2, "a": "é"}'.encode(),
          '{"step": 2, "a": "é"}'.encode()[:-3], b"[1]", b'{"step": 1, "step": 2}', b"\x00\x00", b"\r"]


@pytest.mark.slow
def test_backward_reads_the_lines_forward_reads_in_any_block_size(tmp_path, monkeypatch):
    """Report reads backward, the rewind forward: the same Lines (numbers, bytes, problems), whatever the block
    size and line limit, for files of torn, foreign, over-long and blank lines."""
    rng = random.Random(5)
    path = tmp_path / "metrics.jsonl"
    for _ in range(1500):
        monkeypatch.setattr(metrics_file, "BLOCK_BYTES", rng.choice([1, 2, 3, 7, 64]))
        monkeypatch.setattr(metrics_file, "MAX_LINE_BYTES", rng.choice([6, 12, 40, 1000]))
        monkeypatch.setattr(metrics_file, "KEPT_BYTES", rng.choice([2, 5]))
        parts = [rng.choice(PIECES + [b"x" * rng.randrange(60)]) for _ in range(rng.randrange(8))]
        path.write_bytes(b"\n".join(parts) + rng.choice([b"", b"\n", b"\n\n"]))
        lines = list(forward(path))
        assert list(backward(path))[::-1] == lines
        assert [line.number for line in lines] == [n + 1 for n, p in enumerate(path.read_bytes().split(b"\n"))
                                                   if p.strip() and n < len(parts)]


def test_a_line_longer_than_the_limit_is_named_and_never_held(tmp_path):
    """One line of 17 MB with no newline (a file that is a single torn line): each reader yields one Line that
    holds its first KEPT_BYTES and its size, named as too long."""
    path = tmp_path / "metrics.jsonl"
    size = MAX_LINE_BYTES + (1 << 20)
    with open(path, "wb") as out:
        out.write(b'{"step": 1, "loss": ')
        out.write(b"7" * (size - 20))
    for read in (forward, backward):
        (line,) = list(read(path))
        assert line.number == 1 and line.size == size and line.row is None
        assert len(line.raw) == metrics_file.KEPT_BYTES and line.raw.startswith(b'{"step": 1, "loss": 777')
        assert f"{size:,} bytes long, over the {MAX_LINE_BYTES:,}" in line.problem


# --- report: values and lines that are not what the trainer writes --------------------------------

HOSTILE_VALUES = [  # literal, what the report does with it: drawn, a gap (with a note), or the line named
    ("1e308", "gap"), ("-1e308", "gap"), ("1.7976931348623157e308", "gap"), ("1e400", "gap"), ("-1e400", "gap"),
    ("Infinity", "gap"), ("-Infinity", "gap"), ("NaN", "gap"), ("1e300", "drawn"), ("-1e300", "drawn"),
    ("5e-324", "drawn"), ("-5e-324", "drawn"), ("0", "drawn"), ("-0.0", "drawn"), (str(10 ** 30), "drawn"),
    (str(10 ** 400), "named"), ("9" * 5000, "named"), ('"7"', "named"), ("true", "named"), ("[1]", "named"),
    ('{"a": 1}', "named"), ("[" * 50 + "]" * 50, "named"),
]


@pytest.mark.slow
@pytest.mark.parametrize("literal, outcome", HOSTILE_VALUES, ids=[v[:24] for v, _ in HOSTILE_VALUES])
def test_each_hostile_value_is_drawn_a_gap_or_its_line_named(tmp_path, literal, outcome):
    keys = ("loss", "lr", "grad_norm", "tokens_per_s", "peak_mem_gb", "eval_loss")
    line = "{" + ", ".join(['"step": 2'] + [f'"{k}": {literal}' for k in keys]) + "}"
    run = run_with(tmp_path, "run", b"\n".join([good(1), line.encode(), good(3, 2.5)]) + b"\n")
    (metrics,) = read_runs([str(run)])
    figure = report_figure([metrics])
    assert png_bytes(figure).startswith(PNG_MAGIC)  # drawn to the end: the tick maths ran
    notes = "\n".join(metrics.notes())
    for key in ("loss", "lr"):
        steps, values = drawn(figure, f"run:{key}")
        if outcome == "named":
            assert steps == [1, 3], key
        else:
            assert steps == [1, 2, 3], key
            assert math.isnan(values[1]) == (outcome == "gap"), (key, values)
            if outcome == "drawn":
                assert values[1] == float(json.loads(literal)), key
    if outcome == "named":
        assert f"{run / 'metrics.jsonl'}:2: " in notes and "line skipped" in notes
        assert "must be a number" in notes or "too large" in notes or "not a metrics line" in notes
    else:
        assert ":2:" not in notes
    if outcome == "gap" and literal != "NaN" and not literal.endswith("Infinity") and "e400" not in literal:
        assert "not finite or beyond +-1e+300: drawn as gaps" in notes


EXTREMES = [("1e300", "-1e300"), ("5e-324", "1e300"), ("-5e-324", "1e-300"), ("1e299", "1e300"), ("0", "1e300"),
            ("1e300", "1e300")]


@pytest.mark.slow
def test_extreme_values_that_are_drawn_share_an_axis_without_overflow(tmp_path):
    """Pairs at the ends of what is drawn (+-1e300, the smallest subnormal) on linear and log axes, at steps 0
    and 2**53: every figure renders."""
    for i, (a, b) in enumerate(EXTREMES):
        lines = [f'{{"step": {step}, "loss": {v}, "lr": {v}, "grad_norm": {v}}}'.encode()
                 for step, v in ((0, a), (2 ** 53, b))]
        (metrics,) = read_runs([str(run_with(tmp_path, f"run{i}", b"\n".join(lines)))])
        figure = report_figure([metrics])
        assert png_bytes(figure).startswith(PNG_MAGIC)
        assert drawn(figure, f"run{i}:loss") == ([0, 2 ** 53], [float(a), float(b)])


FOREIGN_LINES = [  # a line that is no metrics line, and what its note says
    (b'{"step": 2, "loss": 2.', "not valid JSON"),
    (b"\xff\xfe\xfd", "not UTF-8 text (byte 0xff at column 1)"),
    ('{"step": 2, "note": "caf\u00e9"}'.encode()[:-3], "not UTF-8 text"),
    (b"[1, 2]", "a metrics line is a JSON object"),
    (b"null", "a metrics line is a JSON object"),
    (b'"text"', "a metrics line is a JSON object"),
    (b"NaN", "a metrics line is a JSON object"),
    (b'{"step": 2, "step": 3, "loss": 1}', "the key 'step' is given twice"),
    (b'{"step": 2, "loss": {"a": 1}}', "'loss' must be a number"),
    (b'{"step": 2, "loss": "low"}', "'loss' must be a number, got 'low'"),
    (b'{"step": 2, "lr": null, "loss": true}', "'loss' must be a number, got True"),
    (b'{"loss": 1}', "\"step\" must be a whole number"),
    (b'{"step": -1, "loss": 1}', "\"step\" must be a whole number"),
    (b'{"step": 2.5, "loss": 1}', "\"step\" must be a whole number"),
    (b'{"step": true, "loss": 1}', "\"step\" must be a whole number"),
    (f'{{"step": {2 ** 60}, "loss": 1}}'.encode(), "\"step\" must be a whole number from 0 to 2**53"),
    (b'{"step": 2, "event": "resume"}', "a resume event has \"checkpoint\""),
    (b"[" * 100_000, "nested too deeply"),
    (b'{"step": 2, "loss": ' + b"1" * 5000 + b"}", "not a metrics line"),
    (b"\x00\x00\x00\x00", "not valid JSON"),
    (b"\xef\xbb\xbf" + good(2), "not valid JSON"),  # a BOM inside the file
]


@pytest.mark.slow
def test_lines_that_are_no_metrics_lines_are_skipped_and_named_and_the_rest_is_drawn(tmp_path):
    data = [good(1)]
    for foreign, _ in FOREIGN_LINES:
        data += [foreign, good(len(data) + 2)]   # each foreign line between two good ones (step = line number)
    data.append('{"step": 99, "loss": 1, "x": "\u00e9'.encode()[:-1])  # a torn last line, half a character
    run = run_with(tmp_path, "run", b"\r\n".join(data[:3]) + b"\n" + b"\n".join(data[3:]))
    (metrics,) = read_runs([str(run)])
    file = run / "metrics.jsonl"
    notes = metrics.notes()
    expected = [(2 * i + 2, message) for i, (_, message) in enumerate(FOREIGN_LINES)][:20]
    for (number, message), note in zip(expected, notes):
        assert note.startswith(f"{file}:{number}: ") and message in note, (number, note)
    assert metrics.bad_lines == len(FOREIGN_LINES) + 1
    assert notes[20].startswith(f"{file}: 22 line(s) skipped in all (the first 20 are named above), the others "
                                f"are drawn; fix or delete them")  # the rest counted, not named one by one
    figure = report_figure([metrics])
    assert drawn(figure, "run:loss")[0] == [n for n in range(1, len(data)) if n % 2]  # every good line
    result = run_cli("report", str(run), "-o", str(tmp_path / "out.png"))
    assert result.returncode == 0 and "Traceback" not in result.stderr
    assert (tmp_path / "out.png").read_bytes().startswith(PNG_MAGIC)
    assert f"note: {file}:2: not valid JSON" in result.stderr


def test_a_torn_last_line_is_named_as_one(tmp_path):
    run = run_with(tmp_path, "run", good(1) + b"\n" + '{"step": 2, "x": "\u00e9'.encode()[:-1])
    (metrics,) = read_runs([str(run)])
    note, total = metrics.notes()
    assert total.startswith(f"{run / 'metrics.jsonl'}: 1 line(s) skipped in all, the others are drawn")
    assert note.startswith(f"{run / 'metrics.jsonl'}:2: not UTF-8 text (byte 0xc3 at column 19) (the last line "
                           f"has no newline: a write cut short")


# --- report: the history it draws is the documented forward rewind ---------------------------------


def reference_history(path: Path) -> dict:
    """What metrics.jsonl means, computed forward and in full (no streaming, no bounds), for comparison: a resume
    event drops every earlier point past its step; a line drops the earlier points of its own kind (a metric,
    loss spikes, skipped steps) at its step or past it; a non-finite loss is also a skipped step."""
    kinds: dict[str, list[tuple[int, float]]] = {}
    resumes, refused = [], 0

    def put(kind, step, value):
        kinds[kind] = [p for p in kinds.get(kind, []) if p[0] < step] + [(step, value)]

    def number(value):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError
        return float(value)

    for line in forward(path):
        if line.row is None:
            refused += 1
            continue
        row, step = line.row, line.row["step"]
        if row.get("event") == "resume":
            world = row.get("world_size")
            if isinstance(row.get("checkpoint"), str) and (world is None or type(world) is int):
                resumes.append(step)
                kinds = {k: [p for p in v if p[0] <= step] for k, v in kinds.items()}
            else:
                refused += 1
        elif row.get("skipped_step") is True:
            put("skipped", step, 0.0)
        elif SPIKES in row:
            try:
                put(SPIKES, step, number(row[SPIKES]))
            except (ValueError, OverflowError):
                refused += 1
        else:
            try:
                values = {k: number(v) for k, v in row.items() if v is not None and
                          (k in TRAIN_KEYS or k == EVAL_PREFIX or k.startswith(EVAL_PREFIX + "/"))}
            except (ValueError, OverflowError):
                refused += 1
                continue
            for key, value in values.items():
                put(key, step, value)
            if "loss" in values and not math.isfinite(values["loss"]):
                put("skipped", step, 0.0)
    return {"kinds": kinds, "resumes": resumes, "refused": refused}


def history_file(rng: random.Random) -> bytes:
    """A run's lines as a crash-looping run with evals, spikes and skipped steps writes them, some resumes
    without their event (older files), then mutated: bytes flipped, cut, torn or inserted."""
    lines, step = [], 0
    for _ in range(rng.randrange(20, 80)):
        roll = rng.random()
        if roll < 0.08 and step > 2:
            step = rng.randrange(0, step)
            if rng.random() < 0.7:
                lines.append(resume(step))
        elif roll < 0.12:
            lines.append(json.dumps({"step": step + 1, "skipped_step": True, "bad_steps_in_a_row": 1}).encode())
        elif roll < 0.16:
            lines.append(json.dumps({"step": step, SPIKES: rng.random() * 20, "data_position": {}}).encode())
        elif roll < 0.24:
            lines.append(json.dumps({"step": step, "eval_loss": rng.random(), "eval_ppl": 2.0,
                                     f"{EVAL_PREFIX}/{rng.choice('ab')}": rng.random()}).encode())
        else:
            step += 1
            lines.append(good(step, rng.choice([rng.random() * 5, math.nan]) if rng.random() < 0.1 else rng.random()))
    data = bytearray(b"\n".join(lines) + b"\n")
    for _ in range(rng.randrange(0, 4)):
        at = rng.randrange(len(data))
        cut = rng.choice(["flip", "delete", "insert", "truncate"])
        if cut == "flip":
            data[at] = rng.randrange(256)
        elif cut == "delete":
            del data[at:at + rng.randrange(1, 40)]
        elif cut == "insert":
            data[at:at] = rng.choice([b"\xff", b"\xe2\x82", b"\n", b"NaN", b"1e400", b"{", b"\x00", b'"', b"-"])
        else:
            del data[at:]
    return bytes(data)


@pytest.mark.slow
def test_fuzzed_files_draw_the_forward_history_or_say_why_not(tmp_path):
    """200 seeded crash-loop files, mutated: report never fails but with a named error (nothing to draw), and
    what it keeps (each series, skipped steps, spikes, resumes) is exactly the forward rewind of the lines it
    accepts; every line it does not accept is counted; a sample of the figures is rendered to PNG."""
    rng = random.Random(22)
    for case in range(200):
        run = run_with(tmp_path, f"run{case}", history_file(rng))
        file = run / "metrics.jsonl"
        expected = reference_history(file)
        try:
            (metrics,) = read_runs([str(run)])
        except UserError as err:
            assert "has no train or eval line yet" in str(err), err
            assert not any(points for kind, points in expected["kinds"].items()
                           if kind in TRAIN_KEYS or kind.startswith(EVAL_PREFIX))
            continue
        assert metrics.bad_lines == expected["refused"]
        for kind, points in expected["kinds"].items():
            kept = metrics.spikes if kind == SPIKES else metrics.get(kind)
            if kind == "skipped":
                assert metrics.skipped.steps() == [s for s, _ in points], case
                continue
            assert kept.steps == [s for s, _ in points], (case, kind)
            assert same(kept.values, [v for _, v in points]), (case, kind)
        assert metrics.resumes.count == len(expected["resumes"])
        assert metrics.resumes.steps() == sorted(set(expected["resumes"]))
        if case % 15 == 0:
            assert png_bytes(report_figure([metrics])).startswith(PNG_MAGIC)


# --- report: bounded whatever the file's length -----------------------------------------------------


def test_a_long_series_keeps_a_bounded_number_of_points_with_its_extremes():
    series = Series()
    for step in range(300_000, 0, -1):   # as report feeds it: last line first
        value = 1e6 if step == 123_457 else math.nan if step == 200_001 else 5.0 - step / 1e5
        series.add(step, value)
    assert len(series.steps) <= 5 * MAX_BUCKETS and series.steps == sorted(series.steps)
    assert 1e6 in series.values and any(math.isnan(v) for v in series.values)  # the spike and the gap survive
    assert series.steps[0] == 1 and series.steps[-1] == 300_000
    assert series.last == 5.0 - 3.0 and series.peak == 1e6 and series.count == 300_000
    exact = Series()
    for step in range(MAX_BUCKETS, 0, -1):
        exact.add(step, float(step))
    assert exact.steps == list(range(1, MAX_BUCKETS + 1)) and exact.values == [float(s) for s in exact.steps]


@pytest.mark.slow
def test_a_crash_loop_of_resumes_draws_a_bounded_number_of_marks(tmp_path):
    """1,000 steps then 30,000 resume events at random steps: at most MAX_MARKS marks per panel, merged ones as
    bands, the count in the table and the notes, and the loss drawn up to the lowest resume."""
    rng = random.Random(3)
    steps = [rng.randrange(100, 1000) for _ in range(30_000)]
    run = run_with(tmp_path, "loop", b"\n".join([good(s) for s in range(1, 1001)] + [resume(s) for s in steps]))
    (metrics,) = read_runs([str(run)])
    figure = report_figure([metrics])
    assert drawn(figure, "loop:loss")[0] == list(range(1, min(steps) + 1))
    marks = gids(figure, "loop:resume")
    assert 0 < len(marks) <= MAX_MARKS * 6   # six panels
    assert metrics.resumes.count == 30_000 and sum(n for _, _, n in metrics.resumes.ranges()) == 30_000
    assert any("30,000 resume(s) drawn as" in n for n in metrics.notes())
    from trainer.report.cli import final_values, report_html
    assert final_values(metrics)["resumes"].endswith("... (30,000 in all)")
    page = report_html([metrics], b"")
    assert "<h2>Notes</h2>" in page and "30,000 resume(s) drawn as" in page
    legend = [t.get_text() for t in figure.legends[0].get_texts()]
    assert any(t.startswith("loop: 30,000 resumes merged into") for t in legend)
    assert png_bytes(figure).startswith(PNG_MAGIC)


def test_many_eval_sources_are_capped_with_a_note(tmp_path):
    from trainer.report.runs import MAX_EVAL_SOURCES
    lines = [good(1)] + [json.dumps({"step": s, "eval_loss": 1.0, f"eval_loss/src{s}": 1.0}).encode()
                         for s in range(2, 40)]
    (metrics,) = read_runs([str(run_with(tmp_path, "run", b"\n".join(lines)))])
    assert len(metrics.eval_sources()) == MAX_EVAL_SOURCES and len(metrics.series) == MAX_EVAL_SOURCES + 6
    assert any("eval sources past the first" in n and f"{38 - MAX_EVAL_SOURCES:,} value(s)" in n
               for n in metrics.notes())


# --- report: files and paths -------------------------------------------------------------------------


def test_a_file_with_nothing_to_draw_is_a_named_error(tmp_path):
    for name, content in (("empty", b""), ("blank", b"\n\n  \n"), ("samples", b'{"step": 3, "samples": []}\n')):
        run = run_with(tmp_path, name, content)
        with pytest.raises(UserError, match=f"metrics file {run / 'metrics.jsonl'} has no train or eval line yet"):
            read_runs([str(run)])
    binary = run_with(tmp_path, "binary", b"\xff\xfe\x00\x01")
    result = run_cli("report", str(binary), "-o", str(tmp_path / "out.png"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"metrics file {binary / 'metrics.jsonl'} has no train or eval line yet" in result.stderr
    assert f"e.g. {binary / 'metrics.jsonl'}:1: not UTF-8 text (byte 0xff at column 1)" in result.stderr
    assert not (tmp_path / "out.png").exists()


def test_a_directory_where_the_metrics_file_goes_is_named(tmp_path):
    (tmp_path / "run" / "metrics.jsonl").mkdir(parents=True)
    (tmp_path / "loose.jsonl").mkdir()
    for given in (tmp_path / "run" / "metrics.jsonl", tmp_path / "loose.jsonl"):
        with pytest.raises(UserError, match=f"metrics file {given} is a directory: give a file"):
            read_runs([str(given)])
    result = run_cli("report", str(tmp_path / "run"), "-o", str(tmp_path / "out.png"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"metrics file {tmp_path / 'run' / 'metrics.jsonl'} is a directory: give a file" in result.stderr


def test_the_output_is_never_the_input(tmp_path):
    run = run_with(tmp_path, "run", good(1) + b"\n" + good(2) + b"\n")
    before = (run / "metrics.jsonl").read_bytes()
    os.link(run / "metrics.jsonl", run / "hard.png")
    os.symlink(run / "metrics.jsonl", run / "soft.html")
    for target in (run / "hard.png", run / "soft.html"):
        result = run_cli("report", str(run), "-o", str(target))
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert f"-o {target} is the metrics file of {run}: the report would replace the run's history" \
            in result.stderr
        assert (run / "metrics.jsonl").read_bytes() == before
    same_name = run_cli("report", str(run / "metrics.jsonl"), "-o", str(run / "metrics.jsonl"))
    assert same_name.returncode == 2 and "must end in .png or .html" in same_name.stderr
    assert (run / "metrics.jsonl").read_bytes() == before


def test_an_unreadable_resolved_config_costs_only_the_label(tmp_path):
    run = run_with(tmp_path, "run", good(1) + b"\n")
    (run / "config.resolved.yaml").write_bytes(b"name: [unclosed\n")
    (metrics,) = read_runs([str(run)])
    assert metrics.label == "run" and any("labelled without its preset" in n for n in metrics.notes())


# --- the rewind at a resume ------------------------------------------------------------------------

TORN = [  # bytes a killed or broken writer leaves, where they sit
    ("partial character at the end", b'{"step": 5, "loss": 2.0, "x": "\xe2\x82', "end"),
    ("partial object at the end", b'{"step": 5, "loss": 2.', "end"),
    ("bad bytes in the middle", b"\xff\xfe garbage \x80", "middle"),
    ("NUL bytes from a crashed filesystem", b"\x00" * 64, "middle"),
    ("a JSON value that is no object", b"[1, 2, 3]", "middle"),
    ("a key twice", b'{"step": 1, "step": 9}', "middle"),
    ("a line over the limit", b'{"step": 1, "x": "' + b"y" * (MAX_LINE_BYTES + 10), "end"),
]


@pytest.mark.parametrize("what, torn, where", TORN, ids=[t[0] for t in TORN])
def test_the_rewind_moves_a_torn_line_aside_with_its_bytes(tmp_path, what, torn, where):
    lines = [good(1), good(2), good(3), good(4)]
    data = b"\n".join(lines[:2] + [torn] + lines[2:]) + b"\n" if where == "middle" else \
        b"\n".join(lines) + b"\n" + torn
    (tmp_path / "metrics.jsonl").write_bytes(data)
    rewound = rewind_metrics(tmp_path, 2, "step_00000002", 2)
    assert (rewound.moved, rewound.not_metrics) == (3, 1)
    number = 3 if where == "middle" else 5
    assert rewound.named[0].startswith(f"line {number}: ")
    kept = (tmp_path / "metrics.jsonl").read_bytes()
    assert kept == good(1) + b"\n" + good(2) + b"\n" + resume(2) + b"\n"
    aside = [json.loads(line) for line in (tmp_path / REWOUND_FILE).read_text().splitlines()]
    (record,) = [r for r in aside if "unparsable" in r]
    assert record["line"] == number and record["rewound_by"]["checkpoint"] == "step_00000002"
    saved = base64.b64decode(record["unparsable_base64"]) if "unparsable_base64" in record else \
        record["unparsable"].encode()
    if len(torn) > MAX_LINE_BYTES:
        assert record["size"] == len(torn) and torn.startswith(saved) and len(saved) == metrics_file.KEPT_BYTES
    else:
        assert saved == torn   # the bytes, exactly
    # the run goes on: a second resume reads the rewritten file without a problem
    again = rewind_metrics(tmp_path, 1, "step_00000001", 2)
    assert (again.moved, again.not_metrics) == (2, 0)


def test_a_resume_after_a_torn_line_says_so(tmp_path, capsys):
    from trainer.presets import load_preset
    from trainer.train.metrics import MetricsLogger, Resumed
    (tmp_path / "metrics.jsonl").write_bytes(good(1) + b"\n" + good(2) + b"\n" + b'{"step": 3, "lo\xc3')
    cfg = load_preset("tiny_cpu", ["logging.progress_bar=false"])
    metrics = MetricsLogger(cfg, tmp_path, 0, 1000, 1, {}, Resumed(2, "step_00000002", None))
    metrics.log({"step": 3, "loss": 2.5, "lr": 1e-3})
    metrics.close()
    out = capsys.readouterr().out
    assert f"metrics: 1 line(s) of {tmp_path / 'metrics.jsonl'} were not metrics lines, moved to " \
           f"{tmp_path / REWOUND_FILE} with their bytes: line 3: not UTF-8 text" in out
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 2, 3] and rows[2]["event"] == "resume"


def test_a_metrics_path_that_is_a_directory_is_named_at_the_resume(tmp_path):
    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(UserError, match="metrics file .*metrics.jsonl is a directory"):
        rewind_metrics(tmp_path, 2, "step_00000002", 2)
