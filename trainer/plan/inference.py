"""The planner's inference mode: what generation needs per GPU (weights, KV cache, logits, activations) and
where the weights go: on the GPUs (sharded by AutoTP when --tp > 1), in host RAM or on NVMe (ZeRO-Inference).

Weights at --tp N follow DeepSpeed 0.19.8's AutoTP for inference (module_inject/auto_tp.py, tp_shard.py,
layers.py; `deepspeed.init_inference(model, tensor_parallel={"tp_size": N})`): in every decoder layer q, k, v,
gate and up are split by output rows (LinearLayer), o and down by input columns (LinearAllreduce); attention
splits whole key/value heads, the MLP and the LM head split in grains of 64 (DeepSpeedTPConfig.tp_grain_size)
with the remainder on the last rank. The LM head is split by its input (hidden) dimension
(LmHeadLinearAllreduce), which first clones its weight: a tied LM head stops sharing the embedding.
Embeddings and RMSNorms stay whole on every rank. Ranks can differ; the per-GPU number is the largest rank.

KV cache: K and V of every layer, batch x context x kv width, in the model's dtype (transformers'
DynamicCache), split by heads under AutoTP. Logits: generate() keeps the last position only
(logits_to_keep=1): its logits in the model's dtype and three fp32 copies (the float copy, the processed
scores, the sampling softmax). Activations: see `prefill_activation_bytes`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .. import ds as dsc
from ..config import ModelConfig
from . import memory as mem
from .estimate import GPU_HEADROOM, HOST_HEADROOM, gb


ELEMENT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
TP_GRAIN_SIZE = 64        # DeepSpeedTPConfig.tp_grain_size (deepspeed/inference/config.py)
LOGITS_FP32_COPIES = 3    # generate(): .float() copy, logits processors' output, softmax when sampling
# Pinned host memory comes from PyTorch's caching host allocator, which rounds each block up to a power
# of two; DeepSpeed's own estimators put this 1.5x margin on host-side parameter memory.
HOST_PIN_FACTOR = mem.ADDITIONAL_BUFFER_FACTOR


@dataclass(frozen=True)
class InferenceMemory:
    """Per-GPU bytes of generation at one batch, context, dtype and tensor-parallel size."""
    weights: int
    kv_cache: int
    logits: int
    activations: int
    tp: int
    dtype: str
    model_weights: int       # the whole model's weights (what ZeRO-Inference keeps off the GPU)
    largest_layer: int       # parameters of the biggest module (DeepSpeed's prefetch unit)
    persistent: int          # parameters ZeRO-3 keeps on the GPU (<= stage3_param_persistence_threshold)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.logits + self.activations

    @property
    def zero_working(self) -> int:
        """Parameter bytes on the GPU under ZeRO-Inference: the module computing, the one being fetched
        (stage3_max_live_parameters = 2 x largest layer, see trainer.ds.inference) and the persistent ones."""
        return (2 * self.largest_layer + self.persistent) * ELEMENT_BYTES[self.dtype]

    @property
    def zero_gpu(self) -> int:
        return self.zero_working + self.kv_cache + self.logits + self.activations


def shard_size(total: int, tp: int, rank: int, heads: Optional[int] = None) -> int:
    """One rank's part of a dimension, as DeepSpeed's `get_shard_size`: whole heads when the dimension is
    a multiple of the kv-head count (attention), else grains of 64 with the tail on the last rank."""
    if heads and total % heads == 0:
        return total * (heads // tp + (1 if rank < heads % tp else 0)) // heads
    if total >= TP_GRAIN_SIZE:
        grains, tail = divmod(total, TP_GRAIN_SIZE)
        size = (grains // tp + (1 if rank < grains % tp else 0)) * TP_GRAIN_SIZE
        return size + (tail if rank == tp - 1 else 0)
    return total // tp + (1 if rank < total % tp else 0)


def autotp_rank_params(m: ModelConfig, tp: int) -> list[int]:
    """Parameters each of the tp ranks holds after `init_inference` (tp 1: the plain model, ties kept)."""
    if tp == 1:
        return [mem.count_params(m)]
    h, kv, inter, kv_heads = m.hidden_size, mem.kv_width(m), m.intermediate_size, m.num_kv_heads or m.num_heads
    bias = mem.has_qkv_bias(m)  # column-split layers split their bias with the rows
    out = []
    for rank in range(tp):
        q, k = shard_size(h, tp, rank, kv_heads), shard_size(kv, tp, rank, kv_heads)
        attention = (q + 2 * k) * (h + (1 if bias else 0)) + h * q
        mlp = 3 * h * shard_size(inter, tp, rank)
        layer = attention + mlp + 2 * h
        ends = m.vocab_size * h + h + m.vocab_size * shard_size(h, tp, rank)  # embedding, norm, LM head
        out.append(m.num_layers * layer + ends)
    return out


def persistent_params(m: ModelConfig) -> int:
    """Parameters small enough for ZeRO-3 to leave on the GPU: RMSNorm weights (and Qwen2's q/k/v biases)."""
    h, kv = m.hidden_size, mem.kv_width(m)
    small = [h, h] + ([h, kv, kv] if mem.has_qkv_bias(m) else [])
    per_layer = sum(n for n in small if n <= dsc.PERSISTENCE_THRESHOLD)
    return m.num_layers * per_layer + (h if h <= dsc.PERSISTENCE_THRESHOLD else 0)


def kv_cache_bytes(m: ModelConfig, batch: int, context: int, dtype: str, tp: int = 1) -> int:
    """K and V of every layer for every position: 2 x layers x batch x context x kv width x element / tp."""
    return 2 * m.num_layers * batch * context * mem.kv_width(m) * ELEMENT_BYTES[dtype] // tp


def prefill_activation_bytes(m: ModelConfig, batch: int, context: int, dtype: str, tp: int = 1) -> int:
    """The widest moment of one layer's forward over the whole prompt (no_grad keeps nothing for later).

    Per token: the residual stream and the normed input (2h, whole on every rank) plus the widest of
    SwiGLU (SiLU(gate), up and their product, 3 x I/tp), attention (q, k and v repeated to all heads when
    a mask is given, and the output, 4 x h/tp), or RMSNorm's two fp32 temporaries (8 bytes x h). Plus one
    layer's K and V twice: DynamicCache concatenates into a new tensor while the old one is alive.
    An estimate from the code paths, not measured."""
    e, h = ELEMENT_BYTES[dtype], m.hidden_size
    widest = max(3 * e * m.intermediate_size // tp, 4 * e * h // tp, 8 * h)
    per_token = 2 * e * h + widest
    one_layer_kv = kv_cache_bytes(m, batch, context, dtype, tp) // m.num_layers
    return batch * context * per_token + one_layer_kv


def inference_memory(model: ModelConfig, batch: int, context: int, dtype: str, tp: int = 1,
                     params: Optional[int] = None) -> InferenceMemory:
    """Per-GPU bytes of generating `batch` sequences of `context` tokens. params: an exact count given by
    the user for a stand-in architecture (the stand-in's split is scaled to it)."""
    if dtype not in ELEMENT_BYTES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(ELEMENT_BYTES)}")
    e, counted = ELEMENT_BYTES[dtype], mem.count_params(model)
    total = params or counted
    per_rank = max(autotp_rank_params(model, tp))
    return InferenceMemory(weights=per_rank * total // counted * e,
                           kv_cache=kv_cache_bytes(model, batch, context, dtype, tp),
                           logits=batch * model.vocab_size * (e + 4 * LOGITS_FP32_COPIES),
                           activations=prefill_activation_bytes(model, batch, context, dtype, tp), tp=tp,
                           dtype=dtype, model_weights=total * e,
                           largest_layer=mem.largest_layer_params(model), persistent=persistent_params(model))


@dataclass(frozen=True)
class Placement:
    mode: str            # "gpu" | "zero-cpu" | "zero-nvme" | "none"
    reason: str          # one line, with the numbers (GB = 1e9 bytes)
    gpu_bytes: int       # per GPU in this mode
    cpu_bytes: int = 0   # host RAM per node (ZeRO-Inference)
    nvme_bytes: int = 0  # NVMe per node (zero-nvme)


def _budget(size: Optional[int]) -> Optional[int]:
    return None if size is None else int(size * (1 - HOST_HEADROOM))


def choose_placement(need: InferenceMemory, gpu_bytes: int, cpu_ram_bytes: Optional[int],
                     nvme_bytes: Optional[int], ranks_per_node: int = 1, nodes: int = 1) -> Placement:
    """GPU first (fastest), then ZeRO-Inference from host RAM, then from NVMe (slowest), else none.

    gpu_bytes is the device's memory (10% kept for the CUDA context and fragmentation, as in training
    plans); cpu_ram_bytes and nvme_bytes are per node, 10% kept free (RAM None: unknown, not checked;
    NVMe None or 0: none). ZeRO-Inference runs one rank per GPU (ranks_per_node) with the weights
    partitioned over all ranks, so each node holds 1/nodes of them."""
    budget = int(gpu_bytes * (1 - GPU_HEADROOM))
    head = f"{gb(need.total)} GB per GPU (budget {gb(budget)} GB)"
    if need.total <= budget:
        split = f" at --tp {need.tp} (AutoTP)" if need.tp > 1 else ""
        return Placement("gpu", f"weights, KV cache and activations fit on the GPU{split}: {head}", need.total)
    if need.tp > 1:
        return Placement("none", f"{head} at --tp {need.tp} does not fit; ZeRO-Inference partitions by ZeRO-3, "
                                 f"not by heads: plan it with --tp 1", need.total)
    if need.zero_gpu > budget:
        return Placement("none", f"{head} does not fit, and with the weights offloaded the KV cache "
                                 f"({gb(need.kv_cache)} GB), activations and parameters in flight still need "
                                 f"{gb(need.zero_gpu)} GB per GPU", need.total)
    return _offloaded(need, f"{head} does not fit; ZeRO-Inference", budget, _budget(cpu_ram_bytes),
                      _budget(nvme_bytes) or 0, ranks_per_node, nodes)


def pinned_weight_bytes(need: InferenceMemory, nodes: int = 1) -> int:
    """Host RAM per node for zero-cpu: the node's share of the weights, pinned."""
    return int(need.model_weights / nodes * HOST_PIN_FACTOR)


def nvme_read_buffer_bytes(need: InferenceMemory, ranks_per_node: int = 1) -> int:
    """Host RAM per node for zero-nvme: each rank's pinned pool of read buffers (trainer.ds.inference)."""
    per_rank = dsc.PARAM_BUFFER_COUNT * dsc.nvme_buffer_size(need.largest_layer) * ELEMENT_BYTES[need.dtype]
    return ranks_per_node * per_rank


def _offloaded(need: InferenceMemory, head: str, budget: int, host: Optional[int], disk: int,
               ranks_per_node: int, nodes: int) -> Placement:
    """ZeRO-Inference once its GPU side fits: from host RAM if the pinned weights fit there, else NVMe."""
    gpu = f"the GPU holds {gb(need.zero_gpu)} of {gb(budget)} GB (KV cache, activations, parameters in flight)"
    in_ram, on_disk = pinned_weight_bytes(need, nodes), need.model_weights // nodes
    if host is None or in_ram <= host:
        known = f"of {gb(host)} GB" if host is not None else "(host RAM not checked: give --cpu-ram-gb)"
        return Placement("zero-cpu", f"{head} from host RAM: {gpu}; pinned weights {gb(in_ram)} GB per node "
                                     f"{known}", need.zero_gpu, in_ram)
    buffers = nvme_read_buffer_bytes(need, ranks_per_node)
    if on_disk <= disk and buffers <= host:
        return Placement("zero-nvme", f"{head} from NVMe (the {gb(in_ram)} GB of pinned weights exceed the "
                                      f"{gb(host)} GB of RAM): {gpu}; NVMe {gb(on_disk)} of {gb(disk)} GB per node, "
                                      f"pinned read buffers {gb(buffers)} GB", need.zero_gpu, buffers, on_disk)
    nvme = (f"read buffers {gb(buffers)} GB > RAM" if on_disk <= disk else
            f"{gb(on_disk)} GB > {gb(disk)} GB" if disk else f"{gb(on_disk)} GB; none given")
    return Placement("none", f"{head} would need {gb(in_ram)} GB of host RAM per node (> {gb(host)} GB) or "
                             f"NVMe ({nvme})", need.total)
