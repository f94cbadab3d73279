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


# --- after heldout41f (used to build what follows: see test_doctor_heldout41f.py) ------------------------------

EXTENSIONS = [("flash_attn", "flash_attn_2_cuda", "flash-attn"), ("xformers", "_C", "xformers"),
              ("apex", "fused_layer_norm_cuda", "apex"), ("causal_conv1d", "causal_conv1d_cuda", "causal-conv1d")]
SYMBOLS = {"_ZN3c104cuda9SetDeviceEi": "torch", "_ZNK2at6Tensor7is_cudaEv": "torch",
           "_ZN5torch3jit17parseSchemaOrNameERKSs": "torch", "_ZN4absl12lts_202301255MutexD1Ev": ""}


@pytest.mark.parametrize("package, library, pip_name", EXTENSIONS)
def test_an_extension_built_against_another_torch_is_rebuilt_against_this_one(package, library, pip_name):
    symbol = DRAW.choice(list(SYMBOLS))
    site = f"/opt/conda/lib/python3.10/site-packages"
    text = "\n".join(["Traceback (most recent call last):",
                      f'  File "{site}/{package}/interface.py", line 10, in <module>',
                      f"    import {library}",
                      f"ImportError: {site}/{library}.cpython-310-x86_64-linux-gnu.so: undefined symbol: {symbol}"])
    j = run(text)
    assert j["class"] == "extension_abi", j
    said = first(j)
    assert f"pip uninstall -y {pip_name}" in said and f"pip install {pip_name}" in said, said
    assert (f"installed {SYMBOLS[symbol]}" in said) if SYMBOLS[symbol] else "installed libraries" in said


def test_the_mangled_namespace_is_read_from_the_symbol():
    from trainer.diagnose.classes import binaries
    assert [binaries.mangled_namespace(s) for s in SYMBOLS] == ["c10", "at", "torch", "absl"]
    assert binaries.mangled_namespace("cudaSetDevice") == ""


@pytest.mark.parametrize("line", ["RuntimeError: CUDA error: invalid device ordinal",
                                  "torch.cuda.DeferredCudaCallError: CUDA call failed lazily at initialization with "
                                  "error: device >= 0 && device < num_gpus INTERNAL ASSERT FAILED; invalid device ordinal",
                                  "runtimeerror: cuda error: invalid device ordinal"])
def test_an_invalid_device_ordinal_starts_as_many_ranks_as_gpus(line):
    j = run(f"torchrun --nproc_per_node={DRAW.choice([2, 4, 8])} train.py\n{line}\n")
    assert j["class"] == "invalid_device_ordinal" and "--nproc_per_node" in first(j), j


@pytest.mark.parametrize("field, holder, steps", [("input_ids_j", "feature", 125), ("labels", "batch", 0),
                                                  ("chosen_input_ids", "example", 40), ("pixel_values", "examples", 0)])
def test_a_sample_without_a_field_the_code_reads_is_preprocessed_like_the_training_data(field, holder, steps):
    progress = f" 11%|████      | {steps}/1125 [1:04:25<8:30:35, 30.64s/it]\n" if steps else ""
    text = (f"{progress}Traceback (most recent call last):\n  File \"/home/u/collate.py\", line 40, in __call__\n"
            f"    \"input_ids\": {holder}[\"{field}\"],\nKeyError: '{field}'\n")
    j = run(text)
    assert j["class"] == "missing_field", j
    said = first(j)
    assert f"'{field}'" in said
    assert ("eval dataset" in said and f"for {steps} steps" in said) if steps else "map the dataset" in said


def test_a_key_error_on_a_name_the_code_does_not_read_from_a_sample_is_not_a_missing_field():
    text = "Traceback (most recent call last):\n  File \"/x/train.py\", line 3, in f\n    cfg = CONFIGS[name]\nKeyError: 'llama'\n"
    assert run(text)["class"] != "missing_field"


INIT_TAILS = [["[INFO] [comm.py:637:init_distributed] cdb=None",
               "[INFO] [comm.py:668:init_distributed] Initializing TorchBackend in DeepSpeed with backend nccl"],
              ["INFO:torch.distributed.distributed_c10d:Added key: store_based_barrier_key:1 to store for rank: 0"],
              ["[W socket.cpp:663] [c10d] The client socket cannot be initialized", "Distributed environment: DEEPSPEED  "
               "Backend: nccl"]]


@pytest.mark.parametrize("tail", INIT_TAILS[:2])
def test_a_log_that_stops_at_the_process_groups_start_fixes_the_rendezvous_port(tail):
    j = run("\n".join(["Loading checkpoint shards: 100%", *tail]) + "\n")
    assert j["class"] == "stopped_at_init", j
    assert "main_process_port" in first(j) and "--master_port" in first(j)


def test_a_log_that_goes_on_past_the_start_is_no_init_hang():
    assert run("\n".join([*INIT_TAILS[0], "step 10 loss 2.31"]) + "\n")["class"] != "stopped_at_init"


@pytest.mark.parametrize("package, error", [("bitsandbytes", "AttributeError: 'NoneType' object has no attribute 'to'"),
                                            ("peft", "TypeError: forward() got multiple values for argument 'x'"),
                                            ("accelerate", "NameError: name 'is_torch_xla_available' is not defined")])
def test_a_programming_error_inside_a_library_upgrades_that_library(package, error):
    form = DRAW.choice(["File ", "error : "])
    text = (f"Traceback (most recent call last):\n  {form}\"/env/lib/python3.10/site-packages/{package}/nn/modules.py\", "
            f"line 254, in _load\n    self.bias.data = bias_data.to(self.bias.data.device)\n{error}\n")
    j = run(text)
    assert j["class"] == "library_bug" and f"pip install -U {package}" in first(j), j


def test_the_same_error_in_the_users_own_code_is_no_library_bug():
    text = "Traceback (most recent call last):\n  File \"/home/u/train.py\", line 9, in main\n    x.to(dev)\nAttributeError: 'NoneType' object has no attribute 'to'\n"
    assert run(text)["class"] != "library_bug"


@pytest.mark.parametrize("message, override", [
    ("ValueError: ZeRO inference only makes sense with ZeRO Stage 3 - please adjust your config",
     "deepspeed.zero_optimization.stage=3"),
    ("AssertionError: this feature only works with zero stage 2 - adjust the config", "deepspeed.zero_optimization.stage=2"),
    ("ValueError: offload only makes sense with ZeRO stage: 3", "deepspeed.zero_optimization.stage=3")])
def test_a_setting_a_message_requires_is_set(message, override):
    j = run(message + "\n")
    assert override in j["proposal"]["overrides"], j["proposal"]


@pytest.mark.parametrize("model, targets", [("THUDM/chatglm3-6b", "query_key_value"), ("tiiuae/falcon-7b", "query_key_value"),
                                            ("bigscience/bloom-560m", "query_key_value"), ("gpt2-medium", "c_attn")])
def test_lora_targets_a_model_does_not_have_are_replaced_by_peft_defaults_for_its_family(model, targets):
    text = (f"python train.py --model_name_or_path {model} --lora_target q_proj,v_proj\nValueError: Target modules "
            f"{{'v_proj', 'q_proj'}} not found in the base model. Please check the target modules and try again.\n")
    said = first(run(text))
    assert targets in said and "peft.utils.constants" in said, said


# --- after heldout41g (used to build what follows: see test_doctor_heldout41g.py) ------------------------------

@pytest.mark.parametrize("cut", [0, 3, 9, 14])
def test_an_import_error_cut_by_the_paste_is_read_from_the_import_line_it_quotes(cut):
    """torch renamed elastic's `log` to `logger`: the module the message names is read in the installed torch's
    own file (not anywhere in torch, where a `log` exists), wherever the paste cut the message."""
    module = "torch.distributed.elastic.agent.server.api"
    message = f"ImportError: cannot import name 'log' from '{module}' (/x/api.py)"
    text = "\n".join(["Traceback (most recent call last):",
                      '  File "/env/lib/python3.11/site-packages/deepspeed/elasticity/elastic_agent.py", line 9, in <module>',
                      f"    from {module} import log, _get_socket_with_port",
                      message[:len(message) - 30 - cut] if cut else message])
    j = run(text)
    assert j["class"] in ("missing_name", "version"), j
    said = first(j).lower()
    assert "upgrade deepspeed" in said or "deepspeed>=" in said, said


@pytest.mark.parametrize("model, field, message, override", [
    ("DeepSpeedZeroConfig", "stage3_prefetch_bucket_size",
     "Input should be a valid integer, got a number with a fractional part [type=int_from_float, input_value="
     "15099494.4, input_type=float]", "deepspeed.zero_optimization.stage3_prefetch_bucket_size=15099494"),
    ("DeepSpeedZeroConfig", "reduce_bucket_size",
     "Input should be a valid integer, got a number with a fractional part [type=int_from_float, input_value=500000000.5, "
     "input_type=float]", "deepspeed.zero_optimization.reduce_bucket_size=500000000"),
    ("DeepSpeedZeroConfig", "overlap_comm",
     "Input should be a valid boolean, unable to interpret input [type=bool_parsing, input_value='yes please', "
     "input_type=str]", None)])
def test_a_deepspeed_key_given_a_value_of_the_wrong_type_gets_one_of_the_right_type(model, field, message, override):
    prefix = DRAW.choice(["", "[rank2]: "])
    text = "\n".join(prefix + line for line in [f"pydantic_core._pydantic_core.ValidationError: 1 validation error for "
                                                f"{model}", field, f"  {message}",
                                                "    For further information visit https://errors.pydantic.dev/2.9/v/x"])
    p = run(text + "\n")["proposal"]
    assert field in p["step"], p
    assert (override in p["overrides"]) if override else p["overrides"] == [], p


@pytest.mark.parametrize("failure", ["TypeError: '>' not supported between instances of 'str' and 'int'",
                                     "ValueError: invalid literal for int() with base 10: 'auto'",
                                     "the 'auto' values are no longer interpolated and DeepSpeed fails"])
def test_auto_values_that_reached_deepspeed_unfilled_are_replaced_by_numbers(failure):
    config = '{"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": 3}}'
    j = run(f"{config}\n{failure}\n")
    assert j["class"] == "unfilled_auto" and "replace the \"auto\" values" in first(j), j
    assert "train_micro_batch_size_per_gpu" in first(j)


def test_a_string_comparison_without_auto_in_a_config_is_not_an_unfilled_auto():
    assert run("TypeError: '>' not supported between instances of 'str' and 'int'\n")["class"] != "unfilled_auto"


@pytest.mark.parametrize("version, old", [("1.1.0", True), ("1.13.1", True), ("2.1.0", False)])
def test_an_nccl_system_error_under_torch_1_upgrades_torch_first(version, old):
    text = (f"PyTorch version: {version}\ntorchrun --nnodes 2 --nproc_per_node 8 train.py\nRuntimeError: NCCL error in: "
            f"ProcessGroupNCCL.cpp:272, unhandled system error\n")
    said = first(run(text))
    assert said.startswith("upgrade torch") == old, said


# --- after heldout41h (used to build what follows: see test_doctor_heldout41h.py) ------------------------------

@pytest.mark.parametrize("package, method, args", [("transformers", "log", "logs, start_time"),
                                                   ("transformers", "compute_loss", "model, inputs, return_outputs=False, num_items_in_batch=None"),
                                                   ("trl", "training_step", "model, inputs, num_items_in_batch")])
def test_a_library_calling_an_outdated_override_gets_the_override_the_new_arguments(package, method, args):
    prefix = DRAW.choice(["", "[rank6]: "])
    lines = ["Traceback (most recent call last):", '  File "/home/u/sft/train.py", line 239, in train',
             "    trainer.train()", f'  File "/env/lib/python3.10/site-packages/{package}/trainer.py", line 3045, in x',
             f"    self.{method}({args})",
             DRAW.choice([f"TypeError: {method}() takes 2 positional arguments but 3 were given",
                          f"TypeError: CustomTrainer.{method}() takes 3 positional arguments but 4 were given"])]
    j = run("\n".join(prefix + line for line in lines) + "\n")
    assert j["class"] == "signature", j
    said = first(j)
    assert f"self.{method}({args})" in said and f"pin {package}" in said, said


@pytest.mark.parametrize("line, callee", [
    ("DPOTrainer.get_batch_logps() got an unexpected keyword argument 'average_log_prob'", "trl"),
    ("TypeError: LoraConfig.__init__() got an unexpected keyword argument 'use_dora_v9'", "peft"),
    ("TypeError: Trainer.__init__() got an unexpected keyword argument 'tokenizer_v0'", "transformers")])
def test_a_library_call_its_release_refuses_matches_the_two_versions(line, callee):
    j = run(line + "\n")
    assert j["class"] == "signature", j
    assert f"downgrade {callee}" in first(j) and "upgrade" in first(j), first(j)


def test_an_unexpected_deepspeed_key_stays_a_config_statement():
    assert run("TypeError: DeepSpeedZeroConfig() got an unexpected keyword argument 'stage3_prefetch_bucket_size'\n"
               )["class"] != "signature"


@pytest.mark.parametrize("hosts, named", [(("node-a", "node-b"), "enp6s0"), (("gpu01", "gpu02"), "eth0"),
                                          (("fengyun", "fengyun416"), "ens1f0")])
def test_one_interface_name_for_nodes_that_name_it_differently_is_a_comma_list(hosts, named):
    table = "\n".join(f"#  Rank  {i} Group  0 Pid {1000 + i} on {h} device  0 [0x01] NVIDIA A100"
                      for i, h in enumerate(hosts))
    text = (f"mpirun -np 2 -pernode -hostfile hosts -x NCCL_SOCKET_IFNAME={named} ./all_reduce_perf -g 1\n{table}\n"
            f"{hosts[1]}: Test NCCL failure common.cu:959 'internal error - please report this issue to the NCCL developers'\n")
    said = first(run(text))
    assert f"NCCL_SOCKET_IFNAME={named}," in said and "comma list" in said, said


@pytest.mark.parametrize("lora", [True, False])
def test_fp16_gradients_the_scaler_refuses_keep_the_trainable_weights_in_fp32(lora):
    text = ("model = get_peft_model(model, LoraConfig(r=8))\n" if lora else "") + \
        "  File \"/env/site-packages/torch/cuda/amp/grad_scaler.py\", line 212, in _unscale_grads_\n" \
        "ValueError: Attempting to unscale FP16 gradients.\n"
    j = run(text)
    assert j["class"] == "fp16_trainable" and "float32" in first(j), j
    assert ("PEFT release" in first(j)) == lora


@pytest.mark.parametrize("framework", ["axolotl", "llamafactory"])
def test_weights_loaded_into_zero3_placeholders_by_a_framework_go_to_stage_2_when_it_fits(framework):
    text = (f'Traceback (most recent call last):\n  File "/workspace/{framework}/src/{framework}/cli/train.py", line 59, '
            f'in <module>\n    fire.Fire(do_cli)\nValueError: Trying to set a tensor of shape torch.Size([32000, 4096]) '
            f'in "weight" (which has shape torch.Size([0])), this look incorrect.\n')
    j = run(text)
    assert j["class"] == "zero3_load" and j["proposal"]["overrides"] == ["deepspeed.zero_optimization.stage=2"], j
    assert "planner" in j["proposal"]["reason"]


def test_the_same_placeholders_in_the_users_own_script_load_under_zero_init():
    text = ('Traceback (most recent call last):\n  File "/home/u/train.py", line 9, in <module>\n    model.load_state_dict(sd)\n'
            'RuntimeError: size mismatch for weight: copying a param with shape torch.Size([32000, 4096]) from checkpoint, '
            'the shape in current model is torch.Size([0]).\n')
    assert "zero.Init" in first(run(text))


@pytest.mark.parametrize("option", ["--use_unsloth true", "--quantization_bit 4", "load_in_4bit: true"])
def test_an_option_that_loads_with_its_own_device_map_is_named_under_zero3(option):
    text = (f"deepspeed --num_gpus 4 src/train.py --deepspeed ds_z3.json {option} --lora_rank 8\n"
            "ValueError: DeepSpeed Zero-3 is not compatible with `low_cpu_mem_usage=True` or with passing a `device_map`.\n")
    said = first(run(text))
    assert said.startswith(f"drop --{option.split()[0].lstrip('-').rstrip(':')}"), said
