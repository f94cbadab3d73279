"""The model placed for inference on the ranks that are running:

  plain / TP      deepspeed.init_inference: tensor_parallel tp_size = the ranks (AutoTP), or tp 1 with every rank
                  a replica that takes its share of the prompts; kernel injection on CUDA when asked, for the
                  models DeepSpeed's policies serve (injection.py: refused from the config, before any weight)
  ZeRO-Inference  deepspeed.initialize with ZeRO-3 and parameter offload to CPU or NVMe and no optimizer: the
                  weights live off the GPU and each layer is fetched when it runs, for models that do not fit;
                  every rank is a replica with its own prompts, and each forward is a collective

DeepSpeed's inference engine builds its tensor-parallel group from ranks 0..tp-1 (InferenceEngine.
_create_model_parallel_group in 0.19.8), so a TP size other than 1 must equal the world size.
"""
from __future__ import annotations

import contextlib
import logging
import sys
from dataclasses import dataclass
from typing import Any

import torch

from .. import ds as dsc
from .. import ranks
from ..errors import UserError


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Runner:
    module: Any          # the transformers model to call generate/forward on
    device: torch.device
    mode: str            # "tp" (init_inference, tp ranks), "replicas" (init_inference tp 1) or "zero-cpu"/"zero-nvme"
    tp: int
    replica: int         # which share of the prompts this rank takes
    replicas: int        # how many shares
    engine: Any = None   # DeepSpeed's engine (kept alive: it owns the hooks and groups)

    @property
    def synced(self) -> bool:
        """ZeRO-Inference ranks must run forwards together until every rank is done (synced_gpus)."""
        return self.mode.startswith("zero") and ranks.world_size() > 1


def device_name() -> str:
    from deepspeed.accelerator import get_accelerator
    return get_accelerator().device_name()


def check_request(hf_config, tp: int, dtype: str, kernel_inject: bool, zero: str, world: int) -> None:
    """Everything the placement refuses, before any weight is read."""
    if tp < 1:
        raise UserError(f"--tp {tp} must be >= 1")
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % tp or kv_heads % tp:
        fits = max(d for d in range(1, tp + 1) if heads % d == 0 and kv_heads % d == 0)
        raise UserError(f"--tp {tp}: the model has {heads} attention heads and {kv_heads} key/value heads, and "
                        f"AutoTP gives each rank whole heads: --tp must divide both (e.g. --tp {fits})")
    if kernel_inject:
        check_injection(hf_config)
    on = device_name()
    if kernel_inject and on != "cuda":
        raise UserError(f"--kernel-inject: DeepSpeed's kernel injection (replace_with_kernel_inject) runs on CUDA "
                        f"only, and this accelerator is {on!r}; drop --kernel-inject (AutoTP and ZeRO-Inference work "
                        f"here)")
    if kernel_inject and zero != "off":
        raise UserError("--kernel-inject with --zero-inference: DeepSpeed injects kernels into init_inference's "
                        "engine, not ZeRO-3's; choose one")
    if dtype == "fp16" and on == "cpu":
        raise UserError("--dtype fp16: DeepSpeed's CPU accelerator has no fp16 ('Type fp16 is not supported on your "
                        "device'); use --dtype fp32 (or bf16, ~13x slower on most CPUs)")
    if tp > 1 and tp != world:
        raise UserError(f"--tp {tp}: DeepSpeed's inference engine puts ranks 0..tp-1 in one tensor-parallel group, so "
                        f"--tp must be 1 (each of the {world} rank(s) a replica) or the number of ranks launched "
                        f"({world}); launch with deepspeed --num_gpus {tp} or use --tp {world}")
    if tp > 1 and zero != "off":
        raise UserError(f"--tp {tp} with --zero-inference {zero}: ZeRO-Inference partitions the weights over every "
                        f"rank itself; use --tp 1")


def check_injection(hf_config) -> None:
    """--kernel-inject on a model DeepSpeed's kernel injection cannot serve is an error naming why (injection.py)."""
    from .injection import ALTERNATIVE, injection_problems
    problems = injection_problems(hf_config)
    if problems:
        raise UserError(f"--kernel-inject: DeepSpeed's kernel injection cannot serve this model: {'; '.join(problems)}"
                        f"; {ALTERNATIVE}")


def largest_layer(hf_config) -> int:
    """The most parameters one module owns (the planner's count): ZeRO-3's prefetch unit."""
    from ..plan.memory import largest_layer_params
    from ..plan.models import model_from_hf_fields
    return largest_layer_params(model_from_hf_fields(hf_config.to_dict(), "--model"))


def start_runner(load, hf_config, tp: int, dtype: str, kernel_inject: bool, zero: str,
                 nvme_path: str | None) -> Runner:
    """`load()` returns the model on CPU (complete weights); ZeRO-Inference of an HF directory loads it
    partitioned instead, through `load` under transformers' ZeRO-3 integration."""
    import deepspeed
    if kernel_inject:  # every caller (generate, evaluate, scripts/bench_generate.py), before `load` reads a weight
        check_injection(hf_config)
    world, rank = ranks.world_size(), ranks.rank()
    with quiet_stdout():
        if zero != "off":
            ds = dsc.zero_inference_config(f"zero-{zero}", nvme_path, largest_layer=largest_layer(hf_config),
                                           dtype=dtype)
            from transformers.integrations.deepspeed import HfDeepSpeedConfig
            integration = HfDeepSpeedConfig(ds)  # while it lives, from_pretrained loads into zero.Init
            assert integration.is_zero3()
            model = load()
            engine, *_ = deepspeed.initialize(model=model, config=ds)
            del integration
            engine.module.eval()
            return Runner(engine.module, engine.device, f"zero-{zero}", 1, rank, world, engine)
        model = load()
        engine = deepspeed.init_inference(model, config=dsc.init_inference_config(tp, dtype, kernel_inject))
        if kernel_inject:
            from .injection import hold_layer_contract
            hold_layer_contract(engine.module)  # transformers 5.x takes a layer's return value as the hidden states
    device = next(engine.module.parameters()).device
    if tp > 1:
        return Runner(engine.module, device, "tp", tp, 0, 1, engine)
    return Runner(engine.module, device, "replicas", 1, rank, world, engine)


@contextlib.contextmanager
def quiet_stdout():
    """DeepSpeed logs to stdout (its logger's handler, made at import, and prints); results own stdout, so for
    the rest of the process its logger writes to stderr, and so does anything printed inside this block."""
    with contextlib.redirect_stdout(sys.stderr):
        from deepspeed.utils import logger  # a first import here binds the handler to stderr already
        for handler in logger.handlers:
            if type(handler) is logging.StreamHandler and handler.stream in (sys.__stdout__, sys.stdout):
                handler.setStream(_CurrentStderr())
        yield


class _CurrentStderr:
    """Whatever sys.stderr is at the time of writing (tests and wrappers replace it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()
