"""Memory formulas for the planner: parameter counts, ZeRO model states, activations and logits.

Pure arithmetic on a `ModelConfig` (LLaMA-style decoder: llama, mistral, qwen2); no torch, no
DeepSpeed import. Sizes are bytes; GB in messages are 1e9 bytes, as in `trainer.hardware`.

Parameters (exact, from the architecture; head_dim d = h / a, kv width h_kv = kv_heads x d)
    embeddings V.h, LM head V.h unless tied, final RMSNorm h, and per layer:
    q h.h, k h.h_kv, v h.h_kv, o h.h (+ q/k/v biases for qwen2), SwiGLU gate/up/down 3.h.I, 2 RMSNorms 2h.
    The largest layer is what DeepSpeed's `model_to_params` calls one: the most parameters owned
    directly by one module (the embedding or LM head for every Llama so far, else an MLP projection).

Model states (per GPU and per node) follow DeepSpeed 0.19.8's estimators exactly for 16-bit training
    (`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs`, read in
    deepspeed/runtime/zero/stage_1_and_2.py and stage3.py), P params, G GPUs, g per node, n nodes,
    f = 1.5 (additional_buffer_factor), LL = 4 bytes x largest layer:
      stage 2            GPU 2P + int(18P/G)              CPU 4.P.g.f
      stage 2 + offload  GPU 2P                           CPU P.max(4G, 16).f
      stage 3            GPU LL + int(18P/G)              CPU 4.P.g.f  (zero.Init: 4.largest.g.f)
      3 + opt offload    GPU LL + int(2P/G)               CPU P.max(4g, 16/n).f (zero.Init: 16P/n.f)
      3 + opt+param      GPU LL                           CPU P.max(4g, 18/n).f (zero.Init: 18P/n.f)
    18 = 2 (16-bit grads) + 4 (fp32 grads) + 4 (fp32 master) + 8 (Adam moments). DeepSpeed has no
    estimator for stages 0 and 1; they use the same byte counts: stage 0 shards nothing
    (2P + 18P, DeepSpeed's stage-2 number at G=1) and stage 1 keeps the 16-bit gradients whole
    (2P + 2P + int(16P/G)). fp32 training (CPU ranks) has no DeepSpeed estimator either; there the
    counts are the tensors DeepSpeed's optimizers allocate in fp32 (see `fp32_model_states`).

Activations per transformer layer (bytes; s sequence, b micro-batch, h hidden, h_kv kv width,
    I MLP width, a heads, e = 2 bytes for 16-bit training, 4 for fp32). Korthikanti et al. 2022
    (https://arxiv.org/abs/2205.05198, eq. 2) give s.b.h.(34 + 5.a.s/h) for a GeLU 4h MLP with dropout
    and a materialised score matrix. Adapted to a HF Llama layer under autograd:
      2 RMSNorms            2 x (4 + 2e).s.b.h   fp32 input (kept for pow/mul), normalised value, output
                            + 2 x 4.s.b          1/rms in fp32
      q, k, v after RoPE    e.s.b.(h + 2.h_kv)   saved by flash/sdpa (native GQA: k, v stay h_kv wide)
      attention output      e.s.b.h              kept by the kernel; o_proj's input is a view of it
                                                 (flash/sdpa lay it out as b.s.a.d already)
      logsumexp             4.s.b.a              fp32, per head and token
      SwiGLU                4 x e.s.b.I          gate, SiLU(gate), up, SiLU(gate)*up (down_proj input)
    e = 2:  s.b.(20h + 4.h_kv + 8I + 4a + 8)  (Llama-2-7B: ~45.5.s.b.h; Korthikanti, GeLU/MHA/no flash: 34 + 5as/h)
    Checked against the tensors autograd saves (saved_tensors_hooks) on a CPU model: within 1%.
    flash/sdpa never store the a.s.s score matrix; `eager` attention adds s.b.a.s.(4 + e)
    (fp32 softmax output + its 16-bit copy). No dropout terms: Llama has none.
    Full activation checkpointing keeps only each layer's input, e.s.b.h, and recomputes one layer at
    a time in backward: L.e.s.b.h + one layer's activations.
    Final RMSNorm (4 + 2e).s.b.h + 4.s.b, token ids 8.s.b.
Logits: the loss upcasts the 16-bit logits to fp32 (4.s.b.V), log-softmax keeps its fp32 output
    (4.s.b.V) and backward makes an fp32 gradient of the same size (4.s.b.V): 12.s.b.V at the peak;
    the 16-bit logits (e.s.b.V) are gone by then unless the caller keeps `outputs.logits`.
Tiled compute (DeepSpeed ALST, as the trainer runs it: train/sequence_parallel.py), t = tokens per tile:
    tiled MLP (model.tiled_mlp)   TiledMLP saves only its input (the RMSNorm output, counted above) and runs the
                                  forward without grad: no layer keeps its SwiGLU tensors; backward recomputes one
                                  tile at a time, so 4.e.t.I exist once (`mlp_tile_bytes`)
    tiled logits (tiled_logits)   TiledFusedLogitsLoss runs each tile's forward and backward in its forward: one
                                  tile's fp32 logits, log-softmax and gradient, 12.t.V, plus the hidden states'
                                  gradient it fills and keeps for backward, e.s.b.h
    Both measured with saved_tensors_hooks on a CPU Llama (tests/test_plan_sequence_parallel.py): the saved set
    within 2%, a recomputed MLP tile exactly, a logits tile's log-softmax within 1%.
sdpa under a padding mask (SFT batches carry one): transformers 5.24's sdpa_attention_forward passes
    `enable_gqa` only without a mask (use_gqa_in_sdpa, CUDA/CPU); with one it calls repeat_kv, so k and v
    are saved a heads wide (e.s.b.2h instead of e.s.b.2h_kv), and torch turns the boolean (b, 1, s, s)
    mask into one in the model's dtype per layer, which the kernel saves: + e.b.s.s per layer. Both
    measured with saved_tensors_hooks on a CPU Llama (tests/test_memory.py). flash_attention_2 unpads
    instead: neither term. The planner counts 'auto' as sdpa (it cannot know flash-attn is installed).
Liger (model.liger, `apply_liger_kernel_to_llama` defaults): on the forwards where it runs (trainer.loss_path: a
    training forward with labels, below ZeRO-3, without sequence parallelism or tiles; never the DPO policy or
    reference, which are called without labels) the fused linear cross-entropy never builds the s.b.V logits. Its
    forward (liger_kernel/ops/fused_linear_cross_entropy.py) computes the input and LM-head gradients chunk by
    chunk and keeps them for backward: grad_input e.s.b.h + grad_weight
    e.V.h + fp32 per-token loss 4.s.b, with one logits chunk of C.V in flight (e), C = the next power of
    two of s.b / ceil(V / h). LigerRMSNorm saves its input and fp32 1/rms (no fp32 copy of the input):
    2e.h + 4 per token with its output; LigerSiLUMul saves gate and up and recomputes SiLU: 3 x e.s.b.I.
Preference tuning (DPO): a micro-batch of b pairs is 2b sequences through the policy (activations and logits at
    2b). The reference model is priced by how it runs (plan.memory `frozen_reference`, `reference_forward_bytes`):
      adapter      the LoRA base with the adapter disabled: no weights of its own; one forward without grad
      engine       a second, frozen model (trainer.ds frozen_reference_config): its 16-bit weights e.P sharded
                   e.P/G under ZeRO-3 (+ one gathered module, e.LL) or on the CPU with param offload (e.P/n x 1.5
                   per node, as DeepSpeed's estimators count offloaded 16-bit params), whole e.P on every GPU at
                   stages 0-2; plus one forward without grad
      precomputed  nothing while training (the batches carry 2 fp64 log-probs a pair); a one-time pass before it
                   runs the reference (the adapter-disabled base, or a temporary engine priced as above) beside the
                   policy's model states, without the policy's activations
    A forward without grad saves nothing: its peak is one layer's tensors and its logits with their fp32 upcast
    and log-softmax, (e + 8).s.2b.V, on top of the policy's saved activations (the policy runs first).
LoRA: the frozen base is 16-bit weights only (sharded at stage 3, on CPU with param offload); the
    adapters get DeepSpeed's model-state accounting. Activations are counted as for full training
    (an overestimate: frozen projections do not save their inputs).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import LoraConfig, ModelConfig
from ..loss_path import FUSED, TILED, loss_path


GB = 1e9
ADDITIONAL_BUFFER_FACTOR = 1.5  # DeepSpeed's estimator default: host-side margin for pinned buffers, fragmentation
FP32_BYTES = 4


def bytes_per_element(precision: str) -> int:
    """Element size of parameters, gradients and activations for a training precision."""
    return FP32_BYTES if precision == "fp32" else 2


# --- parameters --------------------------------------------------------------------------------


def head_dim(m: ModelConfig) -> int:
    return m.head_dim or m.hidden_size // m.num_heads


def q_width(m: ModelConfig) -> int:
    """Width of the q projection and of o_proj's input: heads x head dim (hidden, unless head_dim is free)."""
    return m.num_heads * head_dim(m)


def kv_width(m: ModelConfig) -> int:
    """Width of the k and v projections: kv heads x head dim (GQA; equals hidden for MHA)."""
    return (m.num_kv_heads or m.num_heads) * head_dim(m)


def has_qkv_bias(m: ModelConfig) -> bool:
    return m.family == "qwen2"  # Qwen2 keeps biases on q/k/v; Llama and Mistral have none


def module_params(m: ModelConfig) -> dict[str, int]:
    """Parameters owned directly by each distinct module of one decoder layer and of the model ends. MoE families
    (mixtral, qwen3_moe): the router (`gate`, experts x h) and the experts, which transformers 5.x fuses into one module holding
    every expert's gate/up/down weights (3D parameters) -- DeepSpeed's largest layer then."""
    h, kv, q, inter = m.hidden_size, kv_width(m), q_width(m), m.intermediate_size
    bias = has_qkv_bias(m)
    modules = {
        "embed_tokens": m.vocab_size * h,
        "q_proj": h * q + (q if bias else 0),
        "k_proj": h * kv + (kv if bias else 0),
        "v_proj": h * kv + (kv if bias else 0),
        "o_proj": q * h,
        "input_layernorm": h,
        "post_attention_layernorm": h,
        "norm": h,
    }
    if m.family == "qwen3_moe":  # Qwen3 normalises q and k per head (RMSNorm over head_dim)
        modules.update({"q_norm": head_dim(m), "k_norm": head_dim(m)})
    if m.num_experts:
        modules.update({"gate": h * m.num_experts, "experts": m.num_experts * 3 * h * inter})
    else:
        modules.update({"gate_proj": h * inter, "up_proj": h * inter, "down_proj": inter * h})
    if not m.tie_word_embeddings:
        modules["lm_head"] = m.vocab_size * h
    return modules


MODEL_ENDS = ("embed_tokens", "norm", "lm_head")


def params_per_layer(m: ModelConfig) -> int:
    return sum(count for name, count in module_params(m).items() if name not in MODEL_ENDS)


def count_params(m: ModelConfig) -> int:
    """Exact trainable parameter count of the full model (a tied LM head counted once); every expert counts: the
    memory of model states holds them all."""
    modules = module_params(m)
    ends = modules["embed_tokens"] + modules["norm"] + modules.get("lm_head", 0)
    return ends + m.num_layers * params_per_layer(m)


def active_params(m: ModelConfig) -> int:
    """Parameters one token passes through: an MoE layer runs num_experts_per_tok of its experts (what the FLOPs per
    token, MFU and tokens/s count); the total for dense models."""
    if not m.num_experts:
        return count_params(m)
    idle = m.num_experts - (m.num_experts_per_tok or 2)
    return count_params(m) - m.num_layers * idle * 3 * m.hidden_size * m.intermediate_size


def largest_layer_params(m: ModelConfig, expert_parallel: int = 1) -> int:
    """DeepSpeed's 'largest layer': max over modules of the parameters each owns directly. Under expert
    parallelism (AutoEP, size ep) a GPU's experts module holds num_experts / ep of them."""
    modules = module_params(m)
    if "experts" in modules:
        modules["experts"] //= expert_parallel
    return max(modules.values())


def lora_params(m: ModelConfig, lora: LoraConfig) -> int:
    """Adapter parameters: r x (in + out) for every targeted projection of every layer."""
    h, kv, inter = m.hidden_size, kv_width(m), m.intermediate_size
    shapes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    unknown = [t for t in lora.target_modules if t not in shapes]
    if m.num_experts:  # the MLP of an MoE layer is fused experts, no projections of these shapes
        unknown += [t for t in lora.target_modules if t in ("gate_proj", "up_proj", "down_proj")]
    if unknown:
        raise ValueError(f"LoRA target modules {unknown} are not Llama projections ({', '.join(shapes)})")
    per_layer = sum(lora.r * (shapes[t][0] + shapes[t][1]) for t in lora.target_modules)
    return m.num_layers * per_layer


# --- model states ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelStates:
    """Per-GPU and per-node model-state bytes for one ZeRO configuration.

    gpu_bytes and cpu_bytes are DeepSpeed's numbers (16-bit) for the same inputs; the per-GPU split
    (params + gradients + optimizer + working == gpu_bytes) is ours, for the table."""
    gpu_bytes: int
    cpu_bytes: int
    params: int        # 16-bit (or fp32) parameters resident on the GPU
    gradients: int     # gradient partitions
    optimizer: int     # fp32 master weights + Adam moments
    working: int       # stage 3: DeepSpeed's largest-layer term (gathered params + grads of one module)


def zero2_model_states(total_params: int, gpus_per_node: int = 1, nodes: int = 1, cpu_offload: bool = False,
                       additional_buffer_factor: float = ADDITIONAL_BUFFER_FACTOR) -> tuple[int, int]:
    """(cpu, gpu) bytes exactly as `estimate_zero2_model_states_mem_needs` computes them."""
    total_gpus = nodes * gpus_per_node
    if cpu_offload:
        gpu = 2 * total_params
        cpu = total_params * max(4 * total_gpus, 16) * additional_buffer_factor
    else:
        gpu = 2 * total_params + int(18 * total_params / total_gpus)
        cpu = total_params * 4 * gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu)


def zero3_model_states(total_params: int, largest_layer: int, gpus_per_node: int = 1, nodes: int = 1,
                       cpu_offload: bool = False, cpu_offload_params: bool = False, zero_init: bool = True,
                       additional_buffer_factor: float = ADDITIONAL_BUFFER_FACTOR) -> tuple[int, int, int]:
    """(cpu, gpu, largest_layer_memory) exactly as `estimate_zero3_model_states_mem_needs` computes them."""
    total_gpus = nodes * gpus_per_node
    gpus_factor = 1 / nodes
    largest_layer_memory = 4 * largest_layer
    if cpu_offload:
        state_bytes = 18 if cpu_offload_params else 16  # fp32 master+moments+grads (+16-bit params)
        gpu = largest_layer_memory if cpu_offload_params else largest_layer_memory + int(2 * total_params / total_gpus)
        if zero_init:
            cpu = total_params * state_bytes * gpus_factor * additional_buffer_factor
        else:
            cpu = total_params * max(4 * gpus_per_node, state_bytes * gpus_factor) * additional_buffer_factor
    else:
        gpu = largest_layer_memory + int(18 * total_params / total_gpus)
        loaded = largest_layer if zero_init else total_params  # zero.Init never materialises the full model
        cpu = loaded * 4 * gpus_per_node * additional_buffer_factor
    return int(cpu), int(gpu), largest_layer_memory


def model_states(total_params: int, largest_layer: int, stage: int, gpus_per_node: int, nodes: int,
                 offload_optimizer: bool = False, offload_param: bool = False, zero_init: bool = True,
                 precision: str = "bf16") -> ModelStates:
    """Model-state bytes for one candidate. 16-bit: DeepSpeed's accounting; fp32: `fp32_model_states`."""
    if precision == "fp32":
        return fp32_model_states(total_params, largest_layer, stage, gpus_per_node, nodes,
                                 offload_optimizer, offload_param, zero_init)
    gpus = gpus_per_node * nodes
    if stage == 3:
        cpu, gpu, working = zero3_model_states(total_params, largest_layer, gpus_per_node, nodes,
                                               offload_optimizer, offload_param, zero_init)
        if offload_optimizer:
            params = 0 if offload_param else gpu - working
            return ModelStates(gpu, cpu, params, 0, 0, working)
        params, optimizer = int(2 * total_params / gpus), int(12 * total_params / gpus)
        return ModelStates(gpu, cpu, params, gpu - working - params - optimizer, optimizer, working)
    if stage == 2 or (stage == 1 and offload_optimizer):  # stage 1 + offload: the same offloaded layout
        cpu, gpu = zero2_model_states(total_params, gpus_per_node, nodes, offload_optimizer)
        if offload_optimizer:
            return ModelStates(gpu, cpu, gpu, 0, 0, 0)
        optimizer = int(12 * total_params / gpus)
        return ModelStates(gpu, cpu, 2 * total_params, gpu - 2 * total_params - optimizer, optimizer, 0)
    # Stages 0 and 1: no DeepSpeed estimator; same bytes per parameter, less sharding.
    cpu, _ = zero2_model_states(total_params, gpus_per_node, nodes, cpu_offload=False)
    sharded_over = gpus if stage == 1 else 1
    optimizer = int(12 * total_params / sharded_over)
    fp32_grads = int(4 * total_params / sharded_over)
    gradients = 2 * total_params + fp32_grads
    return ModelStates(2 * total_params + gradients + optimizer, cpu, 2 * total_params, gradients, optimizer, 0)


def fp32_model_states(total_params: int, largest_layer: int, stage: int, gpus_per_node: int, nodes: int,
                      offload_optimizer: bool, offload_param: bool, zero_init: bool = True,
                      additional_buffer_factor: float = ADDITIONAL_BUFFER_FACTOR) -> ModelStates:
    """fp32 training (CPU ranks, or fp32 on GPUs): the tensors DeepSpeed 0.19.8 allocates, read in its optimizers.

    Stage 1/2 (stage_1_and_2.py): the flat fp32 params (4P, whole), the gradient partition
    `grads_in_partition` (4P/G; the fp32 'conversion' in step is the same tensor), the fp32 master
    partition `single_partition_of_fp32_groups` (4P/G, a clone even in fp32) and Adam's two moments
    (8P/G). Stage 1 also keeps whole gradients in param.grad (4P). Stage 3 (stage3.py): parameter
    partition `lp_param_buffer` (4P/G), `grad_partitions_flat_buffer` (4P/G), fp32 master partitions
    (4P/G) and moments (8P/G), plus one gathered module's params and grads (8 x largest layer).
    Stage 0 is plain torch AdamW: params, grads, moments. The device side has no 1.5x factor: it is
    compared against what a run holds.

    Host RAM per node (`cpu_bytes`) is what sizes a host, counted as DeepSpeed's 16-bit estimators count it
    (x1.5 for pinned buffers and fragmentation): what offloading moves there -- per rank the gradient
    partition, fp32 master and moments (16P/G), and with parameters offloaded their 4P/G -- for every rank of
    the node, or the fp32 model each rank loads before partitioning (4P per rank; one layer under zero.Init
    at stage 3) when that is larger, as `estimate_zero2/3_model_states_mem_needs` count the 16-bit load.
    """
    P, LL = total_params, largest_layer
    gpus = gpus_per_node * nodes
    shard = lambda n: int(n * P / gpus)  # noqa: E731 - a one-line helper reads better inline
    host = lambda per_rank: int(per_rank * gpus_per_node * additional_buffer_factor)  # noqa: E731
    loaded = host(4 * (LL if stage == 3 and zero_init else P))
    if stage == 0:
        return ModelStates(16 * P, loaded, 4 * P, 4 * P, 8 * P, 0)
    offloaded = (16 * P / gpus if offload_optimizer else 0) + (4 * P / gpus if stage == 3 and offload_param else 0)
    cpu = max(loaded, host(offloaded))  # the load comes first, then the offloaded states take its place
    if stage in (1, 2):
        params = 4 * P
        gradients = shard(4) + (4 * P if stage == 1 else 0)
        optimizer = 0 if offload_optimizer else shard(12)
        gradients = 0 if offload_optimizer else gradients
        return ModelStates(params + gradients + optimizer, cpu, params, gradients, optimizer, 0)
    working = 8 * LL
    params = 0 if offload_param else shard(4)
    gradients = 0 if offload_optimizer else shard(4)
    optimizer = 0 if offload_optimizer else shard(12)
    return ModelStates(params + gradients + optimizer + working, cpu, params, gradients, optimizer, working)


# --- activations -------------------------------------------------------------------------------


# DeepSpeed 0.19.8's cpu_checkpointing engine (checkpointing._get_cpu_offload_engine: keep_last_count=1): the newest
# checkpointed input stays on the GPU; in backward one offloaded input at a time is copied back
OFFLOAD_KEPT_INPUTS = 2


@dataclass(frozen=True)
class Activations:
    layers: int      # saved activations of all transformer layers (+ one recomputed layer with checkpointing)
    logits: int      # loss-side peak: fp32 logits, log-softmax output and its gradient
    total: int
    host: int = 0    # checkpoint offload: the checkpointed layer inputs held in (pinned) host memory, per GPU
    loss_path: str = ""  # the training forward's loss path (trainer.loss_path) the logits term prices


def rms_norm_bytes_per_token(hidden: int, e: int, liger: bool = False) -> int:
    """HF LlamaRMSNorm saves the fp32 input (pow and mul), 1/rms (fp32), the normalised 16-bit value
    (for the weight's grad) and its output (the next projection's input). LigerRMSNorm saves its
    input and 1/rms; its output is the next projection's input."""
    return (2 * e * hidden if liger else (4 + 2 * e) * hidden) + 4


def expands_kv(m: ModelConfig, attention: str, padding_mask: bool) -> bool:
    """sdpa with a padding mask and GQA: transformers repeats k and v to all heads before the kernel."""
    return attention in ("sdpa", "auto") and padding_mask and kv_width(m) < m.hidden_size


def layer_activation_bytes(m: ModelConfig, seq_len: int, micro_batch: int, precision: str = "bf16",
                           attention: str = "sdpa", padding_mask: bool = False, sequence_parallel: int = 1,
                           tiled_mlp: bool = False) -> int:
    """Bytes one decoder layer saves for backward on one rank (module docstring has the derivation). Under
    Ulysses sequence parallelism (size sp) a rank holds s/sp tokens of every tensor outside attention, and inside
    it, after the all-to-all, the whole sequence for a/sp heads: the same bytes, so every per-token term is
    divided by sp; eager's score matrix (a/sp heads x s x s) too, while a padding mask stays whole per rank.
    `tiled_mlp` (DeepSpeed's TiledMLP): the MLP saves only its input, the RMSNorm output counted already; its
    SwiGLU tensors exist one tile at a time (`mlp_tile_bytes`)."""
    e = bytes_per_element(precision)
    h, kv, q, inter, a = m.hidden_size, kv_width(m), q_width(m), m.intermediate_size, m.num_heads
    saved_kv = h if expands_kv(m, attention, padding_mask) else kv
    per_token = (2 * rms_norm_bytes_per_token(h, e, m.liger)  # two RMSNorms
                 + e * q                           # q (k, v below)
                 + e * q                           # attention output (o_proj's input is a view of it)
                 + 4 * a                           # logsumexp
                 + (moe_bytes_per_token(m, e) if m.num_experts else 0 if tiled_mlp else swiglu_bytes_per_token(m, e)))
    if m.family == "qwen3_moe":  # q_norm, k_norm: each head's fp32 input, normalised value (RoPE saves no output)
        per_token += (4 + e) * (q + kv) + 4 * (a + (m.num_kv_heads or a))
    if attention == "eager":
        per_token += a * seq_len * (4 + e)         # the score matrix flash/sdpa never store
    # k, v (repeated to all heads under a padding mask) over the whole sequence for this rank's kv heads: with fewer
    # kv heads than ranks DeepSpeed's Ulysses hands every rank one head, replicated (ulysses_sp.py)
    kv_per_rank = saved_kv // sequence_parallel if saved_kv % (sequence_parallel * head_dim(m)) == 0 else head_dim(m)
    kv = 2 * e * kv_per_rank * seq_len * micro_batch
    mask = 0
    if attention in ("sdpa", "auto") and padding_mask:
        mask = e * seq_len * seq_len * micro_batch  # the mask in the model's dtype, (b, 1, s, s), per layer
    return seq_len * micro_batch // sequence_parallel * per_token + kv + mask


def swiglu_bytes_per_token(m: ModelConfig, e: int) -> int:
    """gate, SiLU(gate), up and their product (down_proj's input); LigerSiLUMul recomputes SiLU."""
    return (3 if m.liger else 4) * e * m.intermediate_size


def mlp_tile_bytes(m: ModelConfig, seq_len: int, micro_batch: int, tiles: int, precision: str = "bf16") -> int:
    """What a tiled MLP holds beyond its input: one tile's SwiGLU tensors, while TiledMLP recomputes that tile in
    backward (its forward runs without grad). A tile is ceil(seq_len / tiles) tokens of each sequence (torch.chunk
    along the sequence, at most one tile per token: train.sequence_parallel._tiled_mlp_forward)."""
    tiles = min(tiles, seq_len)
    return micro_batch * -(-seq_len // tiles) * swiglu_bytes_per_token(m, bytes_per_element(precision))


def moe_bytes_per_token(m: ModelConfig, e: int) -> int:
    """What an MoE layer (transformers 5.x MixtralExperts / Qwen3MoeExperts) saves per token instead of a SwiGLU:
    for each of its top-k experts, the dispatched copy of its hidden state, the gate/up output, the activation and
    its product with up, the down output before the routing weight scales it (4 x inter + 2 x h elements), the
    routing weight (fp32) and two int64 dispatch indices; and once, the router's fp32 softmax over the experts and
    its top-k (int64 ids, fp32 weights and their sum)."""
    k = m.num_experts_per_tok or 2
    return k * (e * (4 * m.intermediate_size + 2 * m.hidden_size) + 4 + 16) + 4 * m.num_experts + 12 * k + 4


def liger_chunk_rows(tokens: int, m: ModelConfig) -> int:
    """Rows of the logits chunk Liger's fused linear cross-entropy computes at a time."""
    inc_factor = -(-m.vocab_size // m.hidden_size)
    target = -(-tokens // inc_factor)
    return min(1 << max(target - 1, 0).bit_length(), tokens)


def logits_bytes(m: ModelConfig, seq_len: int, micro_batch: int, precision: str = "bf16", stage: int = 0,
                 tiles: int = 0, forward: str = "causal", sequence_parallel: int = 1) -> int:
    """Loss-side peak of `forward` on the path trainer.loss_path decides (the one the trainer runs): fp32 logits +
    fp32 log-softmax output + fp32 gradient; on Liger's fused path (model.liger, a training forward with labels,
    below ZeRO-3, without sequence parallelism or tiles) the fused linear cross-entropy's saved input and LM-head
    gradients, fp32 losses and one logits chunk; the DPO policy's forward has no labels, so Liger builds the full
    logits there. `tiles` >= 2 (DeepSpeed's TiledFusedLogitsLoss, tiles that divide the tokens evenly:
    resolve.even_tiles): one tile's three fp32 tensors, and the hidden states' gradient it fills tile by tile in
    forward and keeps for backward (e.s.b.h). `seq_len` is one rank's share already."""
    tokens = seq_len * micro_batch
    path = loss_path(forward, m.liger, stage, sequence_parallel, tiles)
    if path == TILED:
        return bytes_per_element(precision) * tokens * m.hidden_size + 12 * (tokens // tiles) * m.vocab_size
    if path == FUSED:
        e = bytes_per_element(precision)
        return (e * tokens * m.hidden_size + e * m.vocab_size * m.hidden_size + 4 * tokens
                + e * liger_chunk_rows(tokens, m) * m.vocab_size)
    return 12 * tokens * m.vocab_size


def activation_bytes(m: ModelConfig, seq_len: int, micro_batch: int, checkpointing: bool,
                     precision: str = "bf16", attention: str = "sdpa", padding_mask: bool = False,
                     stage: int = 0, sequence_parallel: int = 1, mlp_tiles: int = 0,
                     logits_tiles: int = 0, checkpoint_offload: bool = False, forward: str = "causal") -> Activations:
    """Peak activation memory of one micro-batch on one rank, with or without full activation checkpointing;
    under sequence parallelism the rank holds seq_len / sp tokens of it (logits included). `mlp_tiles` >= 2
    (model.tiled_mlp, dense MLPs): no layer keeps its SwiGLU tensors, one tile of them exists at a time;
    `logits_tiles` >= 2 (model.tiled_logits, already even): one tile's logits (`logits_bytes`).
    `checkpoint_offload` (DeepSpeed's cpu_checkpointing, with checkpointing): its offload engine keeps the newest
    layer input on the GPU and the others in host memory until their backward, which brings one back at a time;
    the GPU holds two inputs (the kept one, the one restored) instead of every layer's. `forward`: "causal"
    (pretraining, SFT) or "policy" (DPO), whose loss path (trainer.loss_path) the logits term follows."""
    e = bytes_per_element(precision)
    tokens = seq_len * micro_batch // sequence_parallel
    tiled_mlp = mlp_tiles >= 2 and not m.num_experts  # train.sequence_parallel.tile_mlps tiles gate/up/down MLPs
    one_layer = layer_activation_bytes(m, seq_len, micro_batch, precision, attention, padding_mask, sequence_parallel,
                                       tiled_mlp)
    ends = tokens * (rms_norm_bytes_per_token(m.hidden_size, e, m.liger) + 8)  # final norm + int64 token ids
    layer_input, host = e * tokens * m.hidden_size, 0
    if checkpointing and checkpoint_offload:
        kept = min(m.num_layers, OFFLOAD_KEPT_INPUTS)
        layers, host = kept * layer_input + one_layer, (m.num_layers - 1) * layer_input
    elif checkpointing:
        layers = m.num_layers * layer_input + one_layer
    else:
        layers = m.num_layers * one_layer
    if tiled_mlp:
        layers += mlp_tile_bytes(m, seq_len // sequence_parallel, micro_batch, mlp_tiles, precision)
    logits = logits_bytes(m, seq_len // sequence_parallel, micro_batch, precision, stage, logits_tiles, forward,
                          sequence_parallel)
    path = loss_path(forward, m.liger, stage, sequence_parallel, logits_tiles)
    return Activations(layers + ends, logits, layers + ends + logits, host, path)


def ulysses_all_to_all_bytes(m: ModelConfig, seq_len: int, micro_batch: int, sequence_parallel: int,
                             precision: str = "bf16") -> int:
    """Bytes one rank sends per layer per micro-batch in Ulysses' all-to-alls, forward and backward: q, k, v
    before attention and its output after it, each (sp-1)/sp of the rank's s/sp tokens leaving the rank; backward
    moves the same gradients the other way. Activation checkpointing recomputes the forward: counted once more."""
    if sequence_parallel == 1:
        return 0
    e, tokens = bytes_per_element(precision), seq_len * micro_batch // sequence_parallel
    forward = e * tokens * (2 * m.hidden_size + 2 * kv_width(m)) * (sequence_parallel - 1) // sequence_parallel
    return 2 * forward


def expert_all_to_all_bytes(m: ModelConfig, seq_len: int, micro_batch: int, expert_parallel: int,
                            precision: str = "bf16") -> int:
    """Bytes one GPU sends per MoE layer per micro-batch in AutoEP's all-to-alls: each token's hidden state goes to
    its top-k experts (dispatch) and comes back (combine), (ep-1)/ep of them to another GPU of the EP group when the
    router spreads tokens evenly; backward moves the same gradients the other way."""
    if expert_parallel == 1 or not m.num_experts:
        return 0
    e, k = bytes_per_element(precision), m.num_experts_per_tok or 2
    forward = 2 * e * seq_len * micro_batch * k * m.hidden_size * (expert_parallel - 1) // expert_parallel
    return 2 * forward


# --- working buffers ---------------------------------------------------------------------------


def reduce_bucket_bytes(stage: int, reduce_bucket_size: int, precision: str, overlap_comm: bool) -> int:
    """Gradient reduction buckets: stage 1/2 keep two (with overlap_comm) contiguous 16-bit buckets;
    stage 3 one. Stage 0 reduces through the optimizer's own buffers (not counted)."""
    if stage == 0:
        return 0
    count = 2 if (stage in (1, 2) and overlap_comm) else 1
    return count * reduce_bucket_size * bytes_per_element(precision)


def hpz_secondary_bytes(total_params: int, hpz_partition_size: int, precision: str) -> int:
    """ZeRO++ hpZ keeps a second, node-local partition of the 16-bit params: 2P / hpz per GPU."""
    if hpz_partition_size <= 1:
        return 0
    return int(bytes_per_element(precision) * total_params / hpz_partition_size)


# --- LoRA --------------------------------------------------------------------------------------


def lora_model_states(base_params: int, adapter_params: int, largest_layer: int, stage: int,
                      gpus_per_node: int, nodes: int, offload_optimizer: bool, offload_param: bool,
                      precision: str = "bf16") -> ModelStates:
    """Frozen 16-bit base (sharded at stage 3, on CPU with param offload) + adapters on DeepSpeed's accounting.

    The base is loaded in 16-bit on every rank first (zero.Init shards it at stage 3), which is the
    host-side cost added to the adapters' CPU number."""
    e = bytes_per_element(precision)
    adapters = model_states(adapter_params, largest_layer, stage, gpus_per_node, nodes,
                            offload_optimizer, offload_param, precision=precision)
    gpus = gpus_per_node * nodes
    if stage == 3:
        frozen_gpu = 0 if offload_param else int(e * base_params / gpus)
        frozen_cpu = int(e * base_params / nodes * ADDITIONAL_BUFFER_FACTOR) if offload_param else 0
    else:
        frozen_gpu = e * base_params
        frozen_cpu = int(e * base_params * gpus_per_node * ADDITIONAL_BUFFER_FACTOR)
    return ModelStates(adapters.gpu_bytes + frozen_gpu, adapters.cpu_bytes + frozen_cpu,
                       adapters.params + frozen_gpu, adapters.gradients, adapters.optimizer, adapters.working)


# --- preference tuning: the reference model ----------------------------------------------------------


def frozen_reference(total_params: int, largest_layer: int, stage: int, gpus_per_node: int, nodes: int,
                     offload: bool, precision: str = "bf16") -> tuple[int, int]:
    """(GPU bytes per rank, host bytes per node) of a frozen reference engine's weights (module docstring)."""
    e, gpus = bytes_per_element(precision), gpus_per_node * nodes
    if stage != 3:
        return e * total_params, 0
    gathered = e * largest_layer  # the module being run, gathered whole
    if offload:
        return gathered, int(e * total_params / nodes * ADDITIONAL_BUFFER_FACTOR)
    return int(e * total_params / gpus) + gathered, 0


def reference_forward_bytes(m: ModelConfig, seq_len: int, sequences: int, precision: str = "bf16",
                            attention: str = "sdpa", padding_mask: bool = True) -> int:
    """Peak of one forward without grad over `sequences` sequences: one layer's tensors and the logits, kept in the
    model's dtype and upcast to fp32 with their log-softmax (train/preference.py sequence_logps)."""
    e = bytes_per_element(precision)
    one_layer = layer_activation_bytes(m, seq_len, sequences, precision, attention, padding_mask)
    return one_layer + (e + 8) * seq_len * sequences * m.vocab_size


# --- NVMe (ZeRO-Infinity) ----------------------------------------------------------------------


def nvme_offload_bytes(total_params: int, nodes: int, optimizer: bool = True, params: bool = True) -> int:
    """NVMe per node for ZeRO-Infinity: the optimizer's fp32 master, moments and gradients (16P) and/or the
    16-bit params (2P) of the node's partitions, with DeepSpeed's 1.5x margin."""
    per_param = (16 if optimizer else 0) + (2 if params else 0)
    return int(per_param * total_params / nodes * ADDITIONAL_BUFFER_FACTOR)


def nvme_host_buffer_bytes(total_params: int, gpus: int, gpus_per_node: int, sub_group_size: int = int(1e9),
                           optimizer_buffer_count: int = 4, param_buffer_count: int = 5,
                           param_buffer_size: int = int(1e8), max_in_cpu: int = int(1e9)) -> int:
    """Host RAM per node for ZeRO-Infinity: each rank's pinned swap buffers. The optimizer swapper pins
    buffer_count fp32 buffers of the largest sub-group (swap_tensor/optimizer_utils.py SwapBufferManager);
    the param swapper buffer_count x buffer_size 16-bit elements, plus up to max_in_cpu params kept in RAM."""
    sub_group = min(sub_group_size, -(-total_params // gpus))
    per_rank = (optimizer_buffer_count * sub_group * FP32_BYTES
                + param_buffer_count * param_buffer_size * 2
                + min(max_in_cpu, total_params) * 2)
    return int(per_rank * gpus_per_node)


def seed_sharding_formula(total_params: int, stage: int, gpus: int) -> dict[str, float]:
    """The seed's table (step 1.3): 2 + 2 + 12 bytes/param, sharded per stage (16 bytes/param, no 1.5x)."""
    params, grads, optim = 2.0 * total_params, 2.0 * total_params, 12.0 * total_params
    if stage >= 1:
        optim /= gpus
    if stage >= 2:
        grads /= gpus
    if stage >= 3:
        params /= gpus
    return {"params": params, "gradients": grads, "optimizer": optim, "total": params + grads + optim}
