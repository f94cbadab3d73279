"""The inference mode's inputs (`plan --inference`): model, GPUs, host RAM and NVMe, batch, context, tensor
parallelism and dtype, checked with every problem at once, each naming its flag and a fix."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..errors import ConfigError, closest
from ..hardware import GPUS, Gpu, gpu_named
from .inputs import _size_gb, collecting
from .models import ModelSpec, model_from_spec, positive_int


DTYPES = ("bf16", "fp16", "fp32")

@dataclass(frozen=True)
class InferenceInputs:
    model: ModelSpec
    gpu: Gpu
    batch: int
    context: int          # tokens per sequence the KV cache holds: prompt + generated
    tp: int = 1
    dtype: str = "bf16"
    gpus_per_node: int = 1
    nodes: int = 1
    cpu_ram_gb: Optional[float] = None
    nvme_gb: Optional[float] = None
    nvme_path: str = "/local_nvme"

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes


def inference_inputs_from_args(args) -> InferenceInputs:
    values = {key: getattr(args, key, None) for key in ("model", "hidden_size", "num_layers", "gpu", "gpus_per_node",
                                                        "nodes", "cpu_ram_gb", "nvme_gb", "nvme_path", "batch",
                                                        "context", "tp", "dtype")}
    return build_inference_inputs({k: v for k, v in values.items() if v is not None})


def build_inference_inputs(values: dict) -> InferenceInputs:
    """Validated InferenceInputs from flag values (keys as the flags, with underscores)."""
    problems: list[str] = []

    check = collecting(problems)

    if values.get("gpu") is None:
        problems.append(f"--gpu is required: one of {', '.join(g for g in GPUS if g != 'cpu')}")
    gpu = check(gpu_named, str(values["gpu"]), "--gpu") if values.get("gpu") is not None else None
    model = check(model_from_spec, values.get("model"), values.get("hidden_size"), values.get("num_layers"),
                  lambda key: f"--{key.replace('_', '-')}")
    ints = {key: check(positive_int, values.get(key, default), f"--{key.replace('_', '-')}", optional=default is None)
            for key, default in (("gpus_per_node", 1), ("nodes", 1), ("batch", 1), ("tp", 1), ("context", None))}
    if values.get("context") is None:
        problems.append("--context is required with --inference: the tokens per sequence the KV cache holds "
                        "(prompt + generated), e.g. --context 4096")
    sizes = {key: check(_size_gb, values.get(key), f"--{key.replace('_', '-')}", allow_zero=key == "nvme_gb")
             for key in ("cpu_ram_gb", "nvme_gb")}
    dtype = values.get("dtype") or ("bf16" if gpu is None or gpu.bf16 else "fp16")
    if dtype not in DTYPES:
        problems.append(f"--dtype: {dtype!r} is not one of {', '.join(DTYPES)}{closest(dtype, DTYPES)}")
    elif dtype == "bf16" and gpu is not None and not gpu.bf16:
        problems.append(f"--dtype bf16: {gpu.description} has no bf16; use --dtype fp16")
    if model is not None:
        problems += _model_problems(model, ints)
    if problems:
        raise ConfigError(problems, "the command line")
    return InferenceInputs(model=model, gpu=gpu, batch=ints["batch"], context=ints["context"], tp=ints["tp"],
                           dtype=dtype, gpus_per_node=ints["gpus_per_node"], nodes=ints["nodes"],
                           cpu_ram_gb=sizes["cpu_ram_gb"], nvme_gb=sizes["nvme_gb"],
                           nvme_path=str(values.get("nvme_path") or "/local_nvme"))


def _model_problems(model: ModelSpec, ints: dict[str, Any]) -> list[str]:
    """--context within the model's positions; --tp a divisor of its heads and no more than the GPUs given."""
    m, tp, context, out = model.config, ints["tp"], ints["context"], []
    if context and context > m.max_position_embeddings:
        out.append(f"--context {context} is beyond {model.label}'s {m.max_position_embeddings} positions "
                   f"(max_position_embeddings): use --context {m.max_position_embeddings} or less")
    if not tp:
        return out
    kv_heads = m.num_kv_heads or m.num_heads
    if m.num_heads % tp or kv_heads % tp:
        fits = [d for d in range(1, kv_heads + 1) if kv_heads % d == 0 and m.num_heads % d == 0]
        out.append(f"--tp {tp} does not divide {model.label}'s {m.num_heads} attention heads and {kv_heads} "
                   f"key/value heads (AutoTP splits whole heads): use one of {', '.join(map(str, fits))}")
    gpus = (ints["gpus_per_node"] or 1) * (ints["nodes"] or 1)
    if tp > gpus:
        out.append(f"--tp {tp} needs {tp} GPUs but --gpus-per-node x --nodes gives {gpus}: raise --gpus-per-node "
                   f"(or --nodes), or lower --tp")
    return out
