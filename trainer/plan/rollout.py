"""GRPO's rollout memory (train/rl/rollout.py): what generating on the trained model adds to the model states."""
from __future__ import annotations

from ..config import ModelConfig
from .memory import bytes_per_element, layer_activation_bytes



def kv_cache_bytes(m: ModelConfig, tokens: int, sequences: int, precision: str = "bf16") -> int:
    """Keys and values of every layer for `sequences` x `tokens` (prompt + completion) in the model's dtype."""
    head_dim = m.head_dim or m.hidden_size // m.num_heads
    return 2 * m.num_layers * (m.num_kv_heads or m.num_heads) * head_dim * bytes_per_element(precision) * tokens * sequences


def rollout_bytes(m: ModelConfig, total_params: int, stage: int, seq_len: int, sequences: int,
                  precision: str = "bf16", attention: str = "sdpa") -> int:
    """What generation adds on top of the model states (train/rl/rollout.py): under ZeRO-3 the whole model gathered
    (GatheredParameters), the KV cache of the rollout batch (`sequences` completions of up to seq_len tokens), the
    prompt's prefill through one layer, and one position's logits per row in fp32 with the sampler's softmax."""
    gathered = bytes_per_element(precision) * total_params if stage == 3 else 0
    prefill = layer_activation_bytes(m, seq_len, sequences, precision, attention, True)
    return gathered + kv_cache_bytes(m, seq_len, sequences, precision) + prefill + 12 * sequences * m.vocab_size
