"""Rollouts on the trainer's own model: a batched sampler with a KV cache, and the ZeRO-3 gather around it.

`sample` continues left-padded prompts token by token with transformers' DynamicCache: one forward over the prompts,
then one token per forward for every row at once; a row that produced a stop token (EOS, a chat template's end of
turn) is padded from there on and the loop ends when every row has stopped or max_new_tokens is reached. The choice
of each token is temperature, then top-k, then top-p (transformers' order), drawn with the sampler's own
torch.Generator: the run's other randomness does not move it, and checkpoints keep its state per rank
(train/checkpoint.py), so a resumed run samples the same completions as an uninterrupted one.

Under ZeRO-3 each forward would gather every layer from all ranks, and ranks whose rows stop at different tokens
would run different numbers of forwards (a hang). `generation_model` instead gathers the whole model once with
deepspeed.zero.GatheredParameters and removes DeepSpeed's forward hooks for the time of the rollout (as TRL's
unwrap_model_for_generation and DeepSpeed-Chat's Hybrid Engine do); each rank then generates alone, and the hooks are
put back (the prefetch trace invalidated) before training. The gathered model must fit on one device; a model that
does not is a job for an external rollout engine (rl/external.py).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch


@contextlib.contextmanager
def generation_model(engine) -> Iterator[torch.nn.Module]:
    """The engine's module ready for local generation, in eval mode; ZeRO-3: gathered and without hooks."""
    module = engine.module
    was_training = module.training
    module.eval()
    try:
        if engine.zero_optimization_stage() != 3:
            yield module
            return
        import deepspeed
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            offload = _parameter_offload(engine)
            _remove_hooks(offload)
            try:
                yield module
            finally:
                _add_hooks(offload)
    finally:
        module.train(was_training)


def _parameter_offload(engine):
    optimizer = engine.optimizer
    if optimizer is None:
        return None
    return getattr(optimizer, "parameter_offload", optimizer)


def _remove_hooks(offload) -> None:
    if offload is None:
        return
    for param in _all_params(offload.module):
        param.ds_active_sub_modules.clear()
    for hook in list(offload.forward_hooks) + list(offload.backward_hooks):
        hook.remove()
    offload.forward_hooks, offload.backward_hooks = [], []


def _add_hooks(offload) -> None:
    if offload is None:
        return
    coordinator = getattr(offload, "param_coordinator", None)
    if coordinator is not None and not coordinator.is_invalid_trace():
        coordinator._invalidate_trace()
    offload._register_deepspeed_module(offload.module)


def _all_params(module) -> list:
    external = module.ds_external_parameters() if hasattr(module, "ds_external_parameters") else []
    return [p for _, p in module.named_parameters(recurse=True)] + [p for _, p in external]


def pick(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
         generator: torch.Generator | None) -> torch.Tensor:
    """One token per row: greedy when temperature is 0, else sampled after temperature, top-k and top-p."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = torch.sort(logits, descending=True, dim=-1)
        mass = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
        drop = mass - torch.softmax(ordered, dim=-1) >= top_p  # keep the smallest prefix whose mass reaches top_p
        ordered = ordered.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, ordered)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def cache_argument(model) -> str:
    """The forward's name for the KV cache: `cache` in transformers 5.x (past_key_values is deprecated there), or
    `past_key_values` (older models, PEFT wrappers that pass **kwargs through)."""
    import inspect
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


@torch.no_grad()
def sample(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int, stop_ids: list[int],
           pad_id: int, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(completion ids, completion mask), each (rows, width <= max_new_tokens): the tokens after each left-padded
    prompt up to and including its first stop token (the mask is 1 there, 0 after), pad_id after it."""
    from transformers import DynamicCache
    rows, device = input_ids.shape[0], input_ids.device
    stops = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    cache = DynamicCache()
    mask = attention_mask
    position = (mask.long().cumsum(-1) - 1).clamp(min=0)
    key = cache_argument(model)
    out = model(input_ids=input_ids, attention_mask=mask, position_ids=position, use_cache=True, **{key: cache})
    position = position[:, -1:]
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    tokens, kept = [], []
    for _ in range(max_new_tokens):
        token = pick(out.logits[:, -1, :], temperature, top_k, top_p, generator)
        token = torch.where(done, torch.full_like(token, pad_id), token)
        kept.append(~done)
        tokens.append(token)
        done = done | torch.isin(token, stops)
        if bool(done.all()) or len(tokens) == max_new_tokens:
            break
        mask = torch.cat([mask, torch.ones((rows, 1), dtype=mask.dtype, device=device)], dim=1)
        position = position + 1
        out = model(input_ids=token.unsqueeze(1), attention_mask=mask, position_ids=position, use_cache=True,
                    **{key: cache})  # the DynamicCache grows in place
    return torch.stack(tokens, dim=1), torch.stack(kept, dim=1).long()
