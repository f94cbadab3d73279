"""Issue 41's mechanisms after heldout41o (built from its misses once it was measured; see
test_doctor_heldout_round5.py), each checked on cases drawn beyond those logs:

- an InfiniBand completion error is read by its number, libibverbs' work-completion status: a protection or access
  error is the adapter failing to reach the buffer (GPUDirect RDMA across PCIe ACS/IOMMU), a retry-exceeded one is
  the path between the ports (the RoCE GID, then links and the timeout); a flushed request is the consequence of
  an earlier error, never the cause;
- an error right after NCCL began building a communicator, with no exception that says more, is its transports
  failing: on one node P2P (turned off for the test where the GPUs only have PCIe), across nodes the network;
- an fp16 loss-scale collapse against a preset that trains in bf16 or fp32 proposes the preset's own precision (the
  log's run was fp16, whatever the preset says);
- a host named after its GPUs ("H100-2:19989:20082", NCCL's host:pid:tid prefix) is not read as the GPU.
"""
from __future__ import annotations

import random

import pytest

from trainer.diagnose.doctor import diagnose, diagnosis_json
from trainer.diagnose.logfacts import read_facts
from trainer.diagnose.logtext import Log
from trainer.presets import load_preset, with_overrides
from trainer.resolve import resolve

pytestmark = pytest.mark.quick

DRAW = random.Random(41_015)


def run(text: str, preset: str = "7b_8xa100", overrides: tuple = ()) -> dict:
    given = list(overrides)
    d = diagnose(resolve(load_preset(preset, given)), text,
                 lambda extra: resolve(load_preset(preset, with_overrides(given, extra))))
    return diagnosis_json(d, None, None)


def env_of(proposal: dict) -> dict:
    return dict(proposal.get("env") or [])


def completion(code: int, host: str = "node-1") -> str:
    peer = DRAW.choice(["", f"from peer fe80::{DRAW.randrange(1 << 16):x}%ib0<{DRAW.randrange(1, 65535)}> "])
    return (f"{host}:{DRAW.randrange(100, 99999)}:{DRAW.randrange(100, 99999)} [{DRAW.randrange(8)}] "
            f"transport/net_ib.cc:{DRAW.randrange(800, 1400)} NCCL WARN NET/IB : Got completion {peer}with error "
            f"{code}, opcode {DRAW.randrange(1, 40000)}, len {DRAW.randrange(40000)}, vendor err {DRAW.randrange(256)}")


def ib_log(codes: list[int], exports: str = "") -> str:
    lines = [f"mpirun -np 16 {exports} ./train.sh".replace("  ", " ")] if exports else []
    for code in codes:
        lines += [completion(code), "NCCL INFO transport/net.cc:1008 -> 6", "NCCL INFO proxy.cc:679 -> 6"]
    return "\n".join(lines + ["RuntimeError: NCCL communicator was aborted on rank 3."])


@pytest.mark.parametrize("code", [4, 8, 10])
def test_an_access_error_of_the_adapter_is_gpudirect_rdma_across_acs(code):
    j = run(ib_log([code] * DRAW.randint(1, 4)), overrides=("hardware.nodes=2",))
    assert j["class"] == "nccl_network" and f"error {code}" in j["title"]
    assert "disable PCIe ACS" in j["proposal"]["step"] and env_of(j["proposal"])["NCCL_NET_GDR_LEVEL"] == "LOC"


@pytest.mark.parametrize("code", [12, 13, 20])
def test_a_transfer_never_acknowledged_is_the_path_the_roce_gid_first(code):
    j = run(ib_log([code]), overrides=("hardware.nodes=2",))
    assert env_of(j["proposal"])["NCCL_IB_GID_INDEX"] == "3"
    assert j["then"] and env_of(j["then"][0])["NCCL_IB_TIMEOUT"] == "22"


def test_a_gid_index_the_run_already_exported_is_not_proposed_again():
    j = run(ib_log([12], exports="-x NCCL_IB_GID_INDEX=5 -x NCCL_DEBUG=INFO"), overrides=("hardware.nodes=2",))
    assert "NCCL_IB_GID_INDEX" not in env_of(j["proposal"]) and "ibstat" in j["proposal"]["step"]
    assert any("already set NCCL_IB_GID_INDEX=5" in a for a in j["advice"])


def test_a_flushed_request_is_read_past_to_the_error_that_caused_it():
    for _ in range(10):
        cause = DRAW.choice([4, 12])
        codes = [5] * DRAW.randint(1, 5)
        codes.insert(DRAW.randrange(len(codes) + 1), cause)
        j = run(ib_log(codes), overrides=("hardware.nodes=2",))
        assert f"error {cause}" in j["title"], codes
    only_flushed = run(ib_log([5, 5]), overrides=("hardware.nodes=2",))
    assert any("WR_FLUSH_ERR" in a for a in only_flushed["advice"])


SETUP_LINES = ["INFO 08-14 12:08:39 [pynccl.py:70] vLLM is using nccl==2.26.2",
               "verifiers.inference.vllm_client - INFO - Initializing PyNcclCommunicator on device 0, rank 1",
               "node1:2211:2211 [0] NCCL INFO NCCL version 2.21.5+cuda12.4",
               "node1:2211:2290 [0] NCCL INFO comm 0x55d0c2a0 rank 0 nranks 4 cudaDev 0 nvmlDev 0 busId 1000 - Init START",
               "[rank0]: torch.distributed.init_process_group(backend='nccl')"]
ERRORS = ["ERROR 08-14 12:08:39 [core.py:654] Invocation of collective_rpc method failed",
          "ERROR 08-14 12:08:39 [core.py:654] Traceback (most recent call last):",
          "[rank1] worker failed"]


HOSTLESS = [line for line in SETUP_LINES if "node1:" not in line]  # lines that do not show the host they ran on


def setup_log(noise: int = 0, setup: list = SETUP_LINES) -> str:
    lines = [f"step {i}: waiting" for i in range(DRAW.randint(0, 3))]
    lines += DRAW.sample(setup, DRAW.randint(1, 3)) + [f"INFO note {i}" for i in range(noise)]
    return "\n".join(lines + DRAW.sample(ERRORS, DRAW.randint(1, 2)) + ["Traceback (most recent call last):"])


def test_an_error_right_after_a_communicators_setup_on_pcie_gpus_turns_p2p_off_for_the_test():
    for _ in range(8):
        j = run(setup_log(DRAW.randint(0, 5)), "7b_grpo_8xh100", ("hardware.gpu=l4", "hardware.gpus_per_node=4"))
        assert j["class"] == "nccl_network" and "communicator" in j["title"]
        assert env_of(j["proposal"])["NCCL_P2P_DISABLE"] == "1"
    hostless = run(setup_log(setup=HOSTLESS), "7b_grpo_8xh100", ("hardware.gpu=l4", "hardware.gpus_per_node=4"))
    assert any("does not say how many nodes" in a for a in hostless["advice"])  # one node: the preset's count


def test_on_nvlink_gpus_the_same_log_asks_for_the_transport_first_and_across_nodes_the_network():
    nvlink = run(setup_log())
    assert "NCCL_P2P_DISABLE" not in env_of(nvlink["proposal"]) and "NCCL_DEBUG" in env_of(nvlink["proposal"])
    assert "NCCL_P2P_DISABLE=1" in nvlink["proposal"]["step"]
    nodes = run(setup_log(setup=HOSTLESS), overrides=("hardware.nodes=2",))
    assert nodes["class"] == "nccl_network" and "P2P" not in nodes["proposal"]["step"]
    one_host = run("\n".join(SETUP_LINES[2:4] + ERRORS[:1]), overrides=("hardware.nodes=2",))
    assert "P2P" in one_host["proposal"]["step"]  # the log's one NCCL host outweighs the preset's two nodes


def test_a_communicator_line_is_not_the_cause_when_the_exception_says_more_or_the_error_comes_later():
    stated = setup_log() + "\nValueError: Unrecognized configuration class <class 'Foo'> for this kind of AutoModel"
    assert run(stated)["class"] != "nccl_network"
    late = "\n".join([SETUP_LINES[0]] + [f"{{'loss': 2.{i}, 'step': {i}}}" for i in range(12)] + [ERRORS[0]])
    assert run(late)["class"] != "nccl_network"


def test_an_fp16_collapse_against_an_fp32_preset_proposes_fp32_as_the_preset_trains():
    j = run("Exception: Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.",
            "7b_8xa100", ("train.precision=fp32", "deepspeed.bf16=null"))
    assert j["class"] == "fp16_loss_scale" and j["proposal"]["step"].startswith("train in fp32")
    assert j["proposal"]["overrides"] == []


@pytest.mark.parametrize("host", ["H100-2", "a100-node3", "V100x-07", "node-h200"])
def test_a_host_named_after_its_gpus_is_not_the_gpu(host):
    facts = read_facts(Log.of(completion(4, host)))
    assert facts.gpu is None
    assert read_facts(Log.of(f"{completion(4, host)}\nGPU 0: NVIDIA A100-SXM4-80GB")).gpu == "NVIDIA A100-SXM4-80GB"


# --- built from heldout41k/02 (a used set): the compiler's error read for the file it was compiling ----------

TORCH_HEADERS = ["c10/util/string_view.h", "ATen/core/TensorBase.h", "torch/csrc/api/include/torch/nn.h",
                 "c10/cuda/CUDAStream.h", "pybind11/cast.h"]


def compiler_error(header: str, nvcc: bool) -> str:
    site = f"/home/u/env/lib/python3.10/site-packages/torch/include/{header}"
    at = f"{site}({DRAW.randrange(10, 900)}): error" if nvcc else f"{site}:{DRAW.randrange(10, 900)}:{DRAW.randrange(1, 80)}: error"
    return "\n".join(["  Building wheel for deepspeed (setup.py) ... error" if DRAW.random() < 0.5 else
                      "Emitting ninja build file /root/.cache/torch_extensions/py310_cu121/cpu_adam/build.ninja...",
                      f"      {at}: 'std_string_type' was not declared in this scope",
                      "      error: command '/usr/bin/gcc' failed with exit code 1"])


@pytest.mark.parametrize("header", TORCH_HEADERS)
def test_a_compiler_error_inside_torchs_headers_is_the_toolchain_not_the_op(header):
    j = run(compiler_error(header, DRAW.random() < 0.5))
    assert j["class"] == "op_build" and "inside torch's own headers" in j["title"]
    assert "nvcc --version" in j["proposal"]["step"] and "torch.version.cuda" in j["proposal"]["step"]


def test_with_both_cuda_versions_in_the_log_the_toolkit_torch_was_built_with_is_named():
    text = "nvcc version ..................... 12.1\ntorch cuda version ............... 11.8\n" + compiler_error(
        TORCH_HEADERS[0], nvcc=False)
    j = run(text)
    assert "use the CUDA 11.8 toolkit" in j["proposal"]["step"] and "nvcc 12.1" in j["proposal"]["step"]


def test_an_error_in_the_ops_own_source_or_a_missing_header_is_not_read_as_torchs():
    own = compiler_error(TORCH_HEADERS[0], False).replace("/site-packages/torch/include/c10/util/string_view.h",
                                                           "/site-packages/deepspeed/ops/csrc/adam/cpu_adam.cpp")
    assert "torch's own headers" not in run(own)["title"]
    missing = compiler_error(TORCH_HEADERS[0], False) + "\nfatal error: Python.h: No such file or directory"
    assert "Python.h" in run(missing)["title"]


# --- built from heldout41r (after it was measured; see test_doctor_heldout_round5.py) ----------------------------

@pytest.mark.parametrize("library, module, name", [
    ("deepspeed", "torch.distributed.elastic.agent.server.api", "log"),
    ("peft", "transformers.utils", "is_torch_tpu_available"),
    ("trl", "transformers.integrations", "is_deepspeed_zero3_enabled"),
])
def test_a_missing_name_retold_without_its_module_is_read_from_the_import_statement_the_log_quotes(library, module,
                                                                                                    name):
    text = "\n".join([f"The `ImportError: cannot import name '{name}'` error originates from the {library} library.",
                      f"The import statement `from {module} import {name}, other` is failing because {name} cannot "
                      f"be found in the specified module.", "", "Traceback (most recent call last):",
                      '  File "/usr/lib/python3.10/importlib/__init__.py", line 126, in import_module',
                      "    return _bootstrap._gcd_import(name[level:], package, level)"])
    j = run(text)
    assert j["class"] == "missing_name" and f"which {library} imports" in j["title"], j["title"]
    assert module.split(".")[0] in j["proposal"]["step"] and module.split(".")[0] in j["title"]


def test_without_an_import_statement_a_bare_missing_name_is_not_guessed():
    assert run("ImportError: cannot import name 'log'")["class"] != "missing_name"


@pytest.mark.parametrize("ask, command", [
    ("Please run the following command to get more information:", "python -m bitsandbytes"),
    ("Please run this to see what is missing:", "ds_report"),
    ("You can run the following for more details:", "python -m torch.utils.collect_env"),
])
def test_an_instruction_that_only_shows_more_is_a_look_with_its_command_not_a_remedy(ask, command):
    text = f"RuntimeError: \n        Setup failed despite GPU being available. {ask}\n\n        {command}\n\n        Inspect it."
    j = run(text)
    assert j["proposal"]["step"].startswith("first run what the message asks, to see the cause")
    assert j["proposal"]["step"].endswith(command) and j["proposal"]["overrides"] == []


# --- built from heldout41q (after it was measured; see test_doctor_heldout_round5.py) ----------------------------

from trainer.diagnose.classes import engine_api  # noqa: E402


def test_a_deepspeed_engine_method_on_an_unwrapped_model_is_a_run_that_took_deepspeeds_path_without_it():
    methods = sorted(engine_api.engine_methods())
    assert {"save_checkpoint", "load_checkpoint", "backward"} <= set(methods)  # read from DeepSpeed's own source
    assert not {"forward", "train", "eval", "state_dict", "parameters"} & set(methods)  # a plain Module has those
    for attr in DRAW.sample(methods, 6):
        obj = DRAW.choice(["PeftModelForCausalLM", "LlamaForCausalLM", "DistributedDataParallel", "Qwen2Model"])
        j = run(f"Traceback (most recent call last):\n  File \"/x/trainer.py\", line 9, in save\n    "
                f"model.{attr}(d)\nAttributeError: '{obj}' object has no attribute '{attr}'")
        assert j["class"] == "engine_api" and "ACCELERATE_USE_DEEPSPEED" in j["proposal"]["step"], (attr, j["class"])
    exported = run("export ACCELERATE_USE_DEEPSPEED=true\nAttributeError: 'LlamaForCausalLM' object has no attribute "
                   "'save_checkpoint'")
    assert exported["proposal"]["step"].startswith("unset ACCELERATE_USE_DEEPSPEED (the log exports")


@pytest.mark.parametrize("attr", ["forward", "state_dict", "generate", "no_such_thing"])
def test_a_missing_attribute_that_is_not_the_engines_is_not_this_class(attr):
    assert run(f"AttributeError: 'LlamaForCausalLM' object has no attribute '{attr}'")["class"] != "engine_api"
    assert run("AttributeError: 'DeepSpeedEngine' object has no attribute 'save_checkpoint'")["class"] != "engine_api"


def test_an_oom_in_fsdps_full_state_dict_is_a_save_gathered_on_the_gpu():
    warning = ("/env/site-packages/torch/distributed/fsdp/fully_sharded_data_parallel.py:2224: UserWarning: Failed to "
               "clone() tensor with name lm_head.weight. This may mean that this state_dict entry could point to "
               "invalid memory regions after returning from state_dict() call. Error: CUDA out of memory. Tried to "
               "allocate 502.00 MiB (GPU 1; 39.59 GiB total capacity; 35.54 GiB already allocated)")
    j = run(warning, overrides=("hardware.gpu=a100-40g",))
    assert j["phase"] == "save" and "offload_to_cpu=True" in j["proposal"]["step"]
    plain = run("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 79.15 GiB total "
                "capacity; 77.00 GiB already allocated)")
    assert "offload_to_cpu" not in (plain["proposal"] or {}).get("step", "")


def test_safetensors_refusing_tied_weights_is_a_save_without_it():
    pair = DRAW.choice([("model.embed_tokens.weight", "lm_head.weight"), ("transformer.wte.weight", "lm_head.weight")])
    j = run(f"Some tensors share memory, this will lead to duplicate memory on disk and potential differences when "
            f"loading them again: [{{'{pair[0]}', '{pair[1]}'}}].\nA potential way to correctly save your model is to "
            f"use `save_model`.", "7b_grpo_8xh100")
    assert j["class"] == "shared_tensors" and "safe_serialization=False" in j["proposal"]["step"]
    assert pair[0] in j["title"] and pair[1] in j["title"]


def test_a_collective_timeout_on_one_node_of_pcie_gpus_tests_p2p_first():
    timeout = ("[E ProcessGroupNCCL.cpp:828] [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum="
               f"{DRAW.randrange(40, 9000)}, OpType=BROADCAST, Timeout(ms)=1800000) ran for 1809852 milliseconds before "
               "timing out.")
    pcie = run(timeout, "7b_lora_1x4090", ("hardware.gpus_per_node=2",))
    assert env_of(pcie["proposal"])["NCCL_P2P_DISABLE"] == "1"
    nvlink = run(timeout)  # 8 x A100 on NVLink: the advice (find the rank that stopped) stands alone
    assert nvlink["proposal"] is None or "NCCL_P2P_DISABLE" not in env_of(nvlink["proposal"])


def empty_operand() -> str:
    width = DRAW.choice([2048, 4096, 5120, 8192])
    return DRAW.choice([f"RuntimeError: The size of tensor a (0) must match the size of tensor b ({width}) at "
                        f"non-singleton dimension 1",
                        f"RuntimeError: The size of tensor a ({width}) must match the size of tensor b (0) at "
                        f"non-singleton dimension 0",
                        f"RuntimeError: mat1 and mat2 shapes cannot be multiplied (512x{width} and 0x{width})"])


def test_an_empty_operand_outside_training_is_a_zero3_placeholder_used_outside_deepspeed():
    for _ in range(6):
        j = run(empty_operand(), "7b_dpo_lora_1x4090")
        assert j["class"] == "zero3_placeholder" and "multi-GPU (DDP) config" in j["proposal"]["step"]


def test_an_empty_operand_in_a_forward_is_a_parameter_read_by_another_module():
    frames = ["Traceback (most recent call last):", '  File "/env/site-packages/transformers/models/llama/modeling_llama.py"'
              ', line 900, in forward', "    logits = self.lm_head(hidden_states)",
              '  File "/env/site-packages/torch/nn/modules/linear.py", line 114, in forward',
              "    return F.linear(input, self.weight, self.bias)"]
    j = run("\n".join(frames + [empty_operand()]))
    assert j["phase"] == "forward" and "register_external_parameter" in j["proposal"]["step"]


# --- built from heldout41s (after it was measured; see test_doctor_heldout_round5.py) ----------------------------

def store_traceback(site: list[str], message: str) -> str:
    return "\n".join(["Traceback (most recent call last):", '  File "/env/site-packages/torch/distributed/run.py", '
                      'line 710, in run', "    elastic_launch(", *site, message])


C10D = ['  File "/env/site-packages/torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py", line 155, in '
        '_create_tcp_store', "    store = TCPStore("]
ENV_STORE = ['  File "/env/site-packages/torch/distributed/rendezvous.py", line 174, in _create_c10d_store',
             "    return TCPStore("]


@pytest.mark.parametrize("message", ["RuntimeError: connect() timed out. Original timeout was 60000 ms.",
                                     "RuntimeError: Connection refused", "OSError: [Errno 113] No route to host"])
def test_a_connection_error_raised_where_a_store_is_created_is_the_rendezvous(message):
    c10d = run(store_traceback(C10D, message), overrides=("hardware.nodes=2",))
    assert c10d["class"] == "rendezvous" and "--rdzv_endpoint" in c10d["proposal"]["step"]
    env = run(store_traceback(ENV_STORE, message), overrides=("hardware.nodes=2",))
    assert env["class"] == "rendezvous" and "--master_addr" in env["proposal"]["step"]


def test_the_same_error_elsewhere_is_not_the_rendezvous():
    other = ['  File "/env/site-packages/requests/adapters.py", line 519, in send', "    raise ConnectionError(e)"]
    assert run(store_traceback(other, "requests.exceptions.ConnectionError: Connection refused"))["class"] != \
        "rendezvous"


def test_a_traceback_cut_in_a_gloo_groups_creation_pins_gloos_interface():
    cut = ["Traceback (most recent call last):", '  File "/env/site-packages/torchdata/dataloader2/reading_service.py",'
           ' line 446, in initialize', '    self._pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=1800))']
    j = run("\n".join(cut))
    assert j["class"] == "rendezvous" and "GLOO_SOCKET_IFNAME" in j["proposal"]["step"]
    whole = "\n".join(cut + ['  File "/env/site-packages/torch/distributed/distributed_c10d.py", line 3505, in new_group',
                             "    pg = _new_process_group_helper(", "RuntimeError: Connection refused"])
    assert "GLOO_SOCKET_IFNAME" in run(whole)["proposal"]["step"]


def test_any_network_address_wording_of_the_client_socket_is_read_with_its_host():
    j = run("torch.distributed.DistNetworkError: The client socket has failed to connect to any network address of "
            "(10.1.2.3, 29500). The client socket has failed to connect to 10.1.2.3:29500 (errno: 113 - No route to "
            "host).", overrides=("hardware.nodes=2",))
    assert j["class"] == "rendezvous" and "10.1.2.3" in j["title"]


# --- built from heldout41t (after it was measured; see test_doctor_heldout_round5.py) ----------------------------

MISMATCHES = ["RuntimeError: expected scalar type Half but found Float",
              "RuntimeError: self and mat2 must have the same dtype",
              "RuntimeError: expected mat1 and mat2 to have the same dtype, but got: float != c10::BFloat16",
              "RuntimeError: Input type (float) and bias type (c10::Half) should be the same",
              "RuntimeError: output tensor must have the same type as input tensor"]
GATHER_FRAMES = ['  File "/env/site-packages/deepspeed/runtime/zero/partition_parameters.py", line 1150, in all_gather_coalesced',
                 "    handle = _dist_allgather_fn(param.ds_tensor, param_buffer, ds_process_group)",
                 '  File "/env/site-packages/torch/distributed/distributed_c10d.py", line 2358, in all_gather_into_tensor',
                 "    work = group._allgather_base(output_tensor, input_tensor)"]


def test_two_dtypes_are_read_by_where_they_met():
    for message in MISMATCHES:
        gathered = run("\n".join(["Traceback (most recent call last):", *GATHER_FRAMES, message]),
                       overrides=("train.precision=fp16", "deepspeed.bf16=null",
                                  'deepspeed.fp16:={"enabled": "auto", "loss_scale": 0}'))
        assert gathered["class"] == "dtype_mismatch" and "bf16" in gathered["proposal"]["step"], message
        assert gathered["proposal"]["overrides"][0] == "train.precision=bf16"
        quantized = run(f"python train.py --quantization_bit 4 --fp16\n{message}", "7b_lora_1x4090")
        assert "upgrade peft and bitsandbytes" in quantized["proposal"]["step"]
        plain = run(message, "7b_lora_1x4090")
        assert "one dtype" in plain["proposal"]["step"]


def test_nan_out_of_a_backward_in_fp16_is_fp16s_range():
    nan = "RuntimeError: Function 'LogSigmoidBackward0' returned nan values in its 0th output."
    v100 = run(f"policy and reference set to f16和load_in_4bit\n{nan}", "7b_2xv100", ("hardware.gpus_per_node=1",))
    assert v100["class"] == "nan_backward" and v100["proposal"]["overrides"][0] == "train.precision=fp32"
    a100 = run(f"--fp16\n{nan}")  # 7b_8xa100 trains in bf16 already: the preset as it is
    assert a100["proposal"]["overrides"] == [] and "train in bf16 instead of fp16, as 7b_8xa100" in a100["proposal"]["step"]
    a100_fp16 = run(f"--fp16\n{nan}", overrides=("train.precision=fp16", "deepspeed.bf16=null",
                                                 'deepspeed.fp16:={"enabled": "auto", "loss_scale": 0}'))
    assert a100_fp16["proposal"]["overrides"][0] == "train.precision=bf16"
    assert run(f"--bf16\n{nan}")["class"] != "nan_backward"  # not fp16's range: another cause


# --- built from heldout41u and 41v (after they were measured; see test_doctor_heldout_round5.py) ---------

@pytest.mark.parametrize("cls, owner", [("Accelerator", "accelerate"), ("TrainingArguments", "transformers"),
                                        ("LoraConfig", "peft")])
def test_an_init_refusing_a_keyword_is_the_class_the_raising_line_builds(cls, owner):
    text = "\n".join(["Traceback (most recent call last):",
                      '  File "/env/site-packages/somelib/trainer.py", line 4127, in create',
                      f"    self.thing = {cls}(",
                      "TypeError: __init__() got an unexpected keyword argument 'dispatch_batches'"])
    j = run(text)
    assert j["class"] == "signature" and f"{cls}.__init__()" in j["title"] and f"downgrade {owner}" in \
        j["proposal"]["step"], j["title"]


@pytest.mark.parametrize("compiled", ["", "flash_attn", "xformers"])
def test_a_package_that_cannot_import_its_own_name_hid_the_failure_inside(compiled):
    patch = f"    from myproj.train.llama_{compiled}_monkey_patch import patch" if compiled else "    import os"
    text = "\n".join(["Traceback (most recent call last):", '  File "/home/u/MyProj/myproj/train/train_mem.py", line 6, '
                      'in <module>', patch, '  File "/home/u/MyProj/myproj/__init__.py", line 1, in <module>',
                      "    from .model import MyModelForCausalLM",
                      "ImportError: cannot import name 'MyModelForCausalLM' from 'myproj.model' "
                      "(/home/u/MyProj/myproj/model/__init__.py)"])
    j = run(text)
    assert j["class"] == "missing_name" and "its own 'MyModelForCausalLM'" in j["title"]
    step = j["proposal"]["step"]
    assert (f"reinstall {compiled.replace('_', '-')}" in step) if compiled else step.startswith("see the hidden error")


def test_a_global_batch_no_accumulation_reaches_says_it_is_not_divisible():
    j = run("AssertionError: Check batch related parameters. train_batch_size is not equal to micro_batch_per_gpu * "
            "gradient_acc_step * world_size 256 != 1 * 85 * 3", "70b_32xa100")
    assert "not divisible by micro x world size = 3" in j["proposal"]["reason"]


# --- built from heldout41w and 41x (after they were measured; see test_doctor_heldout_round5.py) ------------

def test_a_signature_message_wrapped_over_two_lines_is_read_whole():
    j = run("TypeError: GenerationMixin._extract_past_from_model_output() got an unexpected keyword argument \n"
            "'standardize_cache_format'")
    assert j["class"] == "signature" and "'standardize_cache_format'" in j["title"]
    assert "downgrade transformers" in j["proposal"]["step"]


@pytest.mark.parametrize("header", ["curand_kernel.h", "cuda_runtime.h", "cublas_v2.h", "cusparse.h", "thrust/sort.h",
                                    "cuda_fp16.h"])
def test_a_missing_cuda_header_is_the_cuda_toolkit_of_torchs_version(header):
    j = run(f"Emitting ninja build file /root/.cache/torch_extensions/cpu_adam/build.ninja...\n/opt/ds/csrc/includes/"
            f"custom_cuda_layers.h:12:10: fatal error: {header}: No such file or directory\nninja: build stopped")
    assert j["class"] == "op_build" and "CUDA toolkit" in j["proposal"]["step"], j["proposal"]["step"]
