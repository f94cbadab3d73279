"""Issue 41's mechanisms behind the held-out misses of tests/logs/heldout41b, each on variants beyond the one log:
a message states one remedy or it is not acted on, versions go to the toolkit reasoning, a compiler's missing
header names its package and an unsupported architecture its first CUDA, the OOM ladder waits for the planner's
verdict (and never changes the ZeRO stage of one rank), and the raising site and phase come from frames pasted
without a 'Traceback' header, mid-way paths and rich tracebacks."""
from __future__ import annotations

import pytest

from trainer import ds as dsc
from trainer.diagnose import ladder
from trainer.diagnose.doctor import diagnose, diagnosis_json
from trainer.presets import load_preset, with_overrides
from trainer.resolve import resolve

pytestmark = pytest.mark.quick


def run(text: str, preset: str = "7b_8xa100", base: tuple = ()) -> dict:
    d = diagnose(resolve(load_preset(preset, list(base))), text,
                 lambda extra: resolve(load_preset(preset, with_overrides(list(base), extra))))
    return diagnosis_json(d, None, None)


def first(j: dict) -> str:
    p = j["proposal"] or {}
    return " ".join([p.get("step", ""), *p.get("overrides", []), p.get("reason", "")])


def everything(j: dict) -> str:
    return " ".join([first(j), *(" ".join([p["step"], *p["overrides"], p["reason"]]) for p in j["then"])])


# --- 3. a message that lists several causes, or names versions, is not "do what the message asks" ---------------

@pytest.mark.parametrize("text", [
    "RuntimeError: Expected to mark a variable ready only once. This error is caused by one of the following reasons: "
    "1) Use of a module parameter outside the `forward` function. Please make sure model parameters are not shared "
    "across multiple concurrent forward-backward passes. 2) Reused parameters in multiple reentrant backward passes.",
    "RuntimeError: Loading the shard failed. Possible causes: a truncated download or a full disk. Please make sure "
    "the files are complete.",
    "ValueError: The dataset produced no batches. This may be because every sample is longer than the maximum "
    "length; please check the data.",
])
def test_a_message_listing_several_causes_is_not_acted_on_as_one_remedy(text):
    j = run(text)
    assert not first(j).startswith("do what the message asks"), first(j)
    assert j["class"] != "config_message"


@pytest.mark.parametrize("text, wants", [
    ("RuntimeError:\n    The detected CUDA version (12.2) mismatches the version that was used to compile\n"
     "    PyTorch (11.3). Please make sure to use the same CUDA versions.", ("cuda-11.3", "cu121")),
    ("RuntimeError: The detected CUDA version (11.8) mismatches the version that was used to compile PyTorch (12.1). "
     "Please make sure to use the same CUDA versions.", ("cuda-12.1", "cu118")),
    ("RuntimeError: The detected CUDA version (12.4) mismatches the version that was used to compile\n"
     "PyTorch (11.8). Please make sure to use the same CUDA versions.", ("cuda-11.8", "cu124")),
])
def test_a_message_naming_versions_goes_to_the_toolkit_reasoning(text, wants):
    j = run(text)
    assert j["class"] == "cuda_toolkit", j["class"]
    assert all(w in first(j) for w in wants), first(j)
    assert "DeepSpeed JSON" not in first(j)


def test_a_version_message_without_a_known_class_is_not_a_config_change():
    j = run("RuntimeError: Your NCCL version (2.10.3) is too old for this collective. Please make sure to use the "
            "same NCCL version on every node.")
    assert not first(j).startswith("do what the message asks"), first(j)


@pytest.mark.parametrize("text, code", [
    ("RuntimeError: Gradient checkpointing needs inputs that require grad. Please call "
     "`model.enable_input_require_grads()` before training.", "model.enable_input_require_grads()"),
    ("ValueError: The model was saved in a mode training cannot resume. Please set `model.config.use_cache = False` "
     "before calling train.", "model.config.use_cache = False"),
    ("ValueError: The collator cannot batch these samples. Please use `DataCollatorForSeq2Seq(tokenizer, "
     "padding=True)` instead.", "DataCollatorForSeq2Seq(tokenizer, padding=True)"),
])
def test_a_remedy_written_as_code_is_stated_without_the_config_boilerplate(text, code):
    j = run(text)
    assert first(j).startswith("do what the message asks"), first(j)
    assert f"`{code}`" in first(j) and "DeepSpeed JSON" not in first(j), first(j)


# --- 4. compiler diagnostics are op-build failures with the package or toolkit they name ------------------------

@pytest.mark.parametrize("line, package", [
    ("/home/u/.venv/lib/python3.11/site-packages/torch/include/torch/csrc/python_headers.h:12:10: fatal error: "
     "Python.h: No such file or directory", "python3.11-dev"),
    ("csrc/comm/shm.cpp:3:10: fatal error: mpi.h: No such file or directory", "libopenmpi-dev"),
    ("csrc/io/zip.cpp:1:10: fatal error: zlib.h: No such file or directory", "zlib1g-dev"),
    ("csrc/x/op.cpp:2:10: fatal error: foo/bar_impl.h: No such file or directory", "apt-file search"),
])
def test_a_missing_header_names_the_package_that_provides_it(line, package):
    j = run(f"Building extension module fused_adam...\n{line}\ncompilation terminated.\nninja: build stopped: "
            f"subcommand failed.")
    assert j["class"] == "op_build", j["class"]
    assert package in first(j), first(j)
    assert "DS_BUILD_OPS=1" not in j["proposal"]["step"]


@pytest.mark.parametrize("line, cuda", [
    ("nvcc fatal : Unsupported gpu architechture 'compute_89'", "11.8"),
    ("nvcc fatal   : Value 'sm_90a' is not defined for option 'gpu-name'", "11.8"),
    ("nvcc fatal   : Value 'sm_100' is not defined for option 'gpu-name'", "12.8"),
    ("nvcc fatal   : Unsupported gpu architecture 'sm_86'", "11.1"),
])
def test_an_unsupported_architecture_names_the_first_toolkit_that_supports_it(line, cuda):
    j = run(line)
    assert j["class"] == "cuda_toolkit", j["class"]
    assert f"CUDA >= {cuda}" in first(j), first(j)
    assert "DS_BUILD_OPS=1 pip" not in first(j)


# --- 5. the OOM ladder waits for the planner's verdict; one rank never changes ZeRO stage ------------------------

@pytest.mark.parametrize("frames", [
    ('  File "/usr/lib/python3.10/site-packages/torch/autograd/graph.py", line 744, in _engine_run_backward\n'
     '    return Variable._execution_engine.run_backward(\n'),
    ('  File "/usr/lib/python3.10/site-packages/transformers/models/llama/modeling_llama.py", line 300, in forward\n'
     '    attn = torch.matmul(q, k)\n'),
    ('  File "/usr/lib/python3.10/site-packages/torch/optim/adamw.py", line 400, in _single_tensor_adamw\n'
     '    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)\n'),
])
def test_when_the_planner_fits_the_config_no_memory_rung_comes_first(frames):
    j = run(f"Traceback (most recent call last):\n{frames}torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to "
            f"allocate 112.00 MiB. GPU", preset="7b_lora_1x4090")
    assert j["class"] == "cuda_oom"
    assert j["proposal"]["overrides"] == [], first(j)
    assert "planner" in first(j) and "fits" in first(j)
    assert "ZeRO stage" not in everything(j), everything(j)


@pytest.mark.parametrize("preset, base", [("7b_lora_1x4090", ()), ("7b_lora_1x4090", ("train.micro_batch_size=8",)),
                                          ("7b_dpo_lora_1x4090", ())])
def test_one_rank_is_never_offered_a_zero_stage_change(preset, base):
    r = resolve(load_preset(preset, list(base)))
    assert r.world_size == 1
    assert ladder.stage_up(r) is None
    current = (r.batch.micro_batch_size, r.config.model.gradient_checkpointing, dsc.zero_stage(r.ds),
               dsc.offload_optimizer_device(r.ds), dsc.offload_param_device(r.ds))
    assert {point[2] for point in ladder._points(r, ladder.OOM_LADDER, current)} == {current[2]}


def test_several_ranks_still_get_the_stage_rung():
    assert ladder.stage_up(resolve(load_preset("7b_8xa100", []))) is not None


# --- 1 and 2. the raising site and phase from frames pasted without a header -----------------------------------

@pytest.mark.parametrize("text, site, phase", [
    ('  File "/opt/env/lib/python3.10/site-packages/transformers/modeling_utils.py", line 3480, in from_pretrained\n'
     '    ) = cls._load_pretrained_model(\n'
     '  File "/opt/env/lib/python3.10/site-packages/transformers/modeling_utils.py", line 3931, in _load_pretrained_model\n'
     '    raise RuntimeError(f"Error(s) in loading state_dict")\n'
     'RuntimeError: Error(s) in loading state_dict for LlamaForCausalLM:', ("modeling_utils.py", 3931), "loading"),
    ('/python3.10/site-packages/torch/autograd/__init__.py", line 267, in backward\n'
     '    _engine_run_backward(\n'
     'RuntimeError: element 0 of tensors does not require grad and does not have a grad_fn',
     ("torch/autograd/__init__.py", 267), "backward"),
    ('/trl/trainer/grpo_trainer.py", line 269, in __init__\n'
     '    super().__init__(\n'
     '[rank0]: TypeError: Trainer.__init__() got an unexpected keyword argument \'processing_class\'',
     ("trl/trainer/grpo_trainer.py", 269), None),
    ('╭──────────── Traceback (most recent call last) ─────────────╮\n'
     '│ /root/env/lib/python3.10/site-packages/transformers/modeling_utils.py:2364 in │\n'
     '│ from_pretrained                                                │\n'
     '│ ❱ 2364 │   │   │   │   raise ValueError(                       │\n'
     '╰────────────────────────────────────────────────────────────────╯\n'
     'ValueError: something about the load', ("modeling_utils.py", 2364), "loading"),
    ('│ /opt/conda/lib/python3.7/site-packages/deepspeed/runtime/config.py: │\n'
     '│ 891 in _batch_assertion                                             │\n'
     '│ ❱  891 │   │   │   f"Check batch related parameters. train_batch_si │\n'
     '╰─────────────────────────────────────────────────────────────────────╯\n'
     'AssertionError: Check batch related parameters.', ("deepspeed/runtime/config.py", 891), None),
])
def test_the_raising_site_and_phase_come_from_frames_without_a_traceback_header(text, site, phase):
    j = run(text)
    assert j["raising_site"] is not None, j["exception"]
    assert j["raising_site"]["file"].endswith(site[0]) and j["raising_site"]["line"] == site[1], j["raising_site"]
    if phase:
        assert j["phase"] == phase, j["phase"]


def test_a_log_ending_in_a_rich_frame_gives_the_site_and_what_it_raises():
    j = run('│ /root/env/lib/python3.10/site-packages/transformers/modeling_utils.py:2364 in │\n'
            '│ from_pretrained                                                │\n'
            '│ ❱ 2364 │   │   │   │   raise ValueError(                       │\n')
    assert j["raising_site"]["function"] == "from_pretrained" and j["exception"]["type"] == "ValueError"
    assert j["phase"] == "loading"


# --- 6. zero-size parameters in a saved model: consolidate the shards -------------------------------------------

@pytest.mark.parametrize("listing", [
    "model.embed_tokens.weight : torch.Size([0])\nmodel.layers.0.self_attn.q_proj.weight : torch.Size([0])",
    "{'lm_head.weight': torch.Size([0]), 'model.norm.weight': torch.Size([0])}",
    "transformer.h.0.attn.c_attn.bias = torch.Size([0])",
])
def test_zero_size_parameters_of_a_saved_model_are_consolidated_with_zero_to_fp32(listing):
    j = run(f"pytorch_model.bin\n{listing}", preset="70b_8xa100")
    assert j["class"] == "stage3_save", j["class"]
    assert "zero_to_fp32" in j["proposal"]["step"], first(j)


# --- a tokenizer without a pad token -----------------------------------------------------------------------------

@pytest.mark.parametrize("text", [
    "ValueError: Asking to pad but the tokenizer does not have a padding token. Please select a token to use as "
    "`pad_token` `(tokenizer.pad_token = tokenizer.eos_token e.g.)` or add a new pad token via "
    "`tokenizer.add_special_tokens({'pad_token': '[PAD]'})`.",
    "ValueError: Cannot handle batch sizes > 1 if no padding token is defined.",
    "Using pad_token, but it is not set yet.\nTraceback (most recent call last):\n  File \"t.py\", line 3, in <module>\n"
    "    batch = collator(samples)\nTypeError: '<' not supported between instances of 'NoneType' and 'int'",
])
def test_a_tokenizer_without_a_pad_token_gets_one(text):
    j = run(text, preset="7b_lora_1x4090")
    assert j["class"] == "pad_token", j["class"]
    assert "tokenizer.pad_token = tokenizer.eos_token" in first(j)


# --- 7. a hang without error text: a true fallback --------------------------------------------------------------

@pytest.mark.parametrize("text, several", [
    ("deepspeed --include localhost:2,3 train.py --deepspeed zero2.json\n[2024-05-01 10:00:00] Loading model", True),
    ("torchrun --nproc_per_node=4 t.py\ndist.init_process_group('nccl')\ndist.all_reduce(x)", True),
    ("python train.py --model llama\nLoading checkpoint shards: 100%|██████████| 2/2", False),
])
def test_a_log_without_error_text_is_a_hang_and_says_how_to_see_where(text, several):
    j = run(text)
    assert not j["recognised"] and j["proposal"] is None
    assert j["title"].startswith("no error in the log"), j["title"]
    said = " ".join(j["advice"])
    assert "py-spy dump" in said
    assert ("NCCL_P2P_DISABLE=1" in said) == several
