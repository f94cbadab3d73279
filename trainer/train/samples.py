"""Sample generations during training (`train.sample_prompts`): greedy completions at every eval, so the curves
come with text. Every rank runs `generate` on the same prompts: under ZeRO-3 each forward gathers the
partitioned parameters from all ranks (`synced_gpus` keeps the ranks stepping together until all are done),
and AutoTP ranks each hold a slice of every layer.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..data.chat_format import stop_token_ids
from ..data.prompts import completion_ids, encode_left_padded


def make_sampler(tokenizer, prompts: list[str], max_new_tokens: int):
    """A callable engine -> [{"prompt", "completion"}] (None without prompts)."""
    if not prompts:
        return None
    stops = stop_token_ids(tokenizer)  # EOS, and a chat template's end of turn

    @torch.no_grad()
    def sample(engine) -> list[dict]:
        batch = {k: v.to(engine.device) for k, v in encode_left_padded(tokenizer, prompts).items()}
        synced = engine.zero_optimization_stage() == 3 and dist.is_initialized() and dist.get_world_size() > 1
        engine.eval()
        try:
            out = engine.module.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, use_cache=True,
                                         synced_gpus=synced, pad_token_id=tokenizer.pad_token_id,
                                         eos_token_id=stops)
        finally:
            engine.train()
        width = batch["input_ids"].shape[1]
        return [{"prompt": prompt, "completion": tokenizer.decode(completion_ids(row[width:], stops),
                                                                 skip_special_tokens=True)}
                for prompt, row in zip(prompts, out.cpu())]

    return sample
