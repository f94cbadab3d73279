"""Exports a user can serve, and chat models that stop (issue 37, items 2, 3 and 9), without any rank: the chat
templates' markers and end of turn on the shipped tiny tokenizer, what `for_serving` writes for Llama, Mixtral and
Qwen3-MoE models (plain transformers' batched generate on the export equals each prompt alone), generate's stop
rules, and the export's file modes. The trained versions are in tests/test_chat_models.py."""
from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from trainer.config import DataConfig, ModelConfig
from trainer.data import apply_chat_template, load_tokenizer
from trainer.data.chat_format import declared, end_of_turn, stop_token_ids
from trainer.data.tokenize import TEMPLATE_DIR, TEMPLATE_NAMES

from distributed import REPO

TOKENIZER = REPO / "data" / "tiny" / "tokenizer"
CONVERSATION = [{"role": "user", "content": "What is 3 plus 4?"}, {"role": "assistant", "content": "7."}]


def templated(name: str | None):
    return apply_chat_template(load_tokenizer(ModelConfig(tokenizer=str(TOKENIZER))), DataConfig(chat_template=name))


@pytest.mark.parametrize("name", TEMPLATE_NAMES)
def test_every_shipped_template_declares_the_end_of_turn_it_writes_and_its_markers_are_single_tokens(name):
    text = (TEMPLATE_DIR / f"{name}.jinja").read_text()
    declaration = declared(text)
    assert set(declaration) == {"special tokens", "end of turn"}, f"{name}.jinja declares {declaration}"
    tokenizer = templated(name)
    wanted = declaration["end of turn"][0]
    assert end_of_turn(tokenizer) == (tokenizer.eos_token if wanted == "eos_token" else wanted)
    for marker in declaration["special tokens"]:
        assert marker in tokenizer.all_special_tokens
        assert len(tokenizer(marker, add_special_tokens=False)["input_ids"]) == 1, marker
    rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_tokens_to_ids(end_of_turn(tokenizer)) in ids  # the learnt answer ends on it


def test_chatml_on_the_tiny_tokenizer_adds_its_two_markers_and_stops_on_im_end_and_eos():
    plain = load_tokenizer(ModelConfig(tokenizer=str(TOKENIZER)))
    tokenizer = templated("chatml")
    assert len(plain("<|im_end|>", add_special_tokens=False)["input_ids"]) > 1  # split into pieces before
    assert len(tokenizer) == len(plain) + 2
    assert stop_token_ids(tokenizer) == [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert stop_token_ids(plain) == [plain.eos_token_id]  # its own template ends turns on EOS
    assert tokenizer.decode(tokenizer("<|im_start|>user\nhi<|im_end|>")["input_ids"], skip_special_tokens=True) \
        == "user\nhi"


def test_a_template_file_without_declarations_still_stops_on_the_special_token_after_the_answer(tmp_path):
    path = tmp_path / "gemma.jinja"
    path.write_text("{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
                    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
    tokenizer = templated(str(path))
    assert end_of_turn(tokenizer) is None  # undeclared and not a token: nothing to stop on but EOS (and --stop)
    tokenizer.add_special_tokens({"extra_special_tokens": ["<end_of_turn>"]}, replace_extra_special_tokens=False)
    assert end_of_turn(tokenizer) == "<end_of_turn>"


@pytest.mark.slow
def test_a_pretrained_model_grows_its_embeddings_to_the_chat_tokenizer_with_the_mean_of_the_old_rows():
    """TRL's setup_chat_format: the markers are new rows of the input and output embeddings."""
    from trainer.model import fit_embeddings
    tokenizer = templated("chatml")
    model = tiny_model("llama", vocab_size=len(tokenizer) - 2)  # a pretrained model sized to its own tokenizer
    old = model.get_input_embeddings().weight.detach().clone()
    assert fit_embeddings(model, len(tokenizer)) == 2 and fit_embeddings(model, len(tokenizer)) == 0
    grown = model.get_input_embeddings().weight.detach()
    assert grown.shape[0] == model.get_output_embeddings().weight.shape[0] == len(tokenizer)
    assert torch.equal(grown[:len(old)], old)
    assert torch.allclose(grown[len(old):].mean(0), old.mean(0), atol=0.05)


# --- exports -------------------------------------------------------------------------------------------------------

def tiny_model(family: str, **switches):
    from transformers import AutoConfig, AutoModelForCausalLM
    shape = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=switches.pop("vocab_size", 1024), max_position_embeddings=64,
                 use_cache=False)
    if family != "llama":
        shape.update(num_experts=4, num_experts_per_tok=2, head_dim=8, output_router_logits=True)
    config = AutoConfig.for_model(family, **shape, **switches)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def export(model, tokenizer, path):
    from trainer.train.checkpoint import for_serving
    with for_serving(model, tokenizer):
        model.save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "mixtral", "qwen3_moe"])
def test_batched_generate_on_each_exported_family_equals_each_prompt_alone(family, tmp_path):
    """Training leaves output_router_logits on for the MoE aux loss; a served export must not (transformers'
    load_balancing_loss_func fails on a batch of several prompts), nor keep any other `output_*` switch on."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = tiny_model(family, output_hidden_states=True)
    path = export(model, templated("chatml"), tmp_path / family)
    assert model.config.output_hidden_states is True  # the live model is left as training had it
    config = json.loads((path / "config.json").read_text())
    assert not [key for key, value in config.items() if key.startswith("output_") and value is True]
    served = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    prompts = ["Once", "The little cat sat", "What is 3 plus"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        together = served.generate(**batch, max_new_tokens=6, do_sample=False)
        width = batch["input_ids"].shape[1]
        for row, prompt in zip(together[:, width:], prompts):
            alone = tokenizer(prompt, return_tensors="pt")
            single = served.generate(**alone, max_new_tokens=6, do_sample=False)[0, alone["input_ids"].shape[1]:]
            assert row[:len(single)].tolist() == single.tolist(), prompt


@pytest.mark.slow
def test_a_chatml_export_lists_im_end_with_eos_and_ships_it_as_one_special_token(tmp_path):
    from transformers import AutoTokenizer, GenerationConfig
    path = export(tiny_model("llama"), templated("chatml"), tmp_path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert "<|im_end|>" in tokenizer.all_special_tokens
    assert tokenizer("<|im_end|>", add_special_tokens=False)["input_ids"] == [im_end]
    assert GenerationConfig.from_pretrained(str(path)).eos_token_id == [tokenizer.eos_token_id, im_end]
    assert json.loads((path / "config.json").read_text())["eos_token_id"] == tokenizer.eos_token_id


@pytest.mark.slow
@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_the_export_files_get_the_users_umask_not_safetensors_private_0600(umask, tmp_path):
    from trainer.files import modes_as_umask_allows
    before = os.umask(umask)
    try:
        path = export(tiny_model("llama"), templated(None), tmp_path / "hf")
        assert stat.S_IMODE((path / "model.safetensors").stat().st_mode) == 0o600  # what safetensors writes
        modes_as_umask_allows(path)
    finally:
        os.umask(before)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in path.iterdir()}
    assert set(modes.values()) == {0o666 & ~umask}, modes


# --- generate's stop rules -----------------------------------------------------------------------------------------

def test_a_completion_ends_at_its_first_stop_token_or_text():
    from trainer.data.prompts import completion_ids
    from trainer.infer.generate import before_stop, without_trailing
    assert completion_ids(torch.tensor([5, 6, 844, 7, 2, 0]), [2, 844]) == [5, 6]
    assert completion_ids(torch.tensor([5, 2, 844]), [2, 844]) == [5]
    assert completion_ids(torch.tensor([5, 6]), [2, 844]) == [5, 6]
    assert completion_ids(torch.tensor([5, 2]), []) == [5, 2]  # --ignore-eos
    assert before_stop("The cow is blue.\nUser: and", ("User:", "\n")) == "The cow is blue."
    assert before_stop("no stop here", ("###",)) == "no stop here"
    assert without_trailing([5, 6, 0, 0], 0) == [5, 6]  # the pad after a row a stop string ended


# --- evaluate says what it scored ----------------------------------------------------------------------------------

@pytest.mark.slow
def test_evaluate_data_scores_all_of_the_file_unless_capped_and_says_how_many(tmp_path):
    from distributed import run_cli
    model = export(tiny_model("llama"), templated(None), tmp_path / "hf")
    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps({"text": f"Story {i}: the cat sat on the mat and looked at the dog."}) + "\n"
                            for i in range(40)))
    base = ["evaluate", "--model", str(model), "--data", str(data), "--seq-len", "32"]
    whole = run_cli(*base)
    assert whole.returncode == 0, whole.stderr[-3000:]
    available = json.loads(whole.stdout)["sequences"]
    assert available > 8 and f"evaluate: {available} of the {available} sequences of {data}" in whole.stderr
    capped = run_cli(*base, "--eval-sequences", "8")
    assert capped.returncode == 0, capped.stderr[-3000:]
    assert json.loads(capped.stdout)["sequences"] == 8
    assert (f"evaluate: 8 of the {available} sequences of {data} (data.seq_len 32); --eval-sequences {available} "
            f"scores all of them") in capped.stderr
