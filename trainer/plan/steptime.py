"""A first-order step time for comparing configurations of one run (the doctor's OOM ladder ranks the changes
that fit by it): compute at a realistic share of the GPU's peak, plus the bytes each choice moves that the
others do not. Absolute seconds are rough; the order between two configs of the same model and GPUs is what it
is for.

    compute      6 x active params x tokens (8 x with activation checkpointing: the forward runs twice), at
                 MFU_AT_FULL_MICRO of the dense 16-bit peak; a micro-step of few tokens runs the GPU below that
                 (EFFICIENT_TOKENS: the tokens per micro-step at which half the loss is recovered)
    ZeRO         stage 0-2: gradients reduced once per step (2 x 2 bytes/param, reduce-scatter + all-gather);
                 stage 3: the 16-bit parameters gathered in forward and backward and the gradients
                 reduce-scattered every micro-step (3 x 2 bytes/param per micro-step): ZeRO's 1.5x volume, paid
                 grad_accum times
    offload      optimizer on CPU: the fp32 step on the host (CPU_ADAM_PARAMS_PER_S_PER_NODE, shared by its ranks:
                 16 bytes of fp32 states read and written per parameter, memory-bound), the 16-bit gradients over
                 PCIe every micro-step (accumulated in host memory), the parameters back once per step;
                 parameters on CPU: the 16-bit partition over
                 PCIe in forward and backward of every micro-step; NVMe: the same bytes at NVME_BYTES_PER_S
Bandwidths: NVLink inside a node, PCIe otherwise, the inter-node fabric across nodes (one figure each, below).
"""
from __future__ import annotations

from .estimate import Candidate
from .inputs import PlanInputs

MFU_AT_FULL_MICRO = 0.45
EFFICIENT_TOKENS = 256
BUS_BYTES_PER_S = {"nvlink": 150e9, "infinity-fabric": 100e9, "pcie": 12e9, "none": 12e9}
INTER_NODE_BYTES_PER_S = 12e9
PCIE_BYTES_PER_S = 12e9
NVME_BYTES_PER_S = 3e9
CPU_ADAM_PARAMS_PER_S_PER_NODE = 1.0e9  # DeepSpeedCPUAdam on all of a host's cores, shared by its ranks


def step_seconds(inputs: PlanInputs, candidate: Candidate, micro_batch: int, grad_accum: int,
                 checkpointing: bool) -> float:
    """Seconds of one optimizer step (grad_accum micro-steps of micro_batch sequences) on one rank."""
    tokens = micro_batch * inputs.seq_len * inputs.sequences_per_sample // inputs.sp
    trained = inputs.lora_params if inputs.lora_enabled else inputs.params
    flops_per_token = (8 if checkpointing else 6) * inputs.active_params
    efficiency = MFU_AT_FULL_MICRO * tokens / (tokens + EFFICIENT_TOKENS)
    compute = grad_accum * flops_per_token * tokens / (inputs.gpu.peak_tflops * 1e12 * efficiency)
    return compute + _communication(inputs, candidate, grad_accum, trained) + _offload(inputs, candidate,
                                                                                     grad_accum, trained)


def _communication(inputs: PlanInputs, candidate: Candidate, grad_accum: int, trained: int) -> float:
    ranks = inputs.data_parallel_size
    if ranks == 1:
        return 0.0
    bandwidth = INTER_NODE_BYTES_PER_S if inputs.nodes > 1 else BUS_BYTES_PER_S[inputs.gpu.interconnect]
    share = (ranks - 1) / ranks
    gradients = 2 * 2 * trained * share / bandwidth
    if candidate.stage < 3:
        return gradients
    return grad_accum * 3 * 2 * inputs.params * share / bandwidth


def _offload(inputs: PlanInputs, candidate: Candidate, grad_accum: int, trained: int) -> float:
    shard = trained / inputs.data_parallel_size
    seconds = 0.0
    if candidate.offload_optimizer != "none":
        link = NVME_BYTES_PER_S if candidate.offload_optimizer == "nvme" else PCIE_BYTES_PER_S
        # 16-bit gradients leave the GPU every micro-step (accumulated in host memory), parameters return once
        moved = 2 * shard * (grad_accum + 1) + (2 * 12 * shard if candidate.offload_optimizer == "nvme" else 0)
        seconds += shard * inputs.gpus_per_node / CPU_ADAM_PARAMS_PER_S_PER_NODE + moved / link
    if candidate.offload_param != "none":
        link = NVME_BYTES_PER_S if candidate.offload_param == "nvme" else PCIE_BYTES_PER_S
        seconds += grad_accum * 2 * 2 * inputs.params / inputs.data_parallel_size / link
    return seconds
