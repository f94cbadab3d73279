"""What DeepSpeed's activation checkpoint offload (activation_checkpointing.cpu_checkpointing) moves to host memory
on the trainer's own checkpointing path (trainer.model.enable_gradient_checkpointing), for tests/
test_checkpoint_offload.py. One process, one rank:
    python tests/workers/checkpoint_offload.py LAYERS MICRO SEQ
prints one JSON line: the offload engine's counters after a forward and backward, and the largest difference of the
loss and of any gradient from the same model checkpointed without offload.

A CPU accelerator is "synchronized" (no side stream), and DeepSpeed 0.19.8 then leaves every checkpoint where it
is; here it is told otherwise, the one property of a GPU this machine lacks, so its offload engine runs: the
same bookkeeping, copies between host buffers instead of over PCIe."""
import copy
import json
import sys

import deepspeed
import torch
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.activation_checkpointing import checkpointing
from transformers import LlamaConfig, LlamaForCausalLM

from trainer.model import enable_gradient_checkpointing

HIDDEN, VOCAB = 64, 256


def loss_and_grads(model, ids) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def main(layers: int, micro: int, seq: int) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    get_accelerator().is_synchronized_device = lambda: False
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=4,
                         intermediate_size=128, max_position_embeddings=seq)
    torch.manual_seed(0)
    plain = LlamaForCausalLM(config).train()
    offloaded = copy.deepcopy(plain)
    ids = torch.randint(0, VOCAB, (micro, seq))
    plain.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    reference, reference_grads = loss_and_grads(plain, ids)
    enable_gradient_checkpointing(offloaded, {"train_batch_size": micro, "activation_checkpointing": {
        "partition_activations": False, "cpu_checkpointing": True}})
    loss, grads = loss_and_grads(offloaded, ids)
    stats = checkpointing._cpu_offload_engine.stats
    print(json.dumps({"offloaded_bytes": stats.offloaded_bytes, "offloaded_tensors": stats.offloaded_tensors,
                      "restored_bytes": stats.restored_bytes, "kept_last_tensors": stats.kept_last_tensors,
                      "loss_difference": float((loss - reference).abs()),
                      "grad_difference": max(float((grads[k] - reference_grads[k]).abs().max()) for k in grads)}))


if __name__ == "__main__":
    main(*(int(arg) for arg in sys.argv[1:4]))
