"""The start-up log says which kernels the model really runs, so a fallback is never silent. Fast: CPU only,
the tiny preset's model built without ranks."""
from __future__ import annotations

import logging

import pytest
import torch

from conftest import TINY
from distributed import last_wins
from trainer.model import build_model, kernels_in_use
from trainer.presets import load_preset
from trainer.resolve import resolve


def built(*overrides: str):
    cfg = resolve(load_preset("tiny_cpu", last_wins(TINY + list(overrides))), 1).config
    model, _ = build_model(cfg, 0)
    return model


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallbacks")
@pytest.mark.parametrize("asked,warning", [
    ("model.attn_implementation=flash_attention_2", "flash_attention_2 needs CUDA and the flash-attn package"),
    ("model.liger=true", "Liger needs CUDA and the liger-kernel package"),
])
def test_a_kernel_that_cannot_run_here_is_reported_as_not_running(asked, warning, caplog):
    with caplog.at_level(logging.WARNING):
        model = built(asked)
    assert kernels_in_use(model) == "attention sdpa, liger off"
    assert warning in caplog.text


def test_the_default_attention_is_what_the_log_names():
    model = built("model.attn_implementation=eager")
    assert kernels_in_use(model) == "attention eager, liger off"
