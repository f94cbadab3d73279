"""One estimate everywhere (issue 39): for every shipped preset, the memory its header expects, the numbers `show`
lists, the planner line `lint` prints and what `plan` says for the same model, hardware, task and micro-batch are
one number (within the rounding each prints); and `lint` warns about a shipped preset only where its header names
the warning as an accepted trade-off (`# Accepted warning [CHECK]: why`)."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest

from trainer.__main__ import main
from trainer.diagnose.lint import lint_preset, lint_resolved
from trainer.plan.decide import make_plan
from trainer.plan.estimate import MEMORY_HEADROOM, TIGHT, gb, inputs_for_resolved, plan_for_resolved
from trainer.presets import accepted_warnings, list_presets, load_preset, preset_path
from trainer.resolve import resolve

PRESETS = [name for name, _ in list_presets()]
GPU_PRESETS = [name for name in PRESETS if load_preset(name).hardware.gpu != "cpu"]
EXPECTED = re.compile(r"Expected memory per GPU: ~(\d+(?:\.\d+)?) GB of (\d+(?:\.\d+)?) usable")


def header(name: str) -> str:
    """The preset file's leading comment, its lines joined (a number may sit at a line's end)."""
    lines = []
    for line in preset_path(name).read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# "))
    return " ".join(lines)


def agrees(printed: str, value: float) -> bool:
    """`printed` (as a header, `show` or `lint` writes it) is `value` within the last digit it prints."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return abs(float(printed) - value) <= 0.5 * 10 ** -decimals + 1e-9


def test_every_gpu_preset_is_checked():
    assert len(GPU_PRESETS) >= 10 and "70b_32xa100" in GPU_PRESETS and "tiny_cpu" not in GPU_PRESETS


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_the_header_show_lint_and_plan_print_one_estimate(name, capsys):
    found = EXPECTED.search(header(name))
    assert found, f"{name}: the header has no 'Expected memory per GPU: ~X GB of Y usable' line"
    total, usable = found.groups()
    resolved = resolve(load_preset(name))
    estimate = plan_for_resolved(resolved)
    assert agrees(total, estimate.gpu_total / 1e9) and agrees(usable, estimate.gpu_budget / 1e9), \
        (name, total, usable, gb(estimate.gpu_total), gb(estimate.gpu_budget))

    assert main(["show", name, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)["estimate_gb"]
    assert (f"{shown['per_gpu']:.1f}", f"{shown['usable']:.1f}") == (gb(estimate.gpu_total), gb(estimate.gpu_budget))
    assert agrees(total, shown["per_gpu"]) and agrees(usable, shown["usable"])

    assert main(["lint", name]) == 0
    linted = re.search(r"planner: ([\d.]+) GB per GPU of ([\d.]+) usable", capsys.readouterr().out)
    assert linted and (linted.group(1), linted.group(2)) == (f"{shown['per_gpu']:.1f}", f"{shown['usable']:.1f}")

    # `plan` for the same model, GPUs, task, sequence and micro-batch: where its launch line is this preset as it
    # stands, it expects the header's number; else it launches the preset with --set items and prices that line
    inputs = dataclasses.replace(inputs_for_resolved(resolved), micro_batch=resolved.batch.micro_batch_size,
                                 global_batch=resolved.batch.global_batch_size)
    plan = make_plan(inputs)
    launched = resolve(load_preset(plan.preset, plan.preset_overrides))
    assert gb(plan.choice.gpu_total) == gb(plan_for_resolved(launched).gpu_total), plan.walk
    if plan.preset == name and not plan.preset_overrides:
        assert agrees(total, plan.choice.gpu_total / 1e9), (name, total, gb(plan.choice.gpu_total), plan.walk)


@pytest.mark.parametrize("name", PRESETS)
def test_lint_warns_about_a_shipped_preset_only_where_its_header_accepts_the_warning(name):
    resolved = resolve(load_preset(name))
    findings = lint_preset(name, resolved)
    unaccepted = [f"[{f.check}] {f.message}" for f in findings if f.severity in ("error", "warn") and not f.accepted]
    assert unaccepted == [], name
    stale = [f.message for f in findings if "no longer raises" in f.message]
    assert stale == [], name


def test_memory_past_95_percent_of_the_usable_budget_is_a_warning_a_header_can_accept():
    """70b_32xa100 keeps the seed's micro-batch 4 at 76.0 of 76.5 GB: lint warns and says the header accepts it;
    without the header's line the same config is an unaccepted warning, and at micro-batch 2 there is none."""
    resolved = resolve(load_preset("70b_32xa100"))
    assert plan_for_resolved(resolved).peak > TIGHT * plan_for_resolved(resolved).gpu_budget
    assert MEMORY_HEADROOM in accepted_warnings(preset_path("70b_32xa100"))
    bare = [f for f in lint_resolved(resolved) if f.check == MEMORY_HEADROOM]
    assert [(f.severity, f.accepted) for f in bare] == [("warn", "")]
    assert "99% of the 76.5 GB usable" in bare[0].message
    accepted = [f for f in lint_preset("70b_32xa100", resolved) if f.check == MEMORY_HEADROOM]
    assert accepted[0].severity == "warn" and "micro-batch 4" in accepted[0].accepted
    roomy = resolve(load_preset("70b_32xa100", ["train.micro_batch_size=2", "train.grad_accum=4"]))
    assert not [f for f in lint_resolved(roomy) if f.severity == "warn"]


def test_lint_prints_an_accepted_warning_as_accepted_and_a_stale_acceptance_as_a_note(tmp_path, capsys):
    text = preset_path("70b_32xa100").read_text()
    assert main(["lint", "70b_32xa100"]) == 0
    out = capsys.readouterr().out
    assert "1 warning(s) (1 accepted in the preset's header)" in out
    assert re.search(r"WARN  \[memory headroom\] .* -- accepted in the preset's header: the seed's", out)
    roomier = tmp_path / "roomier.yaml"  # the same header, a micro-batch that leaves room: the line is stale
    roomier.write_text(text.replace("micro_batch_size: 4", "micro_batch_size: 2").replace("grad_accum: 2",
                                                                                          "grad_accum: 4"))
    assert main(["lint", str(roomier)]) == 0
    out = capsys.readouterr().out
    assert "0 warning(s)" in out and "accepts a [memory headroom] warning that lint no longer raises" in out


# --- plan and lint read one table of rules, across a drawn grid ---------------------------------------------------
def drawn_grid(count: int, seed: int = 39) -> list[dict]:
    """`count` plans drawn (a fixed seed, so a failure reruns) from named models x GPUs x GPUs per node x tasks."""
    import random
    from trainer.hardware import GPUS
    from trainer.plan.inputs import TASKS
    from trainer.plan.models import NAMED_MODELS
    rng = random.Random(seed)
    gpus = sorted(g for g in GPUS if g != "cpu")
    return [{"model": rng.choice(sorted(NAMED_MODELS)), "gpu": rng.choice(gpus), "gpus_per_node": rng.choice((1, 2, 4, 8)),
             "task": rng.choice(TASKS), "seq_len": rng.choice((1024, 2048, 4096))} for _ in range(count)]


GRID = drawn_grid(24)


@pytest.mark.parametrize("values", GRID, ids=["-".join(str(v) for v in values.values()) for values in GRID])
def test_lint_does_not_warn_about_what_plan_recommends(values):
    """Whatever `plan` recommends, its launch line resolves to the batch of the plan's DeepSpeed config, `lint` prints
    the plan's number for it, and `lint` has no error and no warning, but the memory-headroom one a plan names as its
    trade-off when nothing roomier fits."""
    from trainer.errors import ConfigError
    from trainer.plan.inputs import build_inputs
    try:
        inputs = build_inputs(values)
    except ConfigError as refused:  # e.g. a sequence past the model's positions: named before any planning
        assert "--seq-len" in str(refused), refused
        return
    plan = make_plan(inputs)
    if plan.choice is None:
        assert plan.suggestions, values  # fits nowhere: it says what would
        return
    resolved = resolve(load_preset(plan.preset, plan.preset_overrides))
    launched = inputs_for_resolved(resolved)
    if (launched.grpo, launched.preference) != (inputs.grpo, inputs.preference):
        # no shipped preset of this task for this model: the line trains another task, whose estimate (no rollout, no
        # reference) is not the plan's; the plan keeps its own numbers and says so (not yet a line of this task)
        assert any(f"trains data.task={resolved.config.data.task}, not this plan's" in line for line in plan.walk)
        return
    assert gb(plan_for_resolved(resolved).gpu_total) == gb(plan.choice.gpu_total), plan.walk
    # the DeepSpeed config the plan prints (and -o writes) trains the launch line's batch
    ds = plan.deepspeed
    assert (ds["train_batch_size"], ds["gradient_accumulation_steps"], ds["train_micro_batch_size_per_gpu"]) == (
        resolved.batch.global_batch_size, resolved.batch.grad_accum, resolved.batch.micro_batch_size), plan.launch
    complaints = [(f.check, f.message) for f in lint_resolved(resolved) if f.severity in ("error", "warn")]
    if plan.choice.tight:
        assert any("past 95%" in line for line in plan.walk), plan.walk
        complaints = [(check, message) for check, message in complaints if check != MEMORY_HEADROOM]
    assert complaints == [], (values, plan.launch)


@pytest.mark.parametrize("values", GRID[:12], ids=["-".join(str(v) for v in values.values()) for values in GRID[:12]])
def test_the_walk_says_why_the_choice_beats_the_next_candidate_that_fits(values):
    """Above the choice the walk says why each candidate was passed over (skipped, does not fit, tight); below it,
    the next candidate that fits and what it costs more (estimate.COSTS, the table lint's notes read)."""
    from trainer.errors import ConfigError
    from trainer.plan.decide import best_shot
    from trainer.plan.estimate import WALK, slower_because
    from trainer.plan.inputs import build_inputs
    try:
        inputs = build_inputs(values)
    except ConfigError:
        return
    plan = make_plan(inputs)
    if plan.choice is None or plan.inputs.sp > 1:
        return
    name = plan.choice.candidate.name
    chosen_line = next(i for i, line in enumerate(plan.walk) if line.startswith(f"{name}: fits") or
                       line.startswith(f"{name}: nothing roomier"))
    for candidate in WALK[:WALK.index(plan.choice.candidate)]:
        assert any(line.startswith(f"{candidate.name}: ") for line in plan.walk[:chosen_line]), (candidate, plan.walk)
    below = [line for line in plan.walk if " (below) fits too " in line]
    walked = best_shot(plan.inputs, plan.choice.candidate, 1)  # the walk compares at micro-batch 1
    slower = [shot for shot in (best_shot(plan.inputs, c, 1) for c in WALK[WALK.index(plan.choice.candidate) + 1:])
              if shot.fits and slower_because(walked, shot)]
    if slower and not walked.tight:
        assert below and below[0].startswith(f"{slower[0].candidate.name} (below) fits too"), plan.walk
        assert all(cost in below[0] for cost in slower_because(walked, slower[0])), below
