"""Issue 41's mechanisms behind two misses of tests/logs/heldout41c (that set was used to build them: see
test_doctor_heldout41c.py), each checked on cases drawn beyond those logs:

- a message a terminal or a paste wrapped over two lines is read as one (`Log.first_wrapped`, the recognisers'
  second pass): every recogniser's real evidence lines, cut at drawn spaces inside the evidence;
- the operating system's answer decides the remedy of a resource failure (`trainer/diagnose/oserror.py`): /dev/shm
  that refuses a segment for want of permission is not given more room.
"""
from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import pytest

from trainer.diagnose import oserror
from trainer.diagnose.doctor import diagnose, diagnosis_json
from trainer.diagnose.logtext import Log, wrapped
from trainer.diagnose.recognise import RECOGNISERS
from trainer.presets import load_preset
from trainer.resolve import resolve

pytestmark = pytest.mark.quick

LOGS = Path(__file__).parent / "logs"
RESOLVED = None


def run(text: str) -> dict:
    global RESOLVED
    RESOLVED = RESOLVED or resolve(load_preset("7b_8xa100", []))
    return diagnosis_json(diagnose(RESOLVED, text), None, None)


def first(j: dict) -> str:
    p = j["proposal"] or {}
    return " ".join([p.get("step", ""), *p.get("overrides", []), p.get("reason", ""),
                     *(f"{k}={v}" for k, v in (p.get("env") or []))])


# --- a wrapped message -------------------------------------------------------------------------------------------

def wrapped_cases(per_recogniser: int = 3, cuts: int = 2):
    """(recogniser, first half, second half): real lines of tests/logs that a recogniser's own pattern matches, cut
    at drawn spaces inside the matched text where the cut reads as a wrap (mid-sentence, no record starts after)."""
    rng = random.Random(41)
    lines = [line.strip() for path in sorted(LOGS.rglob("*.log")) for line in path.read_text(errors="replace").split("\n")]
    cases = []
    for recogniser in RECOGNISERS:
        pattern = next(iter(getattr(recogniser.find, "signature", ())), None)
        if pattern is None or not hasattr(recogniser.find, "wrapped"):
            continue
        matching = [(line, m) for line in lines if len(line) < 400 and (m := pattern.search(line))]
        for line, m in rng.sample(matching, min(per_recogniser, len(matching))):
            spaces = [i for i in range(m.start() + 1, m.end() - 1) if line[i] == " "]
            for at in rng.sample(spaces, min(cuts, len(spaces))):
                head, tail = line[:at], line[at + 1:]
                if wrapped(head, tail) and not pattern.search(head) and not pattern.search(tail):
                    cases.append((recogniser.failure, pattern, head, tail))
    return cases


CASES = wrapped_cases()


def test_the_drawn_wraps_cover_most_recognisers():
    assert len({failure for failure, *_ in CASES}) >= 10, sorted({failure for failure, *_ in CASES})


@pytest.mark.parametrize("failure,pattern,head,tail", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_a_wrapped_evidence_line_is_read_as_one(failure, pattern, head, tail):
    log = Log((head, tail))
    assert log.first(pattern) is None  # no single line holds it...
    assert log.first_wrapped(pattern) == 0  # ...the pair does
    j = run(f"{head}\n{tail}\n")
    # the same class, unless another class's evidence stands whole on one of the two lines (it comes first)
    whole = [r.failure for r in RECOGNISERS if r.find(Log.of(f"{head}\n{tail}\n")) is not None]  # as the doctor reads it
    assert j["recognised"] and j["class"] in [failure, *whole], (j["class"], head, tail)


@pytest.mark.parametrize("head,tail", [
    ("[2026-01-01 10:00:00] loading the model", "2026-01-01 10:00:01 CUDA capability sm_90 is not compatible with "
     "the current PyTorch installation"),
    ("the step finished.", "sm_90 is not compatible with the current PyTorch installation"),
    ("loading", "RuntimeError: sm_90 is not compatible with the current PyTorch installation"),
])
def test_two_records_are_not_joined(head, tail):
    """A line that ends its sentence, or a next line that starts a record of its own, is not a wrap."""
    assert not wrapped(head, tail)


# --- the system's answer --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("code", sorted(oserror.KINDS))
@pytest.mark.parametrize("form", ["words", "python", "labelled"])
def test_the_stated_errno_is_read_in_the_forms_logs_print(code, form):
    line = {"words": f"open('/dev/shm/x') failed: {os.strerror(code)}",
            "python": f"OSError: [Errno {code}] {os.strerror(code)}: '/ckpt/step_10'",
            "labelled": f"failed to create segment (errno: {code})"}[form]
    log = Log(("some line", line, "RuntimeError: the call failed"))
    found = oserror.stated(log, 2)
    assert found is not None and found.code == code and found.kind == oserror.KINDS[code]


@pytest.mark.parametrize("line", ["RuntimeError: NCCL Error 2: unhandled system error",
                                  "CUDA error 2: out of memory", "exit code 13"])
def test_codes_of_other_libraries_are_not_read_as_errno(line):
    assert oserror.stated(Log((line,)), 0) is None


SHM_LINE = "node3:1201:1290 [0] include/shm.h:27 NCCL WARN Call to shm_open failed : {0}"
SHM_TAIL = ("node3:1201:1290 [0] include/shm.h:48 NCCL WARN Error while creating shared memory segment "
            "nccl-shm-recv-0a1b-0-3-0 (size 4460544)\nRuntimeError: NCCL error in ProcessGroupNCCL.cpp:290, "
            "unhandled system error")


@pytest.mark.parametrize("code,says,never", [
    (errno.EACCES, "chmod 1777 /dev/shm", "--shm-size"),
    (errno.EPERM, "chmod 1777 /dev/shm", "--shm-size"),
    (errno.EROFS, "writable", "chmod"),
    (errno.ENOENT, "mount a tmpfs", "chmod"),
    (errno.ENOSPC, "--shm-size", "chmod"),
])
def test_shared_memory_refused_gets_the_remedy_of_the_systems_answer(code, says, never):
    j = run(SHM_LINE.format(os.strerror(code)) + "\n" + SHM_TAIL + "\n")
    assert j["class"] == "shm", j
    assert says in first(j) and never not in j["proposal"]["step"], first(j)


# --- two failures PyTorch states in its own terms (issue 41's "classic PyTorch failures") ---------------------------

DRIVERS = {  # the frames above torch's backward / embedding, as each library prints them
    "hf_trainer": '  File "/opt/conda/lib/python3.10/site-packages/transformers/trainer.py", line 2747, in training_step\n'
                  "    self.accelerator.backward(loss)\n",
    "deepspeed": '[rank0]:   File "/usr/local/lib/python3.11/dist-packages/deepspeed/runtime/engine.py", line 2020, '
                 "in backward\n[rank0]:     self.optimizer.backward(loss, retain_graph=retain_graph)\n",
    "plain": '  File "finetune.py", line 88, in <module>\n    loss.backward()\n',
}
NO_GRAPH = ('  File "/opt/conda/lib/python3.10/site-packages/torch/autograd/__init__.py", line 200, in backward\n'
            "    Variable._execution_engine.run_backward(\n"
            "RuntimeError: element 0 of tensors does not require grad and does not have a grad_fn\n")
CHECKPOINT_WARNING = ("UserWarning: torch.utils.checkpoint: the use_reentrant parameter should be passed explicitly.\n")
PEFT_LINE = "trainable params: 4,194,304 || all params: 6,742,609,920 || trainable%: 0.0622\n"


@pytest.mark.parametrize("driver", sorted(DRIVERS))
@pytest.mark.parametrize("checkpointing,peft,preset", [
    (True, True, "7b_8xa100"), (False, False, "7b_lora_1x4090"), (False, False, "7b_8xa100"), (True, False, "7b_8xa100"),
])
def test_a_loss_without_a_graph_gets_the_remedy_of_what_the_run_had(driver, checkpointing, peft, preset):
    """The fix depends on the run: checkpointing over a frozen base (from the log, or from the preset's LoRA and
    checkpointing) needs inputs that require grad or the non-reentrant checkpoint; otherwise nothing trains."""
    text = (CHECKPOINT_WARNING if checkpointing else "") + (PEFT_LINE if peft else "") + DRIVERS[driver] + NO_GRAPH
    d = diagnose(resolve(load_preset(preset, [])), text)
    j = diagnosis_json(d, None, None)
    assert j["class"] == "no_gradient_graph" and j["phase"] == "backward", j
    cfg = resolve(load_preset(preset, [])).config
    both = (checkpointing or cfg.model.gradient_checkpointing) and (peft or cfg.model.lora.enabled)
    if both:
        assert "enable_input_require_grads" in first(j) and "use_reentrant" in first(j), first(j)
    else:
        assert "print_trainable_parameters" in first(j) and "enable_input_require_grads" not in j["proposal"]["step"]


@pytest.mark.parametrize("evidence", [
    "../aten/src/ATen/native/cuda/Indexing.cu:1146: indexSelectLargeIndex: block: [52,0,0], thread: [64,0,0] "
    "Assertion `srcIndex < srcSelectDimSize` failed.",
    "/pytorch/aten/src/ATen/native/cuda/Indexing.cu:702: indexSelectSmallIndex: block: [0,0,0], thread: [3,0,0] "
    "Assertion `srcIndex < srcSelectDimSize` failed.",
    "IndexError: index out of range in self",
])
@pytest.mark.parametrize("site,named", [
    ('  File "/usr/local/lib/python3.10/dist-packages/torch/nn/modules/sparse.py", line 162, in forward\n'
     "    return F.embedding(\n", "an embedding"),
    ('  File "/usr/local/lib/python3.10/dist-packages/transformers/models/llama/modeling_llama.py", line 1049, in '
     "forward\n    inputs_embeds = self.embed_tokens(input_ids)\n", "an embedding"),
    ('  File "collate.py", line 12, in __call__\n    batch = self.table[ids]\n', "most often an embedding"),
])
def test_a_token_id_past_the_embedding_proposes_resizing_it(evidence, site, named):
    tail = "RuntimeError: CUDA error: device-side assert triggered\n" if "Assertion" in evidence else ""
    text = f"{evidence}\nTraceback (most recent call last):\n{site}{tail or evidence}\n"
    j = run(text)
    assert j["class"] == "token_past_embedding", j
    assert "resize_token_embeddings(len(tokenizer))" in first(j) and named in j["title"], j["title"]


# --- mechanisms after heldout41d (that set was used for them: see test_doctor_heldout41d.py) ------------------------

AUTO_FRAMES = {
    "config": '  File "/env/lib/python3.10/site-packages/transformers/models/auto/configuration_auto.py", line 1022, in '
              'from_pretrained\n    config_class = CONFIG_MAPPING[config_dict["model_type"]]\n'
              '  File "/env/lib/python3.10/site-packages/transformers/models/auto/configuration_auto.py", line 723, in '
              "__getitem__\n    raise KeyError(key)\n",
    "modeling": '  File "/env/lib/python3.9/site-packages/transformers/models/auto/modeling_auto.py", line 434, in '
                "from_pretrained\n    config, kwargs = AutoConfig.from_pretrained(\n"
                '  File "/env/lib/python3.9/site-packages/transformers/models/auto/configuration_auto.py", line 672, in '
                "__getitem__\n    raise KeyError(key)\n",
}


@pytest.mark.parametrize("frames", sorted(AUTO_FRAMES))
@pytest.mark.parametrize("kind,known", [("qwen2", True), ("gemma3", True), ("qwen3_moe", True),
                                        ("my_private_arch", False)])
def test_a_model_type_the_running_transformers_lacks_is_an_upgrade_or_the_models_own_code(frames, kind, known):
    text = f"Traceback (most recent call last):\n{AUTO_FRAMES[frames]}KeyError: '{kind}'\n"
    j = run(text)
    assert j["class"] == "unknown_architecture", j
    if known:
        assert "upgrade transformers" in j["proposal"]["step"], first(j)
    else:
        assert "trust_remote_code" in j["proposal"]["step"], first(j)


def test_the_architecture_message_of_newer_transformers_is_the_same_class():
    j = run("ValueError: The checkpoint you are trying to load has model type `qwen3` but Transformers does not "
            "recognize this architecture. This could be because of an issue with the checkpoint, or because your "
            "version of Transformers is out of date.\n")
    assert j["class"] == "unknown_architecture" and "upgrade transformers" in j["proposal"]["step"], j


def test_a_key_error_elsewhere_is_not_an_architecture():
    j = run('Traceback (most recent call last):\n  File "/env/lib/python3.10/site-packages/datasets/arrow_dataset.py", '
            'line 2810, in __getitem__\n    return self._getitem(key)\nKeyError: \'text\'\n')
    assert j["class"] != "unknown_architecture", j


@pytest.mark.parametrize("message,preset,sets,says", [
    ("RuntimeError: FlashAttention only support fp16 and bf16 data type", "7b_lora_1x4090", [], "torch_dtype=torch.bfloat16"),
    ("RuntimeError: FlashAttention only supports fp16 and bf16", "7b_8xa100", ["train.precision=fp32"],
     "train.precision=fp16"),
    ("ValueError: this kernel only works with bf16/fp16 inputs", "7b_8xa100", [], "torch_dtype=torch.bfloat16"),
])
def test_only_some_values_work_sets_one_of_them_or_loads_the_model_in_the_configs(message, preset, sets, says):
    from trainer.presets import with_overrides
    d = diagnose(resolve(load_preset(preset, sets)), message + "\n",
                 lambda extra: resolve(load_preset(preset, with_overrides(sets, extra))))
    j = diagnosis_json(d, None, None)
    assert says in first(j), first(j)


@pytest.mark.parametrize("message", [
    "ValueError: You can't train a model that has been loaded in 8-bit precision on multiple devices.",
    "ValueError: You can't train a model that has been loaded in 8-bit or 4-bit precision on a different device than "
    "the one you're training on. Make sure you loaded the model on the correct device using for example "
    "`device_map={'':torch.cuda.current_device()}`",
    "ValueError: Calling `.to()` is not supported for `4-bit` or `8-bit` bitsandbytes models. Please use the model as "
    "it is, since the model has already been set to the correct devices and casted to the correct `dtype`.",
])
def test_a_quantized_model_off_its_ranks_device_is_loaded_on_each_ranks_own(message):
    j = run(message + "\n")
    assert j["class"] == "quantized_placement" and 'device_map={"": ' in first(j), j


def test_a_prohibition_is_not_an_instruction():
    """"You can't X" forbids X; it does not ask for it (the instruction reader took it as one)."""
    from trainer.diagnose.classes.messages import INSTRUCTION
    assert not INSTRUCTION.search("You can't train this model on multiple devices")
    assert not INSTRUCTION.search("you cannot use offload here")
    assert INSTRUCTION.search("You can also set zero_force_ds_cpu_optimizer to false")


# --- tensors on two devices (after heldout41e, which was used for it) -----------------------------------------------

USER_FRAME = '  File "finetune.py", line 120, in train_step\n    logits = model(input_ids, attention_mask=mask)\n'
DS_FRAME = ('  File "/usr/local/lib/python3.10/dist-packages/deepspeed/runtime/zero/stage_1_and_2.py", line 1901, in '
            "step\n    self.unscale_and_clip_grads(single_partition_grad_groups, scaled_global_grad_norm)\n")


@pytest.mark.parametrize("wording", [
    "RuntimeError: Expected all tensors to be on the same device, but found at least two devices, {a} and {b}!",
    "RuntimeError: Expected all tensors to be on the same device, but got mat2 is on {a}, different from other "
    "tensors on {b} (when checking argument in method wrapper_CUDA_mm)",
])
@pytest.mark.parametrize("a,b,frame,launched,says", [
    ("cuda:0", "cuda:1", USER_FRAME, False, "CUDA_VISIBLE_DEVICES=0"),
    ("cuda:1", "cuda:3", USER_FRAME, True, 'device_map={"": local_rank}'),
    ("cuda:0", "cpu", DS_FRAME, False, "deepspeed=="),
    ("cpu", "cuda:0", USER_FRAME, False, "device=model.device"),
])
def test_the_two_devices_and_whose_code_decide_the_remedy(wording, a, b, frame, launched, says):
    launch = "[INFO] [launch.py:146:main] WORLD INFO DICT: {'localhost': [0, 1, 2, 3]}\n" if launched else ""
    text = f"{launch}Traceback (most recent call last):\n{frame}{wording.format(a=a, b=b)}\n"
    j = run(text)
    assert j["class"] == "two_devices", j
    assert says in first(j), first(j)
    if not launched and a.startswith("cuda") and b.startswith("cuda"):
        assert ["CUDA_VISIBLE_DEVICES", "0"] in [list(e) for e in j["proposal"]["env"]], j["proposal"]
