"""Packed sequences keep their documents apart (data.cross_document_attention=false; the default for packed SFT).

The loss of a packed micro-batch must be the token-weighted mean of its documents' own losses, each document run
alone: real prepared data (data/tiny), a real transformers Llama, sdpa and eager attention, and the one-row layout
the loss gives flash-attn (checked with sdpa here: flash-attn needs CUDA). Pretraining windows isolated the same way
are checked against their document fragments, and the stream default against the packed loss it must differ from.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.config import DataConfig, ModelConfig
from trainer.data import IGNORE_INDEX, build_datasets, load_tokenizer
from trainer.train.sequence_parallel import as_one_row, forward_inputs

pytestmark = pytest.mark.slow  # each test prepares the tiny data and runs a model (~4-12 s)

TINY = Path(__file__).resolve().parent.parent / "data" / "tiny"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ModelConfig(tokenizer=str(TINY / "tokenizer")))


@pytest.fixture(autouse=True)
def prepared_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def tiny_llama(attention: str, vocab: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=vocab, max_position_embeddings=256,
                         attn_implementation=attention)
    return LlamaForCausalLM(config).double().eval()  # float64 weights; the loss itself is fp32 (transformers upcasts with .float())


def samples(tokenizer, task: str, seq_len: int, **overrides):
    source = str(TINY / ("sft.jsonl" if task == "sft" else "pretrain.jsonl"))
    cfg = DataConfig(source=source, eval_source=source, seq_len=seq_len, task=task, **overrides)
    return build_datasets(cfg, tokenizer, seed=0).train.sources[0].samples


def batch_of(samples, rows) -> dict:
    return {key: torch.from_numpy(value) for key, value in samples.rows(np.asarray(rows)).items()}


def documents(batch: dict):
    """(input_ids, labels) of each document of a packed batch, cut at its position-id restarts (padding dropped)."""
    for ids, labels, positions in zip(batch["input_ids"], batch["labels"], batch["position_ids"]):
        starts = (positions == 0).nonzero().flatten().tolist() + [len(ids)]
        for begin, end in zip(starts, starts[1:]):
            if (labels[begin:end] != IGNORE_INDEX).any():  # the padding segment predicts nothing
                yield ids[begin:end], labels[begin:end]


@torch.no_grad()
def one_by_one(model, batch: dict) -> float:
    """Token-weighted mean of the documents' losses, each run alone (its own positions from 0, nothing before it)."""
    total, count = 0.0, 0
    for ids, labels in documents(batch):
        predicted = int((labels[1:] != IGNORE_INDEX).sum())
        if predicted:
            total += float(model(input_ids=ids[None], labels=labels[None]).loss) * predicted
            count += predicted
    return total / count


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@torch.no_grad()
def test_packed_sft_loss_is_the_token_weighted_loss_of_its_documents_run_alone(tokenizer, attention):
    packed = samples(tokenizer, "sft", 128, packing=True)
    batch = batch_of(packed, [0, 1, 2])
    assert "attention_mask" not in batch and len(list(documents(batch))) > 3  # several documents a row
    model = tiny_llama(attention, len(tokenizer))
    alone = one_by_one(model, batch)
    assert float(model(**forward_inputs(model, batch)).loss) == pytest.approx(alone, rel=1e-6)
    one_row = as_one_row(forward_inputs(model, batch))  # what flash-attn gets
    assert one_row["input_ids"].shape[0] == 1 and float(model(**one_row).loss) == pytest.approx(alone, rel=1e-6)
    shared = samples(tokenizer, "sft", 128, packing=True, cross_document_attention=True)
    crossing = batch_of(shared, [0, 1, 2])
    assert "position_ids" not in crossing
    assert float(model(**forward_inputs(model, crossing)).loss) != pytest.approx(alone, rel=1e-4)  # as before


@torch.no_grad()
def test_isolated_pretraining_windows_are_the_loss_of_their_document_pieces(tokenizer):
    isolated = samples(tokenizer, "pretrain", 64, cross_document_attention=False)
    batch = batch_of(isolated, [0, 1])
    model = tiny_llama("sdpa", len(tokenizer))
    assert float(model(**forward_inputs(model, batch)).loss) == pytest.approx(one_by_one(model, batch), rel=1e-6)
    stream = batch_of(samples(tokenizer, "pretrain", 64), [0, 1])  # the default: the stream, across documents
    assert set(stream) == {"input_ids", "labels"} and torch.equal(stream["input_ids"], batch["input_ids"])


@pytest.mark.gpu
@torch.no_grad()
def test_packed_sft_with_flash_attention_keeps_documents_apart(tokenizer):
    """flash-attn separates packed documents through position-id restarts in one row (transformers 5.24's varlen
    path): the packed loss equals the documents' own, as with sdpa, to bf16 tolerance."""
    if importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed (pip install -e '.[gpu]')")
    packed = samples(tokenizer, "sft", 128, packing=True)
    batch = {k: v.cuda() for k, v in batch_of(packed, [0, 1, 2]).items()}
    model = tiny_llama("flash_attention_2", len(tokenizer)).to(torch.bfloat16).cuda()
    assert forward_inputs(model, batch)["input_ids"].shape[0] == 1  # laid end to end for the varlen kernel
    assert float(model(**forward_inputs(model, batch)).loss) == pytest.approx(one_by_one(model, batch), rel=2e-2)
