"""DeepSpeed's values typed as DeepSpeed reads them (issue 38, item 2).

DeepSpeed reads many keys with `dict.get(key, default)` and never checks the value: `cpu_checkpointing: maybe` or
`'false'` is simply true to it, `steps_per_print: ten` fails at the first step. The type each such key takes is
learned from DeepSpeed itself (the default its parser passes, trainer/ds/learned.py), so these tests draw keys from
what was learned (a key DeepSpeed adds tomorrow is drawn too) and values of every other kind, with a fixed seed.
"""
from __future__ import annotations

import random
import subprocess
import sys

import pytest

from distributed import REPO
from trainer.ds import check, learned

SEED = 38
DRAWS = 40

RIGHT = {  # values of each kind DeepSpeed reads as intended
    "bool": lambda r: r.choice([True, False]),
    "int": lambda r: r.randint(-10**9, 10**9),
    "number": lambda r: r.choice([r.uniform(-1e6, 1e6), r.randint(-1000, 1000)]),
    "str": lambda r: "".join(r.choice("abcXYZ_/.") for _ in range(r.randint(1, 12))),
    "mapping": lambda r: {},
    "list": lambda r: [],
}
WRONG = {  # values of each kind DeepSpeed would misread
    "bool": lambda r: r.choice(["false", "no", "maybe", "0", "off", "True", r.randint(0, 2), 0.0, [], {}]),
    "int": lambda r: r.choice([str(r.randint(0, 99)), "ten", r.uniform(0.01, 0.99) + r.randint(0, 9), True, [1]]),
    "number": lambda r: r.choice(["1e-3", "fast", False, [1.0], {"a": 1}]),
    "str": lambda r: r.choice([r.randint(0, 9), 1.5, True, ["x"], {"x": 1}]),
    "mapping": lambda r: r.choice(["{}", 1, True, ["a"]]),
    "list": lambda r: r.choice(["[]", 1, {"a": 1}]),
}
FIX = {"bool": "must be true or false", "int": "must be a whole number", "number": "must be a number",
       "str": "must be a string", "mapping": "must be a mapping", "list": "must be a list"}


def nested(path: str, value) -> dict:
    """{"a": {"b": value}} for "a.b"."""
    out = value
    for key in reversed(path.split(".")):
        out = {key: out}
    return out


def problems_for(path: str, value) -> list[str]:
    return [p for p in check.check_keys(nested(path, value), live=False) if p.startswith(f"deepspeed.{path}:")]


def drawn(rng: random.Random, population: list, count: int) -> list:
    return rng.sample(population, min(count, len(population)))


def test_learned_kinds_cover_the_reported_keys():
    """What the hostile sweep found read by truth or as a count is typed, by DeepSpeed's own defaults."""
    kinds = learned.facts()["value_kinds"]
    for path, kind in {"activation_checkpointing.cpu_checkpointing": "bool", "wall_clock_breakdown": "bool",
                       "flops_profiler.enabled": "bool", "aio.single_submit": "bool", "aio.block_size": "int",
                       "checkpoint.load_universal": "bool", "steps_per_print": "int",
                       "expert_parallel.use_grouped_mm": "bool"}.items():
        assert kinds.get(path) == kind, path
    assert "zero_optimization" not in kinds and "bf16" not in kinds  # typed by DeepSpeed's pydantic models


def test_a_value_of_another_kind_is_refused_naming_the_key():
    rng = random.Random(SEED)
    kinds = learned.facts()["value_kinds"]
    leaves = sorted(p for p, k in kinds.items() if k != "mapping")  # a block not a mapping is said otherwise
    for path in drawn(rng, leaves, DRAWS):
        kind = kinds[path]
        value = WRONG[kind](rng)
        found = problems_for(path, value)
        assert len(found) == 1 and FIX[kind] in found[0], (path, value, found)


def test_a_value_of_the_right_kind_passes_its_type_check():
    rng = random.Random(SEED + 1)
    kinds = learned.facts()["value_kinds"]
    for path in drawn(rng, sorted(kinds), DRAWS):
        value = RIGHT[kinds[path]](rng)
        assert not [p for p in problems_for(path, value) if "must be" in p], (path, value)


def test_null_and_auto_before_filling_are_left_to_deepspeed_and_the_filler():
    kinds = learned.facts()["value_kinds"]
    path = next(p for p, k in sorted(kinds.items()) if k == "bool" and "." in p)
    assert not problems_for(path, None)
    assert not [p for p in check.check_keys(nested(path, "auto"), typed=False, live=False)
                if p.startswith(f"deepspeed.{path}:")]


def test_scheduler_parameters_are_typed_by_deepspeeds_signatures():
    rng = random.Random(SEED + 2)
    schedulers = learned.facts()["schedulers"]
    typed = sorted((name, key, kind) for name, params in schedulers.items() for key, kind in params.items() if kind)
    assert ("WarmupLR", "warmup_num_steps", "int") in typed
    for name, key, kind in drawn(rng, typed, DRAWS):
        value = WRONG[kind](rng)
        if kind == "number" and isinstance(value, list) and all(isinstance(v, float) for v in value):
            continue  # a bound per parameter group: DeepSpeed takes it
        ds = {"scheduler": {"type": name, "params": {key: value}}}
        found = [p for p in check.check_keys(ds, live=False) if p.startswith(f"deepspeed.scheduler.params.{key}:")]
        assert len(found) == 1 and FIX[kind] in found[0] and name in found[0], (name, key, value, found)
        right = {"scheduler": {"type": name, "params": {key: RIGHT[kind](rng)}}}
        assert not [p for p in check.check_keys(right, live=False) if "must be" in p], (name, key)


@pytest.mark.parametrize("item", ["deepspeed.activation_checkpointing.cpu_checkpointing=maybe",
                                  "deepspeed.activation_checkpointing.cpu_checkpointing='false'",
                                  "deepspeed.wall_clock_breakdown=sometimes"])
def test_show_names_the_misread_value(item, capsys):
    """The issue's "done when": each a named error from `show`, no traceback."""
    from trainer.__main__ import main
    assert main(["show", "tiny_cpu", "--set", "model.gradient_checkpointing=true", "--set", item]) == 2
    err = capsys.readouterr().err
    key = item.split("=")[0]
    assert f"{key}: " in err and "must be true or false" in err and "Traceback" not in err, err


@pytest.mark.slow
def test_scheduler_arguments_deepspeed_refuses_at_construction_are_refused_at_resolve():
    """Where DeepSpeed is imported (train, preflight), its scheduler is built at resolve over a one-parameter
    optimizer: what its constructor refuses (after the model and data, in the engine) is named before."""
    code = f"""
import random, deepspeed
from trainer.ds import check
rng = random.Random({SEED + 3})
for _ in range(6):
    steps = rng.randint(-5, 0)
    found = check.check_keys({{"scheduler": {{"type": "WarmupLR", "params": {{"warmup_num_steps": steps}}}}}})
    assert found and "warmup_num_steps must be a positive integer" in found[0], found
    size = rng.choice([0, -1, -1000])
    found = check.check_keys({{"scheduler": {{"type": "OneCycle", "params": {{"cycle_min_lr": 0.1, "cycle_max_lr": 1.0,
                                                                            "cycle_first_step_size": size}}}}}})
    assert found and "cycle_first_step_size must be positive" in found[0], found
    good = rng.randint(1, 10**6)
    assert not check.check_keys({{"scheduler": {{"type": "WarmupLR", "params": {{"warmup_num_steps": good}}}}}})
print("OK")
"""
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr[-2000:]


def test_values_deepspeed_refuses_when_the_engine_is_built_are_refused_at_resolve():
    """Drawn allgather bucket sizes at drawn stages and drawn steps_per_print: refused at resolve exactly where the
    installed DeepSpeed would fail after the model and data are built (its stage 1/2 optimizer asserts the bucket is
    a multiple of 2; the engine takes every step modulo steps_per_print); the message names the key."""
    import inspect
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    from trainer.errors import ConfigError
    from trainer.presets import load_preset
    from trainer.resolve import resolve
    assert "allgather_bucket_size % self.nccl_start_alignment_factor == 0" in inspect.getsource(DeepSpeedZeroOptimizer)
    assert "% self.steps_per_print() == 0" in inspect.getsource(DeepSpeedEngine)
    rng = random.Random(SEED + 4)
    zero = "deepspeed.zero_optimization"
    for _ in range(DRAWS):
        stage = rng.choice([1, 2, 3])
        bucket = rng.choice([0, rng.randint(1, 10**9), 2 * rng.randint(1, 10**8), 5e8, 1.5e3 + 1])  # < 0: pydantic's
        steps = rng.choice([0, rng.randint(1, 1000), None])
        items = [f"{zero}.stage={stage}", f"{zero}.allgather_bucket_size={bucket!r}",
                 f"deepspeed.steps_per_print={'null' if steps is None else steps}"]
        if stage == 3:
            items.append(f"{zero}.round_robin_gradients=false")
        bad_bucket = stage in (1, 2) and (bucket == 0 or int(bucket) % 2)
        try:
            resolve(load_preset("tiny_cpu", items))
            problems = []
        except ConfigError as err:
            problems = err.problems
        assert any("allgather_bucket_size" in p for p in problems) == bool(bad_bucket), (items, problems)
        assert any("steps_per_print=0" in p for p in problems) == (steps == 0), (items, problems)
