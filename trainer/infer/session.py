"""What `generate` and `evaluate` share: the model flags, and a session = the ranks up, the source resolved, the
tokenizer, and the model placed (runner.py), torn down when the command ends."""
from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass
from typing import Any

from .. import numbers, paths
from ..flag_needs import needs
from .. import ranks
from ..distributed import end_distributed, start_distributed
from ..errors import UserError
from .runner import DTYPES, Runner, check_request, device_name, quiet_stdout, start_runner
from .source import ModelSource, architecture, load_model, load_tokenizer_for, resolve_source


@dataclass
class Session:
    runner: Runner
    tokenizer: Any
    source: ModelSource


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, metavar="SRC",
                        help="HF model directory or hub id, a run directory, a checkpoint directory, a LoRA adapter")
    parser.add_argument("--tp", type=numbers.COUNT,
                        help="tensor-parallel ranks (AutoTP): 1 or the number of ranks launched "
                                               "(default: the number launched)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), help="default: bf16 on GPUs that have it, else fp32")
    parser.add_argument("--kernel-inject", action="store_true", help="DeepSpeed's fused inference kernels (CUDA)")
    parser.add_argument("--zero-inference", choices=("auto", "off", "cpu", "nvme"), default="auto",
                        help="ZeRO-3 with the weights offloaded to CPU or NVMe, for models that do not fit; auto = "
                             "the planner's choice from the model, batch, context and free memory")
    needs(parser.add_argument("--nvme-path", type=paths.input_dir("NVMe directory"),
                              help="directory on NVMe for --zero-inference nvme (or auto, when it picks NVMe)"),
          "--zero-inference nvme or auto (off and cpu never offload to NVMe)",
          lambda args: args.zero_inference in ("nvme", "auto"))
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let transformers run the model's and tokenizer's own Python code (auto_map, *.py); "
                             "off unless given here: a saved config cannot turn it on")
    parser.add_argument("--local_rank", "--local-rank", type=numbers.RANK, help=argparse.SUPPRESS)  # set by launchers


def default_dtype() -> str:
    import torch
    if device_name() == "cuda" and torch.cuda.is_bf16_supported():
        return "bf16"
    return "fp32" if device_name() == "cpu" else "fp16"


@dataclass
class Request:
    """What was asked, checked before any rank starts or any weight is read."""
    source: ModelSource
    tokenizer: Any
    hf_config: Any
    tp: int
    dtype: str
    zero: str


def check_arguments(args, batch_size: int = 1) -> Request:
    with quiet_stdout():  # the first use of DeepSpeed (the accelerator) logs on import
        return _checked_request(args, batch_size)


def _checked_request(args, batch_size: int) -> Request:
    source = resolve_source(args.model, args.trust_remote_code)
    tokenizer = load_tokenizer_for(source)
    hf_config = architecture(source)
    world = ranks.launched_world_size()
    tp = args.tp if args.tp is not None else world
    dtype = args.dtype or default_dtype()
    zero = args.zero_inference
    if zero == "auto":
        zero = planned_zero_mode(hf_config, batch_size, dtype, tp)
    if zero == "nvme" and not args.nvme_path:
        raise UserError("--zero-inference nvme needs --nvme-path DIR (a directory on a local NVMe drive)")
    check_request(hf_config, tp, dtype, args.kernel_inject, zero, world)
    return Request(source, tokenizer, hf_config, tp, dtype, zero)


@contextlib.contextmanager
def open_session(args, request: Request):
    """The ranks up and the model placed for `request`; the process group torn down at the end."""
    with quiet_stdout():
        start_distributed()
    succeeded = False
    try:
        yield make_session(args, request)
        succeeded = True
    finally:
        end_distributed(succeeded)


def make_session(args, request: Request) -> Session:
    source = request.source
    print(f"model: {source.described}", file=sys.stderr)
    runner = start_runner(lambda: load_model(source, DTYPES[request.dtype]), request.hf_config, request.tp,
                          request.dtype, args.kernel_inject, request.zero, args.nvme_path)
    print(f"inference: {runner.mode}, tp {runner.tp}, {runner.replicas} replica(s), {request.dtype}, on "
          f"{runner.device}; deepspeed modules in the model: {deepspeed_modules(runner.module) or 'none'}",
          file=sys.stderr)
    return Session(runner, request.tokenizer, source)


def deepspeed_modules(module) -> str:
    """The DeepSpeed module types that replaced transformers' (AutoTP's sharded linears, injected kernels): what
    really runs, not what was asked for."""
    found: dict[str, int] = {}
    for m in module.modules():
        if type(m).__module__.startswith("deepspeed."):
            found[type(m).__name__] = found.get(type(m).__name__, 0) + 1
    return ", ".join(f"{name} x{count}" for name, count in sorted(found.items()))


def available_host_ram() -> int:
    import os
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def planned_zero_mode(hf_config, batch_size: int, dtype: str, tp: int) -> str:
    """'off' when the weights, KV cache and working memory fit the device (the planner's `plan --inference`
    numbers, for the batch at the model's full context), else its ZeRO-Inference placement. CPU ranks use host
    memory either way: nothing to offload to."""
    if device_name() == "cpu":
        return "off"
    import os

    import torch

    from ..plan.inference import choose_placement, inference_memory
    from ..plan.models import model_from_hf_fields
    model = model_from_hf_fields(hf_config.to_dict(), "--model")
    need = inference_memory(model, batch_size, model.max_position_embeddings, dtype, tp)
    placement = choose_placement(need, torch.cuda.mem_get_info()[1], available_host_ram(), None,
                                 int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    print(f"placement (--zero-inference auto): {placement.mode}: {placement.reason}", file=sys.stderr)
    if placement.mode == "none":
        raise UserError(f"the model does not fit on these GPUs or in host RAM: {placement.reason}; see "
                        f"`python -m trainer plan --inference` for what would fit, or give --zero-inference nvme "
                        f"--nvme-path DIR")
    return {"gpu": "off", "zero-cpu": "cpu", "zero-nvme": "nvme"}[placement.mode]
