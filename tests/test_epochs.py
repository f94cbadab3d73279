"""Issue 37 item 6: train.epochs. One of epochs and max_steps says how long a run trains; epochs is resolved to
max_steps from the prepared data (one epoch = one pass over the train stream the loader reads) and the global batch,
so it is the same at every world size with the same global batch (what an elastic resume keeps)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from trainer.errors import ConfigError
from trainer.options import resolve_run
from trainer.presets import load_preset

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> list[str]:
    """120 records of the shipped corpus, prepared into a cache of the test's own."""
    root = tmp_path_factory.mktemp("epochs")
    lines = (REPO / "data" / "tiny" / "pretrain.jsonl").read_text().splitlines()[:120]
    (root / "small.jsonl").write_text("\n".join(lines) + "\n")
    return [f"data.source={root / 'small.jsonl'}", f"data.cache_dir={root / 'cache'}", "data.seq_len=64"]


def train_sequences(overrides: list[str]) -> int:
    """The train stream's length as the run's loader sees it, built the run's way."""
    from trainer.data import apply_chat_template, build_datasets, load_tokenizer
    cfg = load_preset("tiny_cpu", overrides)
    return len(build_datasets(cfg.data, apply_chat_template(load_tokenizer(cfg.model), cfg.data), cfg.train.seed).train)


@pytest.mark.slow  # prepares data (tokenizer, datasets)
def test_epochs_resolve_to_steps_from_the_prepared_data(small_data):
    sequences = train_sequences(small_data)
    resolved = resolve_run(load_preset("tiny_cpu", small_data + ["train.epochs=2", "train.warmup_steps=1"]))
    global_batch = resolved.batch.global_batch_size
    assert resolved.config.train.max_steps == math.ceil(2 * sequences / global_batch)  # the preset's 200 gave way
    assert resolved.notices[0] == (f"train.epochs=2: {sequences:,} training sequences of 64 tokens per epoch / "
                                   f"global batch {global_batch} -> train.max_steps={resolved.config.train.max_steps}")
    assert resolved.summary()["total_tokens"] == resolved.config.train.max_steps * global_batch * 64
    half = resolve_run(load_preset("tiny_cpu", small_data + ["train.epochs=0.5", "train.warmup_steps=1"]))
    assert half.config.train.max_steps == math.ceil(0.5 * sequences / global_batch)


@pytest.mark.slow  # prepares data (tokenizer, datasets)
def test_the_same_global_batch_gives_the_same_steps_at_every_world_size(small_data):
    """What an elastic resume relies on: it keeps the checkpoint's global batch on the new topology."""
    items = small_data + ["train.epochs=3", "train.warmup_steps=1", "train.global_batch_size=16",
                          "train.micro_batch_size=auto", "train.grad_accum=auto"]
    steps = {world: resolve_run(load_preset("tiny_cpu", items), world).config.train.max_steps for world in (1, 2, 4)}
    assert len(set(steps.values())) == 1, steps
    assert steps[1] == math.ceil(3 * train_sequences(small_data) / 16)


def test_epochs_and_max_steps_are_one_or_the_other(tmp_path):
    with pytest.raises(ConfigError, match="--set train.max_steps and --set train.epochs both say how long"):
        load_preset("tiny_cpu", ["train.epochs=1", "train.max_steps=5"])
    preset = tmp_path / "mine.yaml"
    preset.write_text((REPO / "presets" / "tiny_cpu.yaml").read_text().replace("  max_steps: 200",
                                                                                "  max_steps: 200\n  epochs: 2"))
    with pytest.raises(ConfigError, match="train.max_steps and train.epochs both say how long") as err:
        load_preset(str(preset))
    assert str(preset) in str(err.value)
    assert load_preset(str(preset), ["train.max_steps=7"]).train.epochs is None  # a --set replaces the file's other
    assert load_preset("tiny_cpu").train.epochs is None and load_preset("tiny_cpu").train.max_steps == 200
    assert load_preset("tiny_cpu", ["train.epochs=null"]).train.max_steps == 200  # unset: the preset's length stays


@pytest.mark.slow  # prepares data (tokenizer, datasets)
def test_show_prints_the_resolved_steps_and_where_it_prepared_the_data(small_data, tmp_path):
    """Also item 9: a raw source prepared on first use says where the prepared data went."""
    from distributed import run_cli
    items = [small_data[0], small_data[2], f"data.cache_dir={tmp_path / 'fresh'}", "train.epochs=2",
             "train.warmup_steps=1"]
    proc = run_cli("show", "tiny_cpu", *[w for item in items for w in ("--set", item)], "--json")
    assert proc.returncode == 0, proc.stderr
    shown = json.loads(proc.stdout)  # stdout stays the document alone
    assert shown["train"]["epochs"] == 2
    assert shown["train"]["max_steps"] == resolve_run(load_preset("tiny_cpu", items)).config.train.max_steps
    [entry] = [p for p in (tmp_path / "fresh").iterdir() if not p.name.startswith(".")]
    assert f"data: prepared {small_data[0].split('=', 1)[1]} into {entry} (data.cache_dir;" in proc.stderr
