"""Pictures: `python -m trainer report` on real runs (conftest's engine_runs: ZeRO-2 straight and stopped-then-
resumed, ZeRO-3 with sample generations) draws exactly the values of each run's metrics.jsonl, marks resumes and
skipped steps, writes a self-contained HTML page, and refuses bad input naming the file and line; `plan --chart`
draws the planner's own per-candidate numbers against the GPU budget with the choice outlined. The figures are
read back from matplotlib (line data, bar heights), not compared as images."""
from __future__ import annotations

import base64
import json
import math
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

from distributed import REPO, run_cli
from trainer.errors import UserError
from trainer.plan.chart import PARTS, bars, plan_figure
from trainer.plan.decide import make_plan
from trainer.plan.estimate import budgets
from trainer.plan.inputs import build_inputs, read_scenario
from trainer.plan.report import plan_to_json
from trainer.report.cli import final_values
from trainer.report.figure import PANELS, report_figure
from trainer.report.runs import read_runs

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REAL_RUNS = ("straight_z2", "halves_z2", "samples_z3")
METRICS = [metric for metric, _, _ in PANELS]


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    """What the file says for `key`: (steps, values) of the lines that carry it."""
    picked = [r for r in rows if r.get(key) is not None]
    return [r["step"] for r in picked], [r[key] for r in picked]


def lines(figure, gid: str) -> list:
    return [line for ax in figure.axes for line in ax.get_lines() if line.get_gid() == gid]


def drawn(figure, gid: str) -> tuple[list, list]:
    """The x and y data of the one line with this gid."""
    found = lines(figure, gid)
    assert len(found) == 1, f"{gid}: {len(found)} lines"
    return list(found[0].get_xdata()), list(found[0].get_ydata())


def is_png(path: Path) -> bool:
    from matplotlib.image import imread
    if path.read_bytes()[:8] != PNG_MAGIC:
        return False
    height, width = imread(str(path)).shape[:2]  # decodes the whole image
    return height > 300 and width > 300


@pytest.fixture(scope="module")
def real(engine_runs) -> dict[str, Path]:
    return {name: engine_runs[0][name] for name in REAL_RUNS}


# --- report on real runs ---------------------------------------------------------------------------


@pytest.mark.multirank
def test_report_png_draws_each_runs_metrics_jsonl(real, tmp_path):
    out = tmp_path / "report.png"
    result = run_cli("report", *(str(real[n]) for n in REAL_RUNS), "-o", str(out))
    assert result.returncode == 0, result.stderr
    assert is_png(out)
    runs = read_runs([str(real[n]) for n in REAL_RUNS])
    assert [r.label for r in runs] == [f"{n} (tiny_cpu)" for n in REAL_RUNS]  # dir name + the preset's
    figure = report_figure(runs)
    for run, name in zip(runs, REAL_RUNS):
        rows = jsonl(real[name] / "metrics.jsonl")
        assert any("samples" in r for r in rows) == (name == "samples_z3")  # generations: not drawn, no error
        for metric in METRICS:
            steps, values = series(rows, metric)
            assert steps, f"{name} logged no {metric}"
            assert drawn(figure, f"{run.label}:{metric}") == (steps, values), (name, metric)
        assert not lines(figure, f"{run.label}:skipped")
        # the trainer's own resume event: halves_z2 stopped after a checkpoint and resumed from it
        resumed_at = {r["step"] for r in rows if r.get("event") == "resume"}
        assert bool(resumed_at) == (name == "halves_z2"), (name, resumed_at)
        assert {line.get_xdata()[0] for line in lines(figure, f"{run.label}:resume")} == resumed_at
    # the stopped-and-resumed run drew its 8 steps once, equal to the straight run's losses
    assert drawn(figure, "halves_z2 (tiny_cpu):loss")[0] == list(range(1, 9))
    assert drawn(figure, "halves_z2 (tiny_cpu):loss")[1] == pytest.approx(
        drawn(figure, "straight_z2 (tiny_cpu):loss")[1], rel=1e-6)
    # panels share the step axis
    assert len({ax.get_xlim() for ax in figure.axes}) == 1


def crashed_and_resumed(real: dict[str, Path], root: Path, event: bool = True) -> tuple[Path, list[dict]]:
    """halves_z2's real lines rearranged into the file a preempted run leaves: steps 1-4 (checkpoint at 4), then
    steps 5-6 that were logged but lost with the crash (another real run's lines, so they differ, and a skipped
    step), then the resume event the trainer writes (unless event=False: a file from before the event), then the re-trained steps 5-8, with step 6 skipped for a non-finite loss (as the loop
    writes it: a skipped_step line, and no train line for a step whose loss was not averaged). Returns the run
    directory and the lines that should be drawn."""
    halves = [r for r in jsonl(real["halves_z2"] / "metrics.jsonl") if "event" not in r]  # its own resume: ours below
    lost = [r for r in jsonl(real["samples_z3"] / "metrics.jsonl") if r["step"] in (5, 6) and "samples" not in r]
    lost.insert(1, {"step": 5, "skipped_step": True, "bad_steps_in_a_row": 1})
    first, second = [r for r in halves if r["step"] <= 4], [r for r in halves if r["step"] > 4]
    second = [r for r in second if not (r["step"] == 6 and "loss" in r)]
    at6 = next(i for i, r in enumerate(second) if r["step"] == 6)
    second.insert(at6, {"step": 6, "skipped_step": True, "bad_steps_in_a_row": 1})
    resume = {"step": 4, "event": "resume", "checkpoint": "step_00000004", "world_size": 2}
    run = root / "preempted"
    run.mkdir()
    shutil.copy(real["halves_z2"] / "config.resolved.yaml", run)
    history = first + lost + ([resume] if event else []) + second
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    return run, first + second


@pytest.mark.multirank
def test_a_resume_replaces_the_lost_steps_and_resumes_and_skips_are_marked(real, tmp_path):
    run_dir, expected = crashed_and_resumed(real, tmp_path)
    (run,) = read_runs([str(run_dir)])
    figure = report_figure([run])
    for metric in METRICS:
        assert drawn(figure, f"{run.label}:{metric}") == series(expected, metric), metric
    assert 6 not in drawn(figure, f"{run.label}:loss")[0]
    lost_tokens = [r["tokens_per_s"] for r in jsonl(real["samples_z3"] / "metrics.jsonl") if r["step"] in (5, 6)
                   and "tokens_per_s" in r]
    assert not set(lost_tokens) & set(drawn(figure, f"{run.label}:tokens_per_s")[1])
    resumes, skips = lines(figure, f"{run.label}:resume"), lines(figure, f"{run.label}:skipped")
    assert len(resumes) == len(skips) == len(PANELS)  # one vertical line per panel
    assert {tuple(line.get_xdata()) for line in resumes} == {(4, 4)}
    assert {tuple(line.get_xdata()) for line in skips} == {(6, 6)}
    legend = [text.get_text() for text in figure.legends[0].get_texts()]
    assert "resume (run's colour)" in legend and "skipped / non-finite step" in legend
    assert final_values(run)["resumes"] == "step 4" and final_values(run)["skipped steps"] == 1
    out = tmp_path / "preempted.png"
    assert run_cli("report", str(run_dir), "-o", str(out)).returncode == 0 and is_png(out)


@pytest.mark.multirank
def test_a_file_without_the_resume_event_still_draws_each_step_once(real, tmp_path):
    """Files written before the trainer logged resumes: where a series' step goes back, the later lines win."""
    run_dir, expected = crashed_and_resumed(real, tmp_path, event=False)
    (run,) = read_runs([str(run_dir)])
    figure = report_figure([run])
    for metric in METRICS:
        assert drawn(figure, f"{run.label}:{metric}") == series(expected, metric), metric
    assert not lines(figure, f"{run.label}:resume")  # where it resumed is not known


class Cells(HTMLParser):
    def __init__(self):
        super().__init__()
        self.rows, self.images, self.external = [], [], []
        self._cell = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = ""
        elif tag == "img":
            self.images.append(attrs["src"])
        for key in ("src", "href"):
            if key in attrs and not attrs[key].startswith("data:"):
                self.external.append(attrs[key])

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.rows[-1].append(self._cell)
            self._cell = None


@pytest.mark.multirank
def test_report_html_is_one_file_with_the_figure_and_final_values(real, tmp_path):
    out = tmp_path / "report.html"
    result = run_cli("report", str(real["straight_z2"]), str(real["samples_z3"]), "-o", str(out))
    assert result.returncode == 0, result.stderr
    page = Cells()
    page.feed(out.read_text())
    assert page.external == [] and len(page.images) == 1  # self-contained: nothing to fetch
    png = base64.b64decode(page.images[0].split(",", 1)[1])
    (tmp_path / "embedded.png").write_bytes(png)
    assert is_png(tmp_path / "embedded.png")
    header, *rows = page.rows
    assert [row[0] for row in rows] == ["straight_z2 (tiny_cpu)", "samples_z3 (tiny_cpu)"]
    for row, name in zip(rows, ("straight_z2", "samples_z3")):
        cell = dict(zip(header, row))
        file = jsonl(real[name] / "metrics.jsonl")
        assert cell["last step"] == str(file[-1]["step"] if "samples" not in file[-1] else file[-2]["step"])
        for column, key in (("loss", "loss"), ("eval loss", "eval_loss"), ("tokens/s", "tokens_per_s"),
                            ("lr", "lr"), ("grad norm", "grad_norm")):
            assert cell[column] == f"{series(file, key)[1][-1]:.4g}", (name, column)
        assert cell["eval ppl"] == f"{series(file, 'eval_ppl')[1][-1]:.4g}"  # the trainer's own perplexity
        assert cell["peak mem GB"] == f"{max(series(file, 'peak_mem_gb')[1]):.4g}"


@pytest.mark.multirank
def test_runs_with_the_same_directory_name_get_their_parents_name(real, tmp_path):
    for parent in ("a", "b"):
        (tmp_path / parent).mkdir()
        shutil.copytree(real["straight_z2"], tmp_path / parent / "tiny_cpu",
                        ignore=shutil.ignore_patterns("checkpoints", "wandb", "hf"))
    runs = read_runs([str(tmp_path / "a" / "tiny_cpu"), str(tmp_path / "b" / "tiny_cpu")])
    assert [r.label for r in runs] == ["a/tiny_cpu", "b/tiny_cpu"]  # the preset is in the name already
    figure = report_figure(runs)
    assert drawn(figure, "a/tiny_cpu:loss") == drawn(figure, "b/tiny_cpu:loss")


def test_matplotlib_is_imported_by_the_drawing_commands_only():
    code = ("import sys; from trainer.__main__ import main; "
            "main(['presets']); main(['plan', 'scenarios/seed1_7b_8xa100.yaml', '--json']); "
            "print('MATPLOTLIB', 'matplotlib' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "MATPLOTLIB False" in result.stdout


# --- report: bad input -----------------------------------------------------------------------------

GOOD = ('{"step": 1, "loss": 6.9, "lr": 0.0, "grad_norm": 1.4, "tokens_per_s": 3900.0, "step_time_s": 0.13, '
        '"tflops_per_gpu": 0.003, "peak_mem_gb": 0.6}')


def run_dir(root: Path, name: str, *lines: str) -> Path:
    path = root / name
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    return path


def refused(*runs) -> str:
    with pytest.raises(UserError) as err:
        read_runs([str(r) for r in runs])
    return str(err.value)


def test_a_missing_run_or_metrics_file_is_named_with_a_fix(tmp_path):
    (tmp_path / "empty").mkdir()
    message = refused(tmp_path / "nope", tmp_path / "empty")
    assert f"run directory '{tmp_path / 'nope'}' does not exist: give a run's train.output_dir" in message
    assert f"run directory {tmp_path / 'empty'} has no metrics.jsonl: is it a run's train.output_dir?" in message


@pytest.mark.slow
def test_every_bad_line_is_named_as_file_and_line_and_the_others_draw(tmp_path):
    run = run_dir(tmp_path, "run", GOOD, '{"step": 2, "loss": 6.8', "[1, 2]", '{"loss": 6.7}',
                  '{"step": 5, "loss": "low"}', '{"step": 6, "event": "resume"}', GOOD.replace('"step": 1', '"step": 7'),
                  '{"step": 8, "grad_norm": 1%s}' % ("0" * 400))
    (metrics,) = read_runs([str(run)])
    message = "\n".join(metrics.notes())
    file = run / "metrics.jsonl"
    assert f"{file}:2: not valid JSON" in message
    assert f"{file}:3: a metrics line is a JSON object" in message
    assert f"{file}:4: \"step\" must be a whole number from 0 to 2**53, got None" in message
    assert f"{file}:5: 'loss' must be a number, got 'low'" in message
    assert f"{file}:6: a resume event has \"checkpoint\"" in message
    assert f"{file}:8: 'grad_norm' is too large to be a metric" in message
    assert ":1:" not in message and ":7:" not in message
    assert message.count("; line skipped") == 6
    assert drawn(report_figure([metrics]), "run:loss")[0] == [1, 7]
    out = tmp_path / "report.png"
    result = run_cli("report", str(run), "-o", str(out))
    assert result.returncode == 0 and is_png(out) and f"note: {file}:5: 'loss' must be a number" in result.stderr


def test_a_file_with_nothing_to_draw_and_several_bad_runs_at_once(tmp_path):
    nothing = run_dir(tmp_path, "nothing", '{"step": 3, "samples": []}')
    bad = run_dir(tmp_path, "bad", "{oops")
    message = refused(nothing, bad, tmp_path / "gone")
    assert f"metrics file {nothing / 'metrics.jsonl'} has no train or eval line yet" in message
    assert f"metrics file {bad / 'metrics.jsonl'} has no train or eval line yet: nothing to draw (the run logs " \
           f"every logging.log_every steps); its 1 non-blank line(s) are not metrics lines, e.g. " \
           f"{bad / 'metrics.jsonl'}:1: not valid JSON" in message
    assert "gone' does not exist" in message


def test_a_non_finite_loss_is_drawn_as_a_gap_and_marked(tmp_path):
    run = run_dir(tmp_path, "run", GOOD, GOOD.replace('"step": 1', '"step": 2').replace("6.9", "NaN"))
    (metrics,) = read_runs([str(run)])
    assert metrics.skipped.steps() == [2] and metrics.skipped.count == 1
    x, y = drawn(report_figure([metrics]), "run:loss")
    assert x == [1, 2] and y[0] == 6.9 and math.isnan(y[1])


def test_each_eval_source_gets_its_own_dashed_line(tmp_path):
    evals = [{"step": s, "eval_loss": 7.0 - s, "eval_ppl": 1.0, "eval_tokens": 10, "eval_loss/web": 7.5 - s,
              "eval_loss/code": 6.5 - s} for s in (2, 4)]
    run = run_dir(tmp_path, "mix", GOOD, *(json.dumps(e) for e in evals))
    figure = report_figure(read_runs([str(run)]))
    for key in ("eval_loss", "eval_loss/web", "eval_loss/code"):
        assert drawn(figure, f"mix:{key}") == series(evals, key)
    (eval_ax,) = [ax for ax in figure.axes if ax.get_title() == "eval loss"]
    assert [t.get_text() for t in eval_ax.get_legend().get_texts()] == ["all sources", "code", "web"]


@pytest.mark.parametrize("target, message", [
    ("report.pdf", "argument -o/--output: report '{}': the name must end in .png or .html"),
    ("report", "argument -o/--output: report '{}': the name must end in .png or .html"),
    ("missing/report.png", "argument -o/--output: report '{}': directory {} does not exist"),
])
def test_a_bad_output_is_refused_before_anything_is_read(tmp_path, target, message):
    path = tmp_path / target
    result = run_cli("report", str(tmp_path / "no-such-run"), "-o", str(path))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert message.format(path, path.parent) in result.stderr
    assert "no-such-run" not in result.stderr  # the output was checked first


def test_a_bad_run_writes_nothing(tmp_path):
    good = run_dir(tmp_path, "good", GOOD)
    out = tmp_path / "report.html"
    result = run_cli("report", str(good), str(tmp_path / "gone"), "-o", str(out))
    assert result.returncode == 2 and "Traceback" not in result.stderr and "gone' does not exist" in result.stderr
    assert not out.exists() and list(tmp_path.glob(".report.html.*")) == []


# --- plan --chart ----------------------------------------------------------------------------------


def planned(scenario: str):
    path = REPO / "scenarios" / f"{scenario}.yaml"
    return make_plan(build_inputs(read_scenario(str(path)), str(path)))


def patches(figure, gid: str) -> list:
    return [p for ax in figure.axes for p in ax.patches if p.get_gid() == gid]


def hline(figure, gid: str) -> float:
    (line,) = lines(figure, gid)
    return line.get_ydata()[0]


@pytest.mark.parametrize("scenario", ["13b_8xa100", "seed2_70b_8xa100", "seed3_70b_32xa100"])
def test_chart_bars_are_the_plans_numbers_and_the_choice_is_outlined(scenario):
    plan = planned(scenario)
    figure = plan_figure(plan)
    report = plan_to_json(plan)
    drawn_bars = bars(plan)
    assert [e for _, e, _ in drawn_bars][:len(plan.rows)] == plan.rows  # one bar per candidate priced
    for (name, estimate, _), row in zip(drawn_bars, report["candidates"]):
        assert name.startswith(row["name"])
        bottom = 0.0
        for key, _, _ in PARTS:
            (patch,) = patches(figure, f"{name}:{key}")
            assert patch.get_height() == pytest.approx(row["gpu_bytes"][key] / 1e9, rel=1e-12, abs=1e-12)
            assert patch.get_y() == pytest.approx(bottom, abs=1e-9)
            bottom += patch.get_height()
        assert bottom == pytest.approx(row["gpu_bytes"]["total"] / 1e9)
        (host,) = patches(figure, f"{name}:host")
        assert host.get_height() == pytest.approx(row["cpu_bytes_per_node"] / 1e9)
    assert hline(figure, "budget") == pytest.approx(report["gpu_budget_bytes"] / 1e9)
    assert hline(figure, "gpu_memory") == pytest.approx(report["hardware"]["gpu_memory_bytes"] / 1e9)
    assert hline(figure, "host_budget") == pytest.approx(budgets(plan.inputs)[1] / 1e9)
    outlined = {p.get_gid().rsplit(":", 1)[0] for ax in figure.axes for p in ax.patches if p.get_linewidth() > 2}
    (chosen_name,) = [name for name, _, chosen in drawn_bars if chosen]
    assert outlined == {chosen_name}
    chosen_total = sum(patches(figure, f"{chosen_name}:{key}")[0].get_height() for key, _, _ in PARTS)
    assert chosen_total == pytest.approx(report["choice"]["gpu_bytes"]["total"] / 1e9)
    assert chosen_total <= hline(figure, "budget")
    bold = [t.get_text() for t in figure.axes[1].get_xticklabels() if t.get_fontweight() == "bold"]
    assert bold == [chosen_name]


@pytest.mark.slow
def test_plan_chart_from_the_cli_and_a_plan_that_fits_nowhere(tmp_path):
    out = tmp_path / "plan.png"
    result = run_cli("plan", "scenarios/seed2_70b_8xa100.yaml", "--json", "--chart", str(out))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["choice"]["name"] == "zero3_cpu_optimizer"  # stdout stays pure JSON
    assert is_png(out) and f"wrote {out}" in result.stderr
    nowhere = run_cli("plan", "scenarios/fits_nowhere_70b_1x4090.yaml", "--chart", str(tmp_path / "no.png"))
    assert nowhere.returncode == 1 and is_png(tmp_path / "no.png")
    figure = plan_figure(planned("fits_nowhere_70b_1x4090"))
    assert not [p for ax in figure.axes for p in ax.patches if p.get_linewidth() > 2]
    assert figure.get_suptitle().endswith("fits nowhere")


@pytest.mark.parametrize("args, message", [
    (["--chart", "{}/plan.svg"], "argument --chart: chart '{}/plan.svg': the name must end in .png"),
    (["--chart", "{}/missing/plan.png"], "argument --chart: chart '{}/missing/plan.png': directory {}/missing does "
                                         "not exist"),
    (["--chart", "{}/plan.png", "--inference"], "--chart does nothing without a training plan"),
])
def test_a_bad_chart_target_is_refused(tmp_path, args, message):
    result = run_cli("plan", "--model", "7b", "--gpu", "a100-80g", *(a.format(tmp_path) for a in args))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert message.format(tmp_path, tmp_path) in result.stderr
    assert not list(tmp_path.rglob("*.png"))


# a tiny_cpu preference run's metrics.jsonl as the trainer wrote it (6 DPO steps on 2 ranks, evals at 3 and 6)
PREFERENCE_METRICS = REPO / "tests" / "logs" / "preference_run_metrics.jsonl"


def test_a_preference_run_gets_the_rewards_panels_and_a_plain_run_does_not(tmp_path):
    rows = jsonl(PREFERENCE_METRICS)
    dpo = run_dir(tmp_path, "dpo", *PREFERENCE_METRICS.read_text().splitlines())
    plain = run_dir(tmp_path, "plain", GOOD)
    figure = report_figure(read_runs([str(dpo), str(plain)]))
    titles = [ax.get_title() for ax in figure.axes]
    assert len(titles) == 8 and titles[6].startswith("preference accuracy") and titles[7].startswith("reward margin")
    for key in ("rewards/accuracy", "rewards/margin", "eval_rewards/accuracy", "eval_rewards/margin"):
        assert drawn(figure, f"dpo:{key}") == series(rows, key)
        assert not lines(figure, f"plain:{key}")
    assert drawn(figure, "dpo:loss") == series(rows, "loss")
    alone = report_figure(read_runs([str(plain)]))
    assert [ax.get_title() for ax in alone.axes] == [title for _, title, _ in PANELS]
