"""Issue 41's mechanisms after heldout41e (built from two of its misses, used since: see test_doctor_heldout41e.py),
each checked on cases drawn beyond those logs:

- a name one package takes from another that the other's release lacks (classes/names.py): which way round is
  read from the importing frame and from the installed package's own source, and the proposal upgrades that side;
- NCCL's "unhandled system error" across nodes with no InfiniBand in the log pins the socket interface first.
"""
from __future__ import annotations

import random

import pytest

from test_doctor_mechanisms41c import first
from trainer.diagnose.classes import names
from trainer.diagnose.doctor import diagnose, diagnosis_json
from trainer.presets import load_preset, with_overrides
from trainer.resolve import resolve

pytestmark = pytest.mark.quick

DRAW = random.Random(41_006)
PRESET = "7b_lora_1x4090"


def run(text: str) -> dict:
    """The doctor as the command runs it: against a preset, each proposed change resolved with it."""
    d = diagnose(resolve(load_preset(PRESET, [])), text, lambda extra: resolve(load_preset(PRESET, with_overrides([], extra))))
    return diagnosis_json(d, None, None)
IMPORTERS = ["trl", "peft", "accelerate", "llamafactory", "axolotl", "deepspeed"]


def traceback(importer: str, last: str, prefix: str = "") -> str:
    frames = [f'  File "/home/u/train.py", line 3, in <module>', "    import thing"]
    if importer:
        site = f"/opt/conda/lib/python3.10/site-packages/{importer}"
        frames += [f'  File "{site}/__init__.py", line 5, in <module>', "    from .core import x",
                   f'  File "{site}/core.py", line 25, in <module>', "    from y import z"]
    return "\n".join(prefix + line for line in ["Traceback (most recent call last):", *frames, last])


def missing(package: str, name: str, form: str) -> str:
    if form == "import":
        return f"ImportError: cannot import name '{name}' from '{package}' (/x/site-packages/{package}/__init__.py)"
    return f"AttributeError: module '{package}' has no attribute '{name}'"


# (package, a name its installed release defines) - the project's pins define these
HAS = [("transformers", "AutoModelForCausalLM"), ("transformers", "PreTrainedModel"), ("torch", "float8_e4m3fn"),
       ("peft", "LoraConfig"), ("datasets", "load_dataset"), ("deepspeed", "initialize")]
GONE = [("transformers", "top_k_p_filter_legacy"), ("peft", "prepare_model_for_int8_training_v0"),
        ("torch", "legacy_fused_softmax_kernel"), ("datasets", "load_metric_v1")]
ABSENT = ["bitsandbytes", "xformers", "auto_gptq", "vllm_flash"]


def drawn(cases, n):
    return [(*case, DRAW.choice(IMPORTERS + [""]), DRAW.choice(["import", "attribute"]),
             DRAW.choice(["", "[rank0]: "])) for case in DRAW.sample(cases, n)]


@pytest.mark.parametrize("package, name, importer, form, prefix", drawn(HAS, 5))
def test_a_name_the_installed_release_has_upgrades_the_package(package, name, importer, form, prefix):
    importer = "" if importer == package else importer
    j = run(traceback(importer, missing(package, name, form), prefix))
    assert j["class"] == "missing_name", j
    said = first(j).lower()
    assert f"upgrade {package}" in said and f"{package}==" in said, said
    if importer:
        assert importer in j["title"]


@pytest.mark.parametrize("package, name, importer, form, prefix", drawn(GONE, 4))
def test_a_name_the_installed_release_lacks_upgrades_the_importer_or_downgrades_the_package(package, name,
                                                                                           importer, form, prefix):
    importer = "" if importer == package else importer
    j = run(traceback(importer, missing(package, name, form), prefix))
    assert j["class"] == "missing_name", j
    said = first(j).lower()
    assert f"downgrade {package}" in said and "does not define" in said, said
    assert (f"pip install -u {importer}`" in said) if importer else "the traceback's last frame" in said


@pytest.mark.parametrize("package", ABSENT)
def test_a_package_not_installed_here_names_both_directions(package):
    importer = DRAW.choice(IMPORTERS)
    j = run(traceback(importer, missing(package, "nn", DRAW.choice(["import", "attribute"]))))
    said = first(j).lower()
    assert f"pip install -u {importer} {package}" in said and f"downgrade {package}" in said, said
    assert "not installed where the doctor runs" in said


@pytest.mark.parametrize("module, exists", [("transformers.models.llama.modeling_llama", True),
                                            ("transformers.deepspeed_legacy_utils", False),
                                            ("torch.distributed.fsdp", True)])
def test_a_missing_submodule_of_an_installed_package_is_read_from_its_files(module, exists):
    package, name = module.split(".", 1)
    assert names.installed_has(package, name, True)[1] is exists
    j = run(traceback("trl", f"ModuleNotFoundError: No module named '{module}'"))
    assert j["class"] == "missing_name"
    assert ("upgrade " + package) in first(j).lower() if exists else f"downgrade {package}" in first(j).lower()


@pytest.mark.parametrize("line", ["AttributeError: module 'os' has no attribute 'sched_getaffinity'",
                                  "ModuleNotFoundError: No module named 'flash_attn_2_cuda'",
                                  "AttributeError: 'NoneType' object has no attribute 'to'"])
def test_other_missing_names_are_not_this_class(line):
    assert run(traceback("", line))["class"] != "missing_name"


LAUNCHES = ["torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=node0 train.py",
            "deepspeed --num_nodes 2 --num_gpus 8 --hostfile hosts train.py",
            "accelerate launch --num_machines 2 --machine_rank 0 --num_processes 16 train.py"]
NCCL_ERRORS = ["RuntimeError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1191, unhandled "
               "system error, NCCL version 2.14.3",
               "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:219, "
               "unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.19.3\nncclSystemError: "
               "System call (e.g. socket, malloc) or external library call failed or device error."]


@pytest.mark.parametrize("launch", LAUNCHES[:2])
@pytest.mark.parametrize("error", NCCL_ERRORS)
def test_a_system_error_across_nodes_without_infiniband_pins_the_socket_interface(launch, error):
    said = first(run(f"{launch}\n{error}\n"))
    assert "NCCL_SOCKET_IFNAME" in said and "NCCL_DEBUG=INFO" in said, said
    assert said.index("NCCL_SOCKET_IFNAME") < said.index("NCCL_DEBUG=INFO")


def test_infiniband_in_the_log_keeps_the_infiniband_remedy():
    said = first(run(f"{LAUNCHES[0]}\nnode0:1:1 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/RoCE\n{NCCL_ERRORS[0]}\n"))
    assert "NCCL_IB_DISABLE=1" in said and "NCCL_SOCKET_IFNAME=<iface>" not in said, said


def test_an_unknown_number_of_nodes_still_asks_nccl_first():
    said = first(run(NCCL_ERRORS[0] + "\n"))
    assert said.startswith("rerun with NCCL_DEBUG=INFO"), said


FLASH = ["FlashAttention", "Flash Attention 2", "flash_attention_2", "FlashAttention-2", "Flash-Attention", "FLASH ATTENTION"]
REFUSALS = ["only supports Ampere GPUs or newer.", "is not available on CPU.", "is not supported on Turing GPUs",
            "requires a GPU with compute capability >= 8.0", "is currently not supported on this device"]


@pytest.mark.parametrize("spelling, refusal", [(DRAW.choice(FLASH), r) for r in REFUSALS])
def test_a_feature_a_message_refuses_is_read_by_the_name_libraries_write_it_in(spelling, refusal):
    j = run(f"RuntimeError: {spelling} {refusal}\n")
    assert j["proposal"]["overrides"] == ["model.attn_implementation=sdpa"], j["proposal"]


def test_an_on_off_feature_a_message_refuses_is_turned_off():
    j = run("RuntimeError: Liger kernels require a CUDA device\n")
    assert j["proposal"]["overrides"] == ["model.liger=false"], j["proposal"]


@pytest.mark.parametrize("line", ["ValueError: The model requires trust_remote_code=True to load",
                                  "RuntimeError: Training requires a GPU",
                                  "ValueError: The batch only supports padding on the right"])
def test_a_subject_that_is_no_setting_of_the_run_is_not_read_as_one(line):
    p = run(line + "\n")["proposal"] or {}
    assert not any(o.startswith(("model.", "train.precision")) for o in p.get("overrides", [])), p


@pytest.mark.parametrize("ids, via", [(",".join(map(str, sorted(DRAW.sample(range(8), k)))), via)
                                      for k, via in ((2, ""), (3, "accelerate launch --config_file ds.yaml train.py"),
                                                     (4, "deepspeed --num_gpus 4 train.py"))])
def test_devices_the_deepspeed_runner_ignored_are_named_with_its_include(ids, via):
    text = (f"{via}\n[2024-05-01 10:00:00,000] [INFO] [runner.py:463:main] Detected CUDA_VISIBLE_DEVICES={ids} but "
            f"ignoring it because one or several of --include/--exclude/--num_gpus/--num_nodes cl args were used. If "
            f"you want to use CUDA_VISIBLE_DEVICES don't pass any of these arguments to deepspeed.\n")
    j = run(text)
    assert j["class"] == "devices_ignored" and f"--include localhost:{ids}" in first(j), j
    assert ("upgrade accelerate" in " ".join(t["step"] for t in j["then"])) == via.startswith("accelerate")
