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


def test_the_zero3_liger_loss_is_this_models_own_and_changes_nothing_else():
    """Under ZeRO-3 trainer.model.scope_liger_loss sets Liger's cross-entropy as one model's loss_function (never
    Liger's cross_entropy=True, which replaces torch.nn.functional.cross_entropy for the whole process). With torch's
    cross-entropy in the kernel's place (Liger's needs CUDA), that model's loss is transformers' own, through the
    function given, and another model and torch.nn.functional are untouched."""
    import torch.nn.functional as F

    from trainer.model import liger_loss_function
    calls = []

    def counted_cross_entropy(*args, **kwargs):
        calls.append(kwargs["reduction"])
        return F.cross_entropy(*args, **kwargs)

    torch.manual_seed(0)
    scoped, other = built("model.attn_implementation=sdpa"), built("model.attn_implementation=sdpa")
    other.load_state_dict(scoped.state_dict())
    functional_before = F.cross_entropy
    scoped.loss_function = liger_loss_function(counted_cross_entropy)
    ids = torch.randint(0, scoped.config.vocab_size, (2, 16))
    labels = ids.clone()
    labels[:, :5] = -100
    assert float(scoped(input_ids=ids, labels=labels).loss) == pytest.approx(
        float(other(input_ids=ids, labels=labels).loss), rel=1e-6)
    summed = scoped(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(22)).loss
    assert float(summed) == pytest.approx(float(other(input_ids=ids, labels=labels).loss), rel=1e-6)
    assert calls == ["mean", "sum"] and F.cross_entropy is functional_before
    other(input_ids=ids, labels=labels)
    assert len(calls) == 2  # the other model's loss never went through it
