"""Issue 41's mechanisms after heldout41y and 41z (built from their misses once they were measured; see
test_doctor_heldout_round5.py), each checked on cases drawn beyond those logs:

- a broken invariant inside a library's own code (IndexError, a bare assert, an index past a tensor's end) or a
  programming error there is read against the installed release's source (trainer/diagnose/installed.py): the same
  line in the same function means upgrading to that release does not help (its patch, or the release before the
  defect); a changed line or a missing function means the installed release is the upgrade. Lines and functions
  are drawn from the installed DeepSpeed itself, so the cases are DeepSpeed's real code, not a list;
- a DeepSpeed script run from elsewhere (zero_to_fp32.py copied into a checkpoint, ds_to_universal.py) is
  DeepSpeed's, found by its file name and function; a traceback cut to its quoted line is found by its rarest name;
- a key one DeepSpeed section's model refuses that another section's model has was put in the wrong section: remove
  it there (no DeepSpeed release accepts it there), drawn over every pair of the installed DeepSpeed's sections;
- ZeRO's "Gradient computed twice for this partition", with and without activation checkpointing;
- DeepSpeed's runner's "No slot 'N' specified on host", from --include or from CUDA_VISIBLE_DEVICES;
- a device past the node's GPUs ("The requested device for vllm (cuda:1) is not available"), on one GPU and more.
"""
from __future__ import annotations

import random
import re

import pytest

from test_doctor_mechanisms41o import run
from trainer.diagnose import installed
from trainer.ds import learned

pytestmark = pytest.mark.quick

DRAW = random.Random(41_025)
SITE = "/opt/conda/lib/python3.10/site-packages"
COORDINATOR = "runtime/zero/partitioned_param_coordinator.py"


def deepspeed_lines(relative: str, count: int) -> list[tuple[str, int, str]]:
    """(function, line number, code) drawn from the installed DeepSpeed's `relative` file: lines of code (not
    comments, docstrings or blank) inside functions."""
    path = installed.root("deepspeed") / relative
    lines = path.read_text().split("\n")
    picks = []
    for name, spans in installed._functions(path).items():
        for first, last in spans:
            for n in range(first + 1, last + 1):
                code = lines[n - 1].strip()
                if len(code) > 20 and re.match(r"[a-z_][\w.\[\]]* ?(=|\()", code) and '"' not in code:
                    picks.append((name, n, code))
    return DRAW.sample(picks, count)


def traceback(frames: list[tuple[str, int, str, str]], last: str, prefix: str = "") -> str:
    out = ["Traceback (most recent call last):"]
    for file, line, function, code in frames:
        out += [f'  File "{file}", line {line}, in {function}', f"    {code}"]
    return "\n".join(f"{prefix}{line}" for line in [*out, last])


def user_frame() -> tuple[str, int, str, str]:
    return ("/home/me/train.py", DRAW.randrange(20, 400), "main", "engine.step()")


@pytest.mark.parametrize("relative, function, number, code",
                         [(file, *drawn) for file in (COORDINATOR, "runtime/zero/stage3.py")
                          for drawn in deepspeed_lines(file, 3)])
def test_an_invariant_broken_on_a_line_the_installed_deepspeed_still_runs_is_not_fixed_by_upgrading(relative, function,
                                                                                                    number, code):
    last = DRAW.choice(["IndexError: pop from an empty deque", "IndexError: list index out of range",
                        "AssertionError", "RuntimeError: start (4096) + length (512) exceeds dimension size (4096)."])
    j = run(traceback([user_frame(), (f"{SITE}/deepspeed/{relative}", number + DRAW.randrange(-30, 30), function,
                                      code)], last, DRAW.choice(["", "[rank0]: "])), overrides=(
        "deepspeed.zero_optimization.stage=3",))
    assert j["class"] == "library_bug", j
    assert "take deepspeed's fix" in j["proposal"]["step"] and "go back" in j["proposal"]["step"]
    assert f"still runs the same line in {function}" in j["proposal"]["reason"]
    assert "upgrade" not in j["proposal"]["step"]


@pytest.mark.parametrize("function, number, code", deepspeed_lines(COORDINATOR, 3))
def test_a_line_the_installed_deepspeed_changed_is_fixed_by_the_installed_release(function, number, code):
    names = [n for n in re.findall(r"[A-Za-z_]\w{3,}", code)]
    changed = code.replace(names[-1], names[-1] + "_v1", 1)  # an attribute renamed since the run's release
    j = run(traceback([user_frame(), (f"{SITE}/deepspeed/{COORDINATOR}", number, function, changed)],
                      "IndexError: pop from an empty deque"))
    assert j["class"] == "library_bug"
    assert j["proposal"]["step"].startswith(f"upgrade deepspeed to {installed.installed_version('deepspeed')}")
    assert "runs another line there" in j["proposal"]["reason"]
    assert any("go back to the release that last worked" in then["step"] for then in j["then"])


def test_a_function_the_installed_release_no_longer_has_is_an_upgrade():
    j = run(traceback([user_frame(), (f"{SITE}/deepspeed/{COORDINATOR}", 240, "record_parameters_v0",
                                      "step_id = self.__step_id_module_fetched_for[sub_module.id].popleft()")],
                      "IndexError: pop from an empty deque"))
    assert j["class"] == "library_bug" and "no longer has record_parameters_v0" in j["proposal"]["reason"]


@pytest.mark.parametrize("script", ["/data/ckpts/run7/zero_to_fp32.py", "./zero_to_fp32.py", "zero_to_fp32.py"])
def test_zero_to_fp32_copied_into_a_checkpoint_is_deepspeeds_script(script):
    ((function, number, code),) = deepspeed_lines("utils/zero_to_fp32.py", 1)
    j = run(traceback([(script, DRAW.randrange(600, 800), "<module>", "main(args)"), (script, number, function, code)],
                      "IndexError: list index out of range"))
    assert j["class"] == "library_bug" and "deepspeed" in j["title"]
    assert "utils/zero_to_fp32.py" in j["proposal"]["reason"] and function in j["proposal"]["reason"]


def test_a_traceback_cut_to_its_quoted_line_is_found_in_the_installed_source():
    ((function, number, code),) = deepspeed_lines(COORDINATOR, 1)
    text = "\n".join([f"[rank1]:     {code}", f"[rank1]:     {'^' * len(code)}", "[rank1]: IndexError: deque index out "
                      "of range"])
    j = run(text)
    assert j["class"] == "library_bug" and COORDINATOR in j["proposal"]["reason"] and function in j["title"]


@pytest.mark.parametrize("case", ["assert with words", "torch's own frame", "the user's script"])
def test_what_is_not_a_library_defect_is_not_read_as_one(case):
    ((function, number, code),) = deepspeed_lines(COORDINATOR, 1)
    frames = {"assert with words": [(f"{SITE}/deepspeed/{COORDINATOR}", number, function, code)],
              "torch's own frame": [(f"{SITE}/torch/nn/functional.py", 2500, "layer_norm", "return torch.layer_norm(")],
              "the user's script": [user_frame()]}[case]
    last = ("AssertionError: the module's parameters must be gathered before its forward" if case == "assert with words"
            else "IndexError: tuple index out of range")
    assert run(traceback(frames, last))["class"] != "library_bug"


def misplaced_pairs() -> list[tuple[str, str, str]]:
    """(section, its model, a key only other sections' models have), one drawn per section of the installed
    DeepSpeed."""
    facts = learned.facts()
    models = {path.rsplit(".", 1)[-1]: (block, set((facts["models"][path].get("fields") or {})))
              for block, path in facts["blocks"].items() if path in facts["models"]}
    pairs = []
    for model, (block, fields) in sorted(models.items()):
        foreign = sorted({f for other, (_, theirs) in models.items() if other != model for f in theirs} - fields)
        pairs.append((block, model, DRAW.choice(foreign)))
    return pairs


@pytest.mark.parametrize("section, model, key", misplaced_pairs())
def test_a_key_of_another_section_is_removed_from_the_section_that_refused_it(section, model, key):
    pydantic_v2 = DRAW.random() < 0.5
    message = (f"pydantic_core._pydantic_core.ValidationError: 1 validation error for {model}\n{key}\n  Extra inputs "
               f"are not permitted [type=extra_forbidden, input_value=100, input_type=int]" if pydantic_v2 else
               f"pydantic.error_wrappers.ValidationError: 1 validation error for {model}\n{key}\n  extra fields not "
               f"permitted (type=value_error.extra)")
    j = run(message)
    assert j["proposal"]["step"] == f"remove {key} from the {section} section of the DeepSpeed config", j
    assert "no upgrade fixes this" in j["proposal"]["reason"]


def test_a_key_of_the_refusing_model_itself_is_still_a_release_that_predates_it():
    j = run("pydantic.error_wrappers.ValidationError: 1 validation error for DeepSpeedBF16Config\n"
            "bf16_optimizer_states\n  extra fields not permitted (type=value_error.extra)")
    assert j["proposal"]["step"].startswith("upgrade DeepSpeed to a release that knows bf16_optimizer_states")


REDUCED = ("AssertionError: The parameter {n} has already been reduced.             Gradient computed twice for this "
           "partition.             Multiple gradient reduction is currently not supported")


@pytest.mark.parametrize("checkpointing", [True, False])
def test_a_gradient_reduced_twice_is_reentrant_checkpointing_or_a_backward_in_pieces(checkpointing):
    text = DRAW.choice(["", "[default3]:", "[rank1]: "]) + REDUCED.format(n=DRAW.randrange(1, 900))
    j = run(text, "7b_8xa100", (f"model.gradient_checkpointing={str(checkpointing).lower()}",
                                f"deepspeed.zero_optimization.stage={DRAW.choice([1, 2])}"))
    assert j["class"] == "reduced_twice"
    if checkpointing:
        assert j["proposal"]["step"].startswith("turn off gradient checkpointing")
        assert j["proposal"]["overrides"] == ["model.gradient_checkpointing=false"]
    else:
        assert "call the model once per step" in j["proposal"]["step"] and not j["proposal"]["overrides"]


def test_no_slot_from_cuda_visible_devices_names_the_gpus_with_include():
    ids = ",".join(str(i) for i in sorted(DRAW.sample(range(8), 2)))
    text = "\n".join([f"[2024-07-31 10:00:00,000] [INFO] [runner.py:463:main] Detected CUDA_VISIBLE_DEVICES={ids}: "
                      f"setting --include=localhost:{ids}", f"ValueError: No slot '{ids[-1]}' specified on host "
                      "'localhost'"])
    j = run(text)
    assert j["class"] == "no_slot" and f"--include localhost:{ids}" in j["proposal"]["step"]
    assert "unset CUDA_VISIBLE_DEVICES" in j["proposal"]["step"]


def test_no_slot_from_an_explicit_include_names_the_hosts_slots():
    text = "deepspeed --include worker-1:0,1,4 train.py --deepspeed ds.json\nValueError: No slot '4' specified on " \
           "host 'worker-1'"
    j = run(text, overrides=("hardware.nodes=2",))
    assert j["class"] == "no_slot" and j["proposal"]["step"].startswith("name only slots worker-1 has in --include")


@pytest.mark.parametrize("gpus, index", [(1, 1), (4, 4), (4, 2)])
def test_a_device_past_the_nodes_gpus(gpus, index):
    text = (f"ValueError: The requested device for vllm (cuda:{index}) is not available. You are likely using vLLM "
            "without restricting the number of GPUs for training. Set the `--num_processes` argument to a value lower "
            f"than the number of GPUs available on your machine. In your case: `--num_processes {gpus - 1}`.")
    j = run(text, "7b_grpo_8xh100", (f"hardware.gpus_per_node={gpus}",))
    assert j["class"] == "device_unavailable"
    step = j["proposal"]["step"]
    if index < gpus:
        assert step.startswith(f"make cuda:{index} visible")
    elif gpus == 1:
        assert 'vllm_device="cuda:0"' in step and "--num_processes 0" not in step
    else:
        assert f'vllm_device="cuda:{gpus - 1}"' in step and f"num_processes {gpus - 1}" in step


# --- after heldout41za and 41zb -----------------------------------------------------------------------------------

@pytest.mark.parametrize("quoted", ["`{}`", "  `{}`", "`{}"])
def test_an_exception_pasted_as_inline_code_is_read_like_any_other(quoted):
    n = DRAW.randrange(1, 900)
    plain = REDUCED.format(n=n)
    assert run(quoted.format(plain))["class"] == run(plain)["class"] == "reduced_twice"


def shared_message(names: list[str], newer: bool) -> str:
    found = "{" + ", ".join(f"'{n}'" for n in names) + "}"
    if newer:
        return (f"RuntimeError: The weights trying to be saved contained shared tensors [{found}] which are not "
                f"properly defined. We found all the potential target tied weights keys to be: ['lm_head.weight'].")
    return (f"RuntimeError: The weights trying to be saved contained shared tensors [{found}] that are mismatching the "
            f"transformers base configuration. Try saving using `safe_serialization=False` or remove this tensor sharing.")


@pytest.mark.parametrize("newer", [False, True])
def test_transformers_refusing_undeclared_sharing_removes_the_sharing_first(newer):
    names = DRAW.sample(["model.vision_tower.embed.weight", "model.embed_tokens.weight", "score.weight",
                         "model.mm_projector.0.weight", "lm_head.weight"], 2)
    j = run(shared_message(names, newer))
    assert j["class"] == "shared_tensors" and j["proposal"]["step"].startswith("remove the shared tensor")
    assert all(n in j["proposal"]["step"] for n in names)
    assert "safe_serialization=False" in j["then"][0]["step"]


def test_safetensors_own_refusal_still_saves_without_it():
    j = run("RuntimeError: Some tensors share memory, this will lead to duplicate memory on disk and potential "
            "differences when loading them again: [{'lm_head.weight', 'model.embed_tokens.weight'}].")
    assert j["class"] == "shared_tensors" and "safe_serialization=False" in j["proposal"]["step"]


@pytest.mark.parametrize("patcher", ["liger-kernel", "Liger", "unsloth", None])
def test_a_keyword_a_patched_forward_lacks_upgrades_the_patching_package(patcher):
    kwarg = DRAW.choice(["mm_token_type_ids", "cache_position", "logits_to_keep", "pixel_attention_mask"])
    version = f"{DRAW.randrange(4, 6)}.{DRAW.randrange(0, 60)}.{DRAW.randrange(0, 3)}"
    lines = [f"transformers version: {version}"]
    if patcher:
        lines.append(f"Applying {patcher} patches to the model")
    lines.append(f"ValueError: The following `model_kwargs` are not used by the model: ['{kwarg}'] (note: typos in "
                 f"the generate arguments will also show up in this list)")
    j = run("\n".join(lines))
    assert j["class"] == "signature" and kwarg in j["title"] and version in j["title"]
    step = j["proposal"]["step"]
    if patcher is None:
        assert step.startswith("update the model's own code")
    else:
        expected = "liger-kernel" if patcher.lower().startswith("liger") else patcher
        assert step.startswith(f"upgrade {expected}") and version in step


@pytest.mark.parametrize("output", ["../pytorch_model.bin", "out/model.bin", "fp32.pt"])
def test_zero_to_fp32_told_a_file_is_read_against_its_installed_arguments(output):
    source = DRAW.choice([".", "checkpoints/global_step500", "/data/run/ckpt"])
    text = f"$ python zero_to_fp32.py {source} {output}\nRuntimeError: Parent directory {output} does not exist."
    j = run(text)
    assert j["class"] == "parent_missing" and "zero_to_fp32.py's output_dir" in j["proposal"]["step"]
    folder = output.rsplit("/", 1)[0] + "/" if "/" in output else "."
    assert j["proposal"]["step"].endswith(f"`zero_to_fp32.py {source} {folder}`")
    assert f"deepspeed {installed.installed_version('deepspeed')}" in j["proposal"]["reason"]


def test_a_missing_parent_of_anything_else_is_the_directory_to_create():
    j = run("RuntimeError: Parent directory /scratch/me/run3/ckpt does not exist.")
    assert j["class"] == "parent_missing" and j["proposal"]["step"].startswith("create the directory /scratch/me")
