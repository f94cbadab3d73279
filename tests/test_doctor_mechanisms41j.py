"""Issue 41's mechanisms after heldout41i (built from its misses once it was measured; see
test_doctor_heldout41i.py), each checked on cases drawn beyond those logs:

- a log cut before its exception line (it ends in the raising frame) is read through that line's own words: the
  string literals of `require_version("transformers>=4.36.2", "To fix: pip install ...")` or of
  `raise ValueError("... cannot be fp16 when bf16 is set")` are what the message would have said;

and after heldout41j and heldout41k (test_doctor_heldout41j.py, test_doctor_heldout41k.py):
- a write that found no room is read for its writer (the path the message names, else the frames nearest it) and
  that writer is moved (classes/storage.py);
- what the log's own config already sets is not proposed again (logfacts.config_values);
- an exception retold in a sentence is read as its message; a container inside a container where names were wanted
  is named as the shape;
- an OOM is priced from the sharding the log's run used (FSDP's strategy, a ZeRO stage and offload the log shows),
  not from the preset's (logfacts.sharding);
- a timeout in the first communicator's setup is a barrier at collective #0; a run of another framework gets its
  own timeout knob first;
- torch's checkpoint warning that no input requires grad is the no-graph error's cause when the paste ends before
  the error.
"""
from __future__ import annotations

import random

import pytest

from test_doctor_heldout41b import said
from test_doctor_mechanisms41f import run

pytestmark = pytest.mark.quick

DRAW = random.Random(41_010)


def cut_log(last_frame: list[str], prefix: str = "") -> str:
    """A traceback pasted up to its raising frame: no exception line after it."""
    frames = ['  File "/home/u/LLaMA-Factory/src/train.py", line 1, in <module>', "    from llmtuner import run_exp",
              '  File "/home/u/LLaMA-Factory/src/llmtuner/__init__.py", line 3, in <module>',
              "    from .model import load_model", *last_frame]
    return "\n".join(prefix + line for line in ["Traceback (most recent call last):", *frames])


REQUIREMENTS = [("transformers", "4.41.2"), ("peft", "0.11.1"), ("trl", "0.8.6"), ("accelerate", "0.30.1"),
                ("datasets", "2.16.0"), ("torch", "2.1.0"), ("deepspeed", "0.14.0")]
CHECKERS = [
    lambda pkg, v: f'require_version("{pkg}>={v}", "To fix: pip install {pkg}>={v}")',
    lambda pkg, v: f"require_version('{pkg}>={v}', 'To fix: pip install {pkg}>={v}')",
    lambda pkg, v: f'raise ImportError(f"{pkg}>={v} is required, please upgrade: pip install -U {pkg}")',
    lambda pkg, v: f'check_version("{pkg}>={v}")  # needs {pkg} {v} or later',
]


@pytest.mark.parametrize("package, version, checker, prefix",
                         [(*DRAW.choice(REQUIREMENTS), DRAW.randrange(len(CHECKERS)), DRAW.choice(["", "[rank0]: "]))
                          for _ in range(8)])
def test_a_requirement_in_the_raising_line_of_a_cut_log_is_the_pin(package, version, checker, prefix):
    code = CHECKERS[checker](package, version)
    j = run(cut_log(['  File "/home/u/LLaMA-Factory/src/llmtuner/model/loader.py", line 21, in <module>',
                     f"    {code}"], prefix))
    assert j["recognised"], j
    assert f"{package}>={version}" in said(j["proposal"]), j["proposal"]


def test_a_conflict_in_the_raising_line_of_a_cut_log_sets_the_setting():
    code = 'raise ValueError("--mixed_precision cannot be fp16 when bf16 is set")'
    j = run(cut_log(['  File "/x/site-packages/accelerate/commands/launch.py", line 900, in _validate', f"    {code}"]))
    assert j["recognised"] and "bf16" in said(j["proposal"]), j["proposal"]


@pytest.mark.parametrize("code", [
    "assert len(set(t.dtype for t in tensors)) == 1",                # no words at all: nothing is stated
    'model = AutoModel.from_pretrained(path, revision="v4.36.2")',  # a version that is no requirement
    'tokenizer = load("requirements.txt")',
])
def test_code_without_a_statement_in_its_literals_states_nothing(code):
    j = run(cut_log(['  File "/home/u/src/loader.py", line 21, in <module>', f"    {code}"]))
    assert not said(j["proposal"]).startswith("pin "), j["proposal"]


# --- a write that found no room: the writer, from the path or the frames (classes/storage.py) -----------------------

ROOM = ["OSError: [Errno 28] No space left on device", "OSError: [Errno 122] Disk quota exceeded",
        "RuntimeError: [enforce fail at inline_container.cc:595] . unexpected pos 64 vs 0: No space left on device"]
# writer -> (a path the message may name, a frame of the code that writes, what a right proposal says)
WRITERS = {
    "shm": ("/dev/shm/torch_1234_5678_0", '  File "/usr/lib/python3.10/multiprocessing/synchronize.py", line 57, in '
            "__init__", "--shm-size"),
    "datasets": ("/root/.cache/huggingface/datasets/json/default-1/0.0.0/cache-1.arrow",
                 '  File "/opt/conda/lib/python3.10/site-packages/datasets/arrow_writer.py", line 575, in write_table',
                 "HF_DATASETS_CACHE"),
    "hub": ("/root/.cache/huggingface/hub/models--meta-llama--Llama-2-7b-hf/blobs/abc.incomplete",
            '  File "/opt/conda/lib/python3.10/site-packages/huggingface_hub/file_download.py", line 1500, in '
            "http_get", "HF_HOME"),
    "checkpoint": ("/data/runs/llama/checkpoint-2000/global_step2000/mp_rank_00_model_states.pt",
                   '  File "/opt/conda/lib/python3.10/site-packages/torch/serialization.py", line 441, in save',
                   "keep_last"),
    "extensions": ("/root/.cache/torch_extensions/py310_cu121/cpu_adam/cpu_adam.o",
                   '  File "/opt/conda/lib/python3.10/site-packages/torch/utils/cpp_extension.py", line 1900, in '
                   "_run_ninja_build", "TORCH_EXTENSIONS_DIR"),
    "tmp": ("/tmp/tmpab12cd/data.bin", '  File "/usr/lib/python3.10/tempfile.py", line 480, in func_wrapper',
            "TMPDIR"),
}


def room_log(writer: str, error: str, by_path: bool, prefix: str) -> str:
    path, frame, _ = WRITERS[writer]
    last = f"{error}: '{path}'" if by_path else error
    frames = ['  File "/home/u/train.py", line 80, in main', "    trainer.train()",
              *([] if by_path else [frame, "    do_the_write()"])]
    return "\n".join(prefix + line for line in ["Traceback (most recent call last):", *frames, last])


@pytest.mark.parametrize("writer, error, by_path, prefix",
                         [(w, DRAW.choice(ROOM), DRAW.random() < 0.5, DRAW.choice(["", "[rank1]: "]))
                          for w in WRITERS for _ in range(2)])
def test_a_write_without_room_moves_the_writer_the_path_or_the_frames_name(writer, error, by_path, prefix):
    j = run(room_log(writer, error, by_path, prefix))
    assert j["class"] in (("no_room", "shm") if writer == "shm" else ("no_room",)), j  # /dev/shm: its own class
    assert WRITERS[writer][2] in said(j["proposal"]), (writer, j["proposal"])


def test_a_write_without_room_whose_writer_the_log_does_not_show_gets_the_check_that_finds_it():
    j = run("step 120 loss 1.82\nOSError: [Errno 28] No space left on device")
    assert j["class"] == "no_room" and "df -h" in said(j["proposal"]), j["proposal"]


def test_room_refused_among_interleaved_ranks_is_read_from_the_nearest_writer():
    """Two ranks' tracebacks interleaved line by line: the frames nearest the error name the writer."""
    lines = []
    for a, b in zip(room_log("shm", ROOM[0], False, "").splitlines(), room_log("shm", ROOM[0], False, "").splitlines()):
        lines += [a, b]
    j = run("\n".join(lines))
    assert "--shm-size" in said(j["proposal"]), j["proposal"]


def test_other_errnos_are_not_taken_for_a_full_disk():
    j = run("Traceback (most recent call last):\n  File \"/x/torch/serialization.py\", line 441, in save\n"
            "PermissionError: [Errno 13] Permission denied: '/data/runs/ckpt.pt'")
    assert j["class"] != "no_room", j


# --- the log's own config: what was already set is not proposed again (logfacts.config_values) ----------------------

OPT_OUT = [  # how a log shows zero_force_ds_cpu_optimizer set off
    "deepspeed_config:\n  offload_optimizer_device: cpu\n  zero_stage: 3\n  zero_force_ds_cpu_optimizer: False",
    '{\n  "zero_optimization": {"stage": 3},\n  "zero_force_ds_cpu_optimizer": false,\n  "train_batch_size": 8\n}',
    "zero_force_ds_cpu_optimizer: 'false'",
]
CLIENT = ["deepspeed.runtime.zero.utils.ZeRORuntimeException: You are using ZeRO-Offload with a client provided "
          "optimizer (<class 'torch.optim.adamw.AdamW'>) which in most cases will yield poor performance. Please "
          "either use deepspeed.ops.adam.DeepSpeedCPUAdam or set an optimizer in your ds-config "
          "(https://www.deepspeed.ai/docs/config-json/#optimizer-parameters). If you really want to use a custom "
          "optimizer w. ZeRO-Offload and understand the performance impacts you can also set "
          "<\"zero_force_ds_cpu_optimizer\": false> in your configuration file.",
          "ZeRORuntimeException: You are using ZeRO-Offload with a client provided optimizer"]


@pytest.mark.parametrize("shown", range(len(OPT_OUT)))
@pytest.mark.parametrize("message", range(len(CLIENT)))
def test_an_opt_out_the_log_already_sets_is_not_proposed_again(shown, message):
    j = run(f"{CLIENT[message]}\n{OPT_OUT[shown]}")
    first = said(j["proposal"])
    assert j["class"] == "offload_optimizer" and "0.8.2" in first and "config file" in first, first
    assert not any("zero_force_ds_cpu_optimizer=false" in o.lower() for o in j["proposal"]["overrides"]), first


@pytest.mark.parametrize("message", range(len(CLIENT)))
def test_without_the_opt_out_in_the_log_deepspeeds_cpu_adam_comes_first(message):
    j = run(CLIENT[message] + "\ndeepspeed_config:\n  zero_stage: 3")
    assert "DeepSpeedCPUAdam" in said(j["proposal"]), j["proposal"]


# --- an exception retold in a sentence (raised._told_in_prose) ----------------------------------------------------

@pytest.mark.parametrize("sentence, expected", [
    ("我在调试代码时遇到了value error: Target modules(['q_proj', 'v_proj'])not found in the base model. 的问题",
     "flat list"),
    ("when I run it I get runtime error： this model requires transformers>=4.45.0, please upgrade", "transformers>=4.45.0"),
    ("Hi, training stops with a Value Error: --mixed_precision cannot be fp16 when bf16 is set. Any idea?", "bf16"),
])
def test_an_exception_retold_in_a_sentence_is_read_as_its_message(sentence, expected):
    j = run(sentence)
    assert j["recognised"] and expected in said(j["proposal"]), j["proposal"]


@pytest.mark.parametrize("line", [
    "ERROR: Could not find a version that satisfies the requirement torch==2.13.0 (from versions: 2.1.0, 2.2.0)",
    "error: requires deepspeed>=0.16 for this feature",
    "CUDA error: this build requires torch>=2.4",
    "[E ProcessGroupNCCL.cpp:475] Some error: requires NCCL>=2.18",
])
def test_a_log_level_or_a_librarys_own_error_word_is_not_a_retold_python_exception(line):
    """pip's ERROR line names the version it could not install, not one the run lacks: "pin" it would be wrong."""
    j = run(line)
    assert not said(j["proposal"]).startswith("pin "), j["proposal"]


# --- a container inside a container where a list of names was wanted (stated.NESTED) ------------------------------

@pytest.mark.parametrize("value, nested", [
    ("(['q_proj', 'v_proj'],)", True), ("[['q_proj', 'k_proj', 'v_proj']]", True), ("(['q_proj', 'o_proj'])", True),
    ("['q_proj', 'v_proj']", False), ("{'c_attn'}", False),
])
def test_a_nested_target_list_is_named_as_the_shape_not_the_names(value, nested):
    j = run("Traceback (most recent call last):\n  File \"/x/site-packages/peft/tuners/tuners_utils.py\", line 500, "
            f"in inject_adapter\nValueError: Target modules {value} not found in the base model. Please check the "
            "target modules and try again.")
    assert ("flat list" in said(j["proposal"])) == nested, j["proposal"]


# --- the OOM priced from what the log ran (logfacts.sharding, memory._as_the_log_ran) ------------------------------

V100_OOM = ("torch.cuda.OutOfMemoryError: CUDA out of memory. Tried to allocate 388.00 MiB (GPU 3; 31.75 GiB total "
            "capacity; 28.42 GiB already allocated; 340.94 MiB free; 30.39 GiB reserved in total by PyTorch)")


def run_on(preset: str, overrides: list[str], text: str) -> dict:
    from test_doctor_heldout41b import run as run_case
    return run_case({"run_preset": preset, "preset_overrides": overrides}, text)


@pytest.mark.parametrize("shown", [
    "torchrun --nproc_per_node=5 train.py --fsdp \"full_shard auto_wrap\" --per_device_train_batch_size 1",
    "fsdp_sharding_strategy: FULL_SHARD",
    '{"zero_optimization": {"stage": 3}}',
    "  zero_stage: 3\n  offload_optimizer_device: none",
])
def test_an_oom_is_priced_from_the_sharding_the_log_ran_not_the_presets(shown):
    """Preset 7b_2xv100 offloads parameters and optimizer (2.3 GB per GPU planned); a log whose run sharded without
    offload and needed 30.9 GB is not that config: calibrating the preset's estimate with it would put every rung
    past the GPU. Priced from what ran, the offloads fit."""
    j = run_on("7b_2xv100", ["hardware.gpus_per_node=5", "hardware.gpu=v100-32g", "train.micro_batch_size=1"],
               f"{shown}\n{V100_OOM}")
    first = said(j["proposal"])
    assert "offload" in first and "cpu" in first, j
    assert any("the log's run used" in a for a in j["advice"]), j["advice"]


def test_an_oom_from_the_presets_own_sharding_is_priced_as_before():
    same = '{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}'
    j = run_on("7b_2xv100", ["hardware.gpus_per_node=5", "hardware.gpu=v100-32g"], f"{same}\n{V100_OOM}")
    assert not any("the log's run used" in a for a in j["advice"]), j["advice"]


# --- the first communicator's timeout is a barrier (collectives.FIRST_COMMUNICATOR) -------------------------------

STORE_TIMEOUT = ("[7] is setting up NCCL communicator and retrieving ncclUniqueId from [0] via c10d key-value store by "
                 "key '0', but store->get('0') got error: Socket Timeout")


@pytest.mark.parametrize("before, knob", [
    ("Running tokenizer on train dataset:  43%|####3     | 1000000/2300000", "timeout=datetime.timedelta"),
    ("  File \"/x/site-packages/transformers/trainer.py\", line 1536, in train\nMap (num_proc=8):  12%", "--ddp_timeout"),
])
def test_a_timeout_at_the_first_communicator_while_rank_0_prepares_raises_the_frameworks_timeout(before, knob):
    j = run_on("7b_8xa100", [], f"{before}\n{STORE_TIMEOUT}")
    assert j["class"] == "nccl_barrier_timeout" and knob in said(j["proposal"]), j["proposal"]
    assert "prepare-data" in " ".join(said(t) for t in j["then"]), j["then"]


def test_the_same_timeout_in_this_trainers_run_prepares_the_data_first():
    j = run_on("7b_8xa100", [], f"deepspeed --num_gpus 8 train.py --preset 7b_8xa100\nTokenizing source 0\n{STORE_TIMEOUT}")
    assert "prepare-data" in said(j["proposal"]), j["proposal"]


# --- the checkpoint's warning before a cut no-graph error (autograd.NO_INPUT_GRAD) ---------------------------------

WARNING = ("/x/site-packages/torch/utils/checkpoint.py:31: UserWarning: None of the inputs have requires_grad=True. "
           "Gradients will be None")


def test_a_paste_cut_before_the_no_graph_error_is_read_from_the_checkpoints_warning():
    text = "\n".join([WARNING, "Traceback (most recent call last):", '  File "train_peft.py", line 610, in main',
                      "    trainer.train()", '  File "/x/site-packages/transformers/trainer.py", line 1809, in '
                      "_inner_training_loop"])
    j = run(text)
    assert j["class"] == "no_gradient_graph" and "enable_input_require_grads" in said(j["proposal"]), j


def test_the_warning_alone_in_a_run_that_goes_on_is_no_failure():
    j = run(WARNING + "\n{'loss': 1.93, 'learning_rate': 2e-05, 'epoch': 0.1}")
    assert j["class"] != "no_gradient_graph", j


# --- after heldout41l: what one node's paste says of the others; what NCCL chose; recomputation under ZeRO-3 -------

def nccl_lines(host: str, devices: range, nranks: int, transport: str) -> list[str]:
    lines = []
    for device in devices:
        pid = 46654 + device
        lines += [f"{host}:{pid}:{pid} [{device}] NCCL INFO NET : Using interface ib0:12.12.12.102<0>",
                  f"{host}:{pid}:{pid} [{device}] NCCL INFO {transport}",
                  f"{host}:{pid}:{pid} [{device}] NCCL INFO rank {device} nranks {nranks}"]
    return lines


SOCKETS = ["NET/IB : Using interface ib0 for sideband communication\nNCCL INFO Using internal Network Socket",
           "NET/Socket : Using [0]ib0:12.12.12.102<0>"]


@pytest.mark.parametrize("transport", SOCKETS)
@pytest.mark.parametrize("local, nranks", [(4, 8), (2, 16), (8, 16)])
def test_one_nodes_paste_of_a_larger_world_is_read_as_several_nodes_and_the_interface_pinned(transport, local, nranks):
    lines = nccl_lines("gpu2", range(local), nranks, transport.splitlines()[-1])
    if "sideband" in transport:
        lines.insert(1, f"gpu2:46654:46654 [0] NCCL INFO {transport.splitlines()[0]}")
    text = "NCCL error in: /torch/lib/c10d/ProcessGroupNCCL.cpp:260, unhandled system error\n" + "\n".join(lines)
    j = run_on("70b_32xa100", [f"hardware.nodes={nranks // local}", f"hardware.gpus_per_node={local}"], text)
    assert "NCCL_SOCKET_IFNAME" in said(j["proposal"]), j["proposal"]


def test_a_world_one_host_holds_whole_stays_one_node():
    text = "NCCL error in: ProcessGroupNCCL.cpp:260, unhandled system error\n" + "\n".join(
        nccl_lines("box", range(4), 4, "NET/Socket : Using [0]eth0:10.0.0.2<0>"))
    j = run_on("7b_8xa100", [], text)
    assert "NCCL_SOCKET_IFNAME=<iface>" not in said(j["proposal"]), j["proposal"]


RECOMPUTED_LOG = ("[rank0]: torch.utils.checkpoint.CheckpointError: torch.utils.checkpoint: Recomputed values for the "
                  "following tensors have different metadata than during the forward pass.\n[rank0]: tensor at "
                  "position 4:\n[rank0]: saved metadata: {'shape': torch.Size([4096, 4096]), 'dtype': torch.bfloat16}\n"
                  "[rank0]: recomputed metadata: {'shape': torch.Size([0]), 'dtype': torch.bfloat16}")


@pytest.mark.parametrize("stage, reentrant", [(3, True), (2, False), (1, False)])
def test_a_recomputation_that_differs_under_zero3_gets_reentrant_checkpointing(stage, reentrant):
    j = run_on("7b_8xa100", [f"deepspeed.zero_optimization.stage={stage}"], RECOMPUTED_LOG)
    assert j["class"] == "checkpoint_recompute", j
    assert ('"use_reentrant": True' in said(j["proposal"])) == reentrant, j["proposal"]


def test_the_log_s_own_stage_decides_over_the_presets():
    j = run_on("7b_8xa100", ["deepspeed.zero_optimization.stage=2"], '{"zero_optimization": {"stage": 3}}\n' + RECOMPUTED_LOG)
    assert '"use_reentrant": True' in said(j["proposal"]), j["proposal"]


@pytest.mark.parametrize("caller", ["src/llmtuner/tuner/core/loader.py", "/home/u/my_train.py"])
def test_zero3_with_a_device_map_names_the_call_that_passes_it(caller):
    text = "\n".join(["Traceback (most recent call last):", f'  File "{caller}", line 107, in load_model',
                      "    model = AutoModelForCausalLM.from_pretrained(",
                      '  File "/x/site-packages/transformers/modeling_utils.py", line 2227, in from_pretrained',
                      "    raise ValueError(",
                      "ValueError: DeepSpeed Zero-3 is not compatible with `low_cpu_mem_usage=True` or with passing a "
                      "`device_map`."])
    j = run_on("7b_8xa100", ["deepspeed.zero_optimization.stage=3"], text)
    first = said(j["proposal"])
    assert "low_cpu_mem_usage=False" in first and caller.rsplit("/", 1)[-1] in first, first


# --- after heldout41m: EIO on a write, read as the disk it writes to (storage._failed_write) ----------------------

@pytest.mark.parametrize("writer", ["checkpoint", "datasets", "tmp"])
@pytest.mark.parametrize("error", ["RuntimeError: write(): fd 29 failed with Input/output error",
                                   "OSError: [Errno 5] Input/output error while writing the file"])
def test_an_input_output_error_on_a_write_checks_the_disk_it_writes_to(writer, error):
    _, frame, remedy = WRITERS[writer]
    text = "\n".join(["Traceback (most recent call last):", '  File "train.py", line 250, in <module>',
                      "    save()", frame, "    f.write(data)", error])
    j = run(text)
    first = said(j["proposal"])
    assert j["class"] == "no_room" and "df -h" in first and remedy in first, first


def test_an_input_output_error_on_a_read_is_not_a_full_disk():
    j = run("Traceback (most recent call last):\n  File \"/x/site-packages/datasets/load.py\", line 10, in load\n"
            "OSError: [Errno 5] Input/output error: '/mnt/nfs/data/train.jsonl'")
    assert j["class"] != "no_room", j
