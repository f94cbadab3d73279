"""A user's own script on DeepSpeed's Ulysses classes with one classic sequence-parallel mistake, for real failure
logs (tests/logs/real/sequence_parallel_*.log) that the doctor reads. Under `deepspeed --num_gpus 2`:
    python tests/workers/sp_mistakes.py MISTAKE
MISTAKE: heads (3 heads at SP 2), eager (eager attention), seq_len (127-token batches at SP 2), shuffled (each rank
of the group reads its own sample; the trainer's loss refuses it). Nothing here goes through the trainer's resolve,
which refuses all four before any step."""
import sys

import deepspeed
import torch
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
from transformers import AutoModelForCausalLM, LlamaConfig

SP, SEQ = 2, 64


def main(mistake: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    heads = 3 if mistake == "heads" else 4
    attention = "eager" if mistake == "eager" else "sdpa"
    config = LlamaConfig(hidden_size=16 * heads, num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=heads,
                         intermediate_size=64, vocab_size=256, max_position_embeddings=256, attn_implementation=attention)
    model = AutoModelForCausalLM.from_config(config)
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation=attention, sequence_parallel_size=SP, micro_batch_size=1,
        seq_length=SEQ, seq_length_is_variable=False)
    ds_config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                 "zero_optimization": {"stage": 2}, "sequence_parallel_size": SP}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config, mpu=mpu)
    if mistake == "shuffled":
        from trainer.train.sequence_parallel import loss_of
        torch.manual_seed(engine.global_rank)  # a per-rank sampler: the group's ranks draw different samples
        ids = torch.randint(0, 256, (1, SEQ))
        loss = loss_of(engine, {"input_ids": ids, "labels": ids.clone()})
    else:
        length = 127 if mistake == "seq_len" else SEQ
        batches = [{"input_ids": torch.randint(0, 256, (1, length)), "labels": torch.randint(0, 256, (1, length)),
                    "position_ids": torch.arange(length).view(1, -1)}]
        loader = UlyssesSPDataLoaderAdapter(batches, sp_rank=mpu.get_sequence_parallel_rank(),
                                            sp_group=mpu.get_sequence_parallel_group(), sp_world_size=SP,
                                            device=engine.device)
        batch = next(iter(loader))
        loss = engine(**{k: batch[k] for k in ("input_ids", "position_ids")}).logits.float().mean()
    engine.backward(loss)
    engine.step()


if __name__ == "__main__":
    main([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0])  # the launcher adds --local_rank
