"""Bad input to `generate` and `evaluate`: each a named error on stderr, exit 2, no traceback, nothing written.

In one process (no launcher): everything below is refused before a process group starts or a weight is read.
"""
from __future__ import annotations

import json

import pytest
import torch

from trainer.__main__ import main


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """Tiny HF model directories with the shipped tokenizer (its chat template only in "chat"): 4 heads / 2 kv heads, and 3 heads / 3 kv heads."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    root = tmp_path_factory.mktemp("models")
    tokenizer = AutoTokenizer.from_pretrained("data/tiny/tokenizer")
    tokenizer.chat_template = None  # the shipped one has a template; these models have none
    made = {}
    with_template = AutoTokenizer.from_pretrained("data/tiny/tokenizer")
    for name, heads, kv, hidden in (("gqa", 4, 2, 64), ("three_heads", 3, 3, 48), ("chat", 4, 2, 64)):
        config = AutoConfig.for_model("llama", hidden_size=hidden, num_hidden_layers=1, num_attention_heads=heads,
                                      num_key_value_heads=kv, intermediate_size=96, vocab_size=1024,
                                      max_position_embeddings=64)
        AutoModelForCausalLM.from_config(config).save_pretrained(root / name)
        (with_template if name == "chat" else tokenizer).save_pretrained(root / name)
        made[name] = root / name
    return made


def refused(capsys, *argv) -> str:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err
    return err.split("error: ", 1)[1]


def test_missing_model_path(capsys, tmp_path):
    message = refused(capsys, "generate", "--model", str(tmp_path / "nope"), "--prompt", "Hi")
    assert "no such file or directory" in message and "nope" in message


def test_directory_that_is_neither_hf_nor_checkpoint(capsys, tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    message = refused(capsys, "generate", "--model", str(tmp_path), "--prompt", "Hi")
    assert "neither an HF model directory" in message and str(tmp_path) in message


def test_a_file_as_model(capsys, tmp_path):
    (tmp_path / "model.bin").write_bytes(b"\0" * 8)
    assert "a regular file, not a directory" in refused(capsys, "generate", "--model", str(tmp_path / "model.bin"),
                                                "--prompt", "Hi")


def test_tp_not_dividing_the_heads(capsys, tiny_models):
    message = refused(capsys, "generate", "--model", str(tiny_models["three_heads"]), "--prompt", "Hi", "--tp", "2")
    assert "--tp 2" in message and "3 attention heads" in message and "--tp 1" in message


def test_tp_other_than_the_world_size(capsys, tiny_models):
    message = refused(capsys, "generate", "--model", str(tiny_models["gqa"]), "--prompt", "Hi", "--tp", "2")
    assert "--tp 2" in message and "number of ranks launched (1)" in message


def test_kernel_injection_on_cpu(capsys, tiny_models):
    message = refused(capsys, "generate", "--model", str(tiny_models["three_heads"]), "--prompt", "Hi",
                      "--kernel-inject")
    assert "--kernel-inject" in message and "CUDA only" in message


def config_only(root, family: str, heads: int, kv_heads: int, **fields):
    """A model directory with config.json and the tokenizer but no weights: a refusal must come before any load."""
    from transformers import AutoConfig, AutoTokenizer
    config = AutoConfig.for_model(family, hidden_size=64, num_hidden_layers=2, num_attention_heads=heads,
                                  num_key_value_heads=kv_heads, intermediate_size=96, vocab_size=1024,
                                  max_position_embeddings=64, **fields)
    path = root / f"{family}_{heads}_{kv_heads}"
    config.save_pretrained(path)
    AutoTokenizer.from_pretrained("data/tiny/tokenizer").save_pretrained(path)
    return path


@pytest.mark.parametrize("family, kv_heads, says", [
    ("llama", 2, ["4 attention heads and 2 key/value heads", "DS_LLAMAContainer", "never sets the kernel's num_kv"]),
    ("mistral", 4, ["no kernel-injection policy for model_type 'mistral'", "MistralDecoderLayer"]),
    ("qwen2", 2, ["no kernel-injection policy for model_type 'qwen2'", "Qwen2DecoderLayer"]),
])
def test_kernel_injection_refuses_what_deepspeed_cannot_serve_before_loading(capsys, tmp_path, family, kv_heads,
                                                                              says):
    """A GQA Llama (the HF Llama container never sets num_kv: strided_copy asserts at load) and families without a
    DeepSpeed policy (injection would do nothing) are named errors from the config alone: no weights exist here."""
    model = config_only(tmp_path, family, 4, kv_heads)
    message = refused(capsys, "generate", "--model", str(model), "--prompt", "Hi", "--kernel-inject")
    assert all(fragment in message for fragment in says), message
    assert "--tp N (DeepSpeed AutoTP" in message and "leave --kernel-inject out" in message


def test_every_shipped_family_is_judged_as_deepspeeds_own_policies_judge_it():
    """For each family the trainer ships (dense and MoE), MHA and GQA: injection is allowed exactly when one of
    DeepSpeed's replace_policies owns the family's decoder layer class and, with fewer key/value heads, its
    container sets num_kv. DeepSpeed 0.19.8: only an MHA Llama."""
    from deepspeed.module_inject.replace_policy import replace_policies
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.config import LLAMA_LIKE
    from trainer.infer.injection import injection_problems
    from trainer.moe import MOE_FAMILIES
    owned = set()
    for policy in replace_policies:
        policy(None)
        classes = policy._orig_layer_class
        owned.update(classes if isinstance(classes, list) else [classes])
    allowed = []
    for family in (*LLAMA_LIKE, *MOE_FAMILIES):
        for kv_heads in (4, 2):
            config = AutoConfig.for_model(family, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                          num_key_value_heads=kv_heads, intermediate_size=96, vocab_size=128)
            with torch.device("meta"):
                layer_class = type(AutoModelForCausalLM.from_config(config).model.layers[0])
            problems = injection_problems(config)
            assert (not problems) == (layer_class in owned and kv_heads == 4), (family, kv_heads, problems)
            if not problems:
                allowed.append((family, kv_heads))
    assert allowed == [("llama", 4)]


def test_an_injected_layer_returns_the_hidden_states_transformers_expects():
    """DeepSpeed's injected layer returns (output, presents) when a cache is asked for, (output, mask) otherwise;
    transformers 5.24's decoder loop takes the return value as the next hidden states. Wrapped by
    hold_layer_contract, layers returning such tuples generate exactly as the plain model (the kernel itself needs
    CUDA: tests/test_gpu.py)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from trainer.infer.injection import TensorOutput, hold_layer_contract

    class TupleLayer(LlamaDecoderLayer):  # DeepSpeedTransformerInference's return contract
        def forward(self, hidden_states, *args, **kwargs):
            return super().forward(hidden_states, *args, **kwargs), None

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         intermediate_size=64, vocab_size=64, max_position_embeddings=64)
    plain = LlamaForCausalLM(config).eval()
    injected = LlamaForCausalLM(config).eval()
    injected.load_state_dict(plain.state_dict())
    for index, layer in enumerate(injected.model.layers):
        tupled = TupleLayer(config, index)
        tupled.load_state_dict(layer.state_dict())
        injected.model.layers[index] = tupled
    prompt = torch.tensor([[5, 9, 13, 2]])
    with pytest.raises(Exception):  # the contract broken: a tuple where a tensor must be
        injected.generate(prompt, max_new_tokens=6, do_sample=False)
    assert hold_layer_contract(injected, TupleLayer) == 2
    assert all(isinstance(layer, TensorOutput) for layer in injected.model.layers)
    expected = plain.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(injected.generate(prompt, max_new_tokens=6, do_sample=False), expected)


def test_fp16_on_cpu(capsys, tiny_models):
    assert "--dtype fp16" in refused(capsys, "generate", "--model", str(tiny_models["gqa"]), "--prompt", "Hi",
                                     "--dtype", "fp16")


def test_beam_search(capsys, tiny_models):
    message = refused(capsys, "generate", "--model", str(tiny_models["gqa"]), "--prompt", "Hi", "--num-beams", "4")
    assert "--num-beams 4" in message and "beam search" in message


@pytest.mark.parametrize("line, expected", [
    ("{not json", "not valid JSON"),
    ('["a list"]', "a JSON list"),
    ('{"text": "no prompt key"}', "needs \"prompt\""),
])
def test_prompts_file_with_a_bad_line(capsys, tiny_models, tmp_path, line, expected):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "fine"}) + "\n\n" + line + "\n")
    message = refused(capsys, "generate", "--model", str(tiny_models["gqa"]), "--prompts", str(prompts))
    assert message.startswith(f"{prompts}:3:") and expected in message


def test_prompt_longer_than_the_context(capsys, tiny_models):
    message = refused(capsys, "generate", "--model", str(tiny_models["gqa"]), "--prompt", "word " * 80,
                      "--max-new-tokens", "8")
    assert "--prompt" in message and "context of 64" in message


@pytest.mark.slow
def test_without_max_new_tokens_a_short_context_generates_what_it_leaves(capsys, tiny_models, tmp_path):
    """A model with 64 positions (the tiny presets') and no --max-new-tokens: the default 64 would pass the context
    after any prompt, so generate takes what the context leaves after the longest prompt and says so; given
    explicitly, the same number is still refused (test above)."""
    from transformers import AutoTokenizer
    longest = "word " * 20
    prompt_tokens = len(AutoTokenizer.from_pretrained(tiny_models["gqa"])(longest)["input_ids"])
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--model", str(tiny_models["gqa"]), "--prompt", "Once", "--prompt", longest,
                 "--ignore-eos", "--format", "jsonl", "-o", str(out)]) == 0
    room = 64 - prompt_tokens
    assert f"--max-new-tokens {room} (the model's context of 64" in capsys.readouterr().err
    assert [json.loads(line)["tokens"] for line in out.read_text().splitlines()] == [room, room]
    assert refused(capsys, "generate", "--model", str(tiny_models["gqa"]), "--prompt", longest,
                   "--max-new-tokens", "64").count("context of 64") == 1


def test_chat_without_a_template(capsys, tiny_models):
    message = refused(capsys, "generate", "--model", str(tiny_models["gqa"]), "--prompt", "Hi", "--chat")
    assert "chat template" in message


def test_output_into_a_missing_directory_writes_nothing(capsys, tiny_models, tmp_path):
    message = refused(capsys, "generate", "--model", str(tiny_models["gqa"]), "--prompt", "Hi", "-o",
                      str(tmp_path / "missing" / "out.jsonl"))
    assert "does not exist" in message and not (tmp_path / "missing").exists()


def test_evaluate_a_plain_model_needs_data(capsys, tiny_models):
    message = refused(capsys, "evaluate", "--model", str(tiny_models["gqa"]))
    assert "--data" in message and "--preset" in message


@pytest.mark.slow
def test_generate_and_evaluate_a_plain_hf_model(capsys, tiny_models, tmp_path):
    """The good path in one process, on a random model: a completion per prompt, and a perplexity from --data."""
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--model", str(tiny_models["gqa"]), "--prompt", "Once", "--prompt", "A cat",
                 "--max-new-tokens", "5", "--format", "jsonl", "-o", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["Once", "A cat"] and all(0 < r["tokens"] <= 5 for r in rows)
    data = tmp_path / "held_out.jsonl"
    data.write_text("".join(json.dumps({"text": f"The cat number {i} sat on the mat and looked at the dog."}) + "\n"
                            for i in range(40)))
    capsys.readouterr()
    assert main(["evaluate", "--model", str(tiny_models["gqa"]), "--data", str(data), "--seq-len", "32",
                 "--set", f"data.cache_dir={tmp_path / 'cache'}"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["sequences"] > 0 and result["tokens"] == result["sequences"] * 31
    assert 5.0 < result["eval_loss"] < 8.0  # a random model over 1024 tokens: about ln(1024) = 6.93


@pytest.mark.parametrize("size, ram_gb, expected", [("7b", 64, "off"), ("70b", 1024, "cpu"), ("70b", 64, None)])
def test_zero_inference_auto_follows_the_planner(monkeypatch, size, ram_gb, expected):
    """--zero-inference auto on an 80 GB GPU (mocked: there is none here): 7B fits, 70B goes to host RAM when
    the pinned weights fit there, and is a named error when nothing fits."""
    from transformers import AutoConfig

    import trainer.infer.session as session
    from trainer.errors import UserError
    from trainer.plan.models import NAMED_MODELS
    m = NAMED_MODELS[size][1]
    config = AutoConfig.for_model("llama", hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
                                  num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
                                  intermediate_size=m.intermediate_size, vocab_size=m.vocab_size,
                                  max_position_embeddings=m.max_position_embeddings)
    monkeypatch.setattr(session, "device_name", lambda: "cuda")
    monkeypatch.setattr("torch.cuda.mem_get_info", lambda: (80 * 10**9, 80 * 10**9))
    monkeypatch.setattr(session, "available_host_ram", lambda: ram_gb * 10**9)
    if expected is None:
        with pytest.raises(UserError, match="does not fit.*plan --inference"):
            session.planned_zero_mode(config, 1, "bf16", 1)
    else:
        assert session.planned_zero_mode(config, 1, "bf16", 1) == expected


@pytest.mark.slow
def test_chat_prompts_are_rendered_with_the_template(capsys, tiny_models, tmp_path):
    """--chat wraps a plain prompt in the template; a `messages` line is rendered with it anyway. The model sees
    the template's text: the prompt tokens of a chat prompt are more than the bare text's."""
    from transformers import AutoTokenizer

    from trainer.data.prompts import Prompt, read_prompts, render
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["chat"])
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi there"}]}) + "\n")
    [chat_line] = read_prompts(str(prompts))
    rendered = render(tokenizer, chat_line, chat=False)
    assert rendered == tokenizer.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=False,
                                                     add_generation_prompt=True)
    assert render(tokenizer, Prompt("Hi there", "--prompt"), chat=True) == rendered
    assert len(tokenizer(rendered)["input_ids"]) > len(tokenizer("Hi there")["input_ids"])
    out = tmp_path / "out.jsonl"
    assert main(["generate", "--model", str(tiny_models["chat"]), "--prompts", str(prompts), "--max-new-tokens", "3",
                 "--format", "jsonl", "-o", str(out)]) == 0
    assert json.loads(out.read_text())["prompt"] == chat_line.text


def test_a_run_directory_written_with_provenance_reads_back(tmp_path):
    """`config.resolved.yaml` as a run writes it (with its `derived` and `provenance` sections) is the config
    `generate`/`evaluate` read back for the run directory: the record's extra sections are not config keys."""
    import yaml

    from trainer.infer.source import run_config
    from trainer.presets import load_preset
    from trainer.resolve import resolve
    from trainer.train.run import run_record, write_resolved_config
    resolved = resolve(load_preset("tiny_cpu", ["train.lr=0.002"]), 2)
    write_resolved_config(tmp_path, run_record(resolved))
    assert {"derived", "provenance"} <= set(yaml.safe_load((tmp_path / "config.resolved.yaml").read_text()))
    config, world_size = run_config(tmp_path)
    assert (config.name, config.train.lr, world_size) == ("tiny_cpu", 0.002, 2)


# --- model and run directories that are not what they claim (issue: hardening round 2) ------------------------


def copy_model(tiny_models, tmp_path, name="gqa"):
    import shutil
    target = tmp_path / "model"
    shutil.copytree(tiny_models[name], target)
    return target


@pytest.mark.parametrize("content,fragments", [
    ("- a\n- list\n", ["run's saved config", "the top level is a list"]),
    (b"train: {lr: \xff}\n", ["run's saved config", "not UTF-8"]),
])
def test_a_run_directory_whose_saved_config_is_not_a_mapping(capsys, tiny_models, tmp_path, content, fragments):
    run = tmp_path / "run"
    (run / "hf").mkdir(parents=True)
    import shutil
    shutil.copytree(tiny_models["gqa"], run / "hf", dirs_exist_ok=True)
    target = run / "config.resolved.yaml"
    target.write_bytes(content if isinstance(content, bytes) else content.encode())
    message = refused(capsys, "generate", "--model", str(run), "--prompt", "Hi")
    assert all(f in message for f in fragments), message


def test_a_list_as_config_json(capsys, tiny_models, tmp_path):
    model = copy_model(tiny_models, tmp_path)
    (model / "config.json").write_text("[1, 2]")
    message = refused(capsys, "generate", "--model", str(model), "--prompt", "Hi")
    assert "model config" in message and "the top level is a list" in message


def test_a_fifo_is_named_a_fifo(capsys, tmp_path):
    import os
    os.mkfifo(tmp_path / "pipe")
    message = refused(capsys, "generate", "--model", str(tmp_path / "pipe"), "--prompt", "Hi")
    assert "a FIFO, not a directory" in message


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncated_weights", "other_shapes"])
def test_weights_that_do_not_load_are_a_named_error(tiny_models, tmp_path, damage):
    """Found while loading the weights (the ranks are up): still exit 2, the directory named, no traceback."""
    import subprocess
    import sys
    model = copy_model(tiny_models, tmp_path)
    if damage == "truncated_weights":
        weights = model / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    else:
        config = json.loads((model / "config.json").read_text())
        config["intermediate_size"] = 2 * config["intermediate_size"]
        (model / "config.json").write_text(json.dumps(config))
    proc = subprocess.run([sys.executable, "-m", "trainer", "generate", "--model", str(model), "--prompt", "Hi",
                           "--max-new-tokens", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and f"--model {model}" in proc.stderr, proc.stderr[-3000:]
