"""What a serving stack reads from a run's exports (train.export_hf -> <run>/hf; a LoRA run's merged model ->
<run>/hf_merged): config.json and generation_config.json, read with plain transformers as a user or a vLLM-style
loader reads them. Training turns the KV cache off; the exports decode with it on, whatever training used.
The runs are conftest's engine_runs (2 CPU ranks; the LoRA base was saved with use_cache off)."""
from __future__ import annotations

import json

import pytest
import torch

EXPORTS = {"z2": ("export_z2", "hf"), "z3": ("export_z3", "hf"), "lora_merged": ("lora_z2", "hf_merged")}
PROMPTS = ["Once upon a time", "The little"]  # two lengths: the batch is left-padded with the pad token


def export_dir(engine_runs, name):
    run, sub = EXPORTS[name]
    return engine_runs[0][run] / sub


def kv_cache(output):
    """The cache generate() returned (`cache` in transformers 5, `past_key_values` before)."""
    return getattr(output, "cache", None) or getattr(output, "past_key_values", None)


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(EXPORTS))
def test_plain_transformers_decodes_the_export_with_its_kv_cache(engine_runs, name):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = export_dir(engine_runs, name)
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    assert model.config.use_cache is True and model.generation_config.use_cache is True
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        cached = model.generate(**batch, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
        uncached = model.generate(**batch, max_new_tokens=12, do_sample=False, return_dict_in_generate=True,
                                  use_cache=False)
    assert kv_cache(cached) is not None and kv_cache(uncached) is None  # the default decodes with the cache
    assert torch.equal(cached.sequences, uncached.sequences)


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(EXPORTS))
def test_the_exported_configs_hold_no_training_settings(engine_runs, name):
    """config.json has only keys of the architecture's own config; generation_config.json is a serving one: the
    cache on, not marked as derived from a (training) model config, the shipped tokenizer's special tokens."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    path = export_dir(engine_runs, name)
    config = json.loads((path / "config.json").read_text())
    own_keys = set(AutoConfig.for_model(config["model_type"]).to_dict())
    assert set(config) <= own_keys, set(config) - own_keys
    assert config["use_cache"] is True and AutoConfig.from_pretrained(str(path)).use_cache is True
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["use_cache"] is True and "_from_model_config" not in generation
    assert GenerationConfig.from_pretrained(str(path)).use_cache is True  # what a vLLM-style loader reads
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        assert generation[key] == config[key] == getattr(tokenizer, key), key


def test_training_goes_on_with_the_cache_off_after_an_export(tmp_path):
    """The export changes what is written, not the live model (training turns the cache off for a reason)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from conftest import TINY
    from distributed import REPO
    from trainer.model import hf_config
    from trainer.presets import load_preset
    from trainer.train.checkpoint import for_serving
    model = AutoModelForCausalLM.from_config(hf_config(load_preset("tiny_cpu", TINY).model, "sdpa"))
    model.config.use_cache = False
    tokenizer = AutoTokenizer.from_pretrained(str(REPO / "data" / "tiny" / "tokenizer"))
    with for_serving(model, tokenizer):
        model.save_pretrained(str(tmp_path))
    assert model.config.use_cache is False and model.generation_config.use_cache is False
    assert model.config.pad_token_id is None
    assert json.loads((tmp_path / "config.json").read_text())["use_cache"] is True
