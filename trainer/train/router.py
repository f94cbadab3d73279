"""Router health of Mixture-of-Experts models for metrics.jsonl: each log line gets the router's load-balancing
(auxiliary) loss and how unevenly the experts receive tokens, over the micro-batches of the log window and all ranks.

    router_aux_loss             transformers' load_balancing_loss_func (Switch Transformer eq. 4-6): num_experts x
                                sum over experts of (share of top-k assignments x mean router probability), pooled
                                over layers; 1.0 x top_k is perfectly even, num_experts x top_k all on one expert.
    expert_share_max_over_mean  the busiest expert's tokens over the mean expert's, in the worst layer (1.0 = even;
                                num_experts / top_k = every token on the same top_k experts).
    expert_share_min_over_mean  the idlest expert's, in the worst layer (0.0 = an expert that gets no token: dead).

The numbers come from forward hooks on the routers (found from the model: trainer.moe.routers), so they are logged
whether or not the aux loss is added to the training loss (model.output_router_logits). Evaluation forwards, the
reference forward of a LoRA preference run (this model with its adapter off, inside `uncounted()`) and the
recomputation of gradient checkpointing (which runs inside backward) are not counted. Grad mode cannot tell the
reference apart: DeepSpeed's activation checkpointing runs the training forward without grad too.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from .. import moe


_uncounted = False  # set inside uncounted(): the forwards are not training traffic


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Forwards run inside are left out of the router metrics."""
    global _uncounted
    before, _uncounted = _uncounted, True
    try:
        yield
    finally:
        _uncounted = before


class RouterWatch:
    """Counts, per router (layer), how many top-k assignments each expert got and the router probabilities' sum."""

    def __init__(self, routers: list[tuple[str, torch.nn.Module, int]], top_k: int):
        self.top_k = top_k
        self.layers = len(routers)
        self.counts: Optional[torch.Tensor] = None     # (layers, experts)
        self.prob_sums: Optional[torch.Tensor] = None  # (layers, experts)
        self.rows = 0.0                                # tokens routed, per layer
        self.handles = [module.register_forward_hook(self._hook(layer, index))
                        for layer, (_, module, index) in enumerate(routers)]

    @classmethod
    def attach(cls, model: torch.nn.Module) -> Optional["RouterWatch"]:
        """A watch on the model's routers; None for a dense model."""
        found = moe.routers(model)
        if not found:
            return None
        return cls(found, moe.experts_per_token(model))

    def _hook(self, layer: int, index: int):
        def record(module, inputs, output):
            if not module.training or _uncounted or torch._C._current_graph_task_id() != -1:
                return  # eval, a reference forward, or a checkpoint's recompute inside backward
            logits = (output[index] if isinstance(output, (tuple, list)) else output).detach().float()
            self.add(layer, logits.reshape(-1, logits.shape[-1]))
        return record

    @torch.no_grad()
    def add(self, layer: int, logits: torch.Tensor) -> None:
        experts = logits.shape[-1]
        if self.counts is None:
            self.counts = torch.zeros(self.layers, experts, dtype=torch.float64, device=logits.device)
            self.prob_sums = torch.zeros_like(self.counts)
        probs = torch.softmax(logits, dim=-1)
        chosen = torch.topk(probs, min(self.top_k, experts), dim=-1).indices.reshape(-1)
        self.counts[layer] += torch.bincount(chosen, minlength=experts).to(self.counts.dtype)
        self.prob_sums[layer] += probs.sum(dim=0).to(self.prob_sums.dtype)
        if layer == 0:
            self.rows += logits.shape[0]

    def window(self, device) -> dict:
        """The log window's router metrics across ranks (a collective: every rank calls it at the same step), then a
        fresh window. Empty when no training forward was seen."""
        if self.counts is None:
            return {}
        packed = torch.cat([self.counts.flatten(), self.prob_sums.flatten(),
                            torch.tensor([self.rows], dtype=torch.float64, device=self.counts.device)]).to(device)
        if dist.is_initialized():
            dist.all_reduce(packed)
        layers, experts = self.counts.shape
        counts = packed[:layers * experts].reshape(layers, experts)
        prob_sums = packed[layers * experts:2 * layers * experts].reshape(layers, experts)
        rows = float(packed[-1]) * layers
        self.counts, self.prob_sums, self.rows = None, None, 0.0
        if rows == 0:
            return {}
        return {"router_aux_loss": aux_loss(counts, prob_sums, rows),
                **expert_shares(counts)}

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def aux_loss(counts: torch.Tensor, prob_sums: torch.Tensor, rows: float) -> float:
    """transformers' load_balancing_loss_func from the pooled sums: E x sum_e (f_e x P_e), f_e the top-k assignments
    of expert e per routed row and P_e its mean probability, both over every layer's rows."""
    experts = counts.shape[-1]
    return float(experts * ((counts.sum(0) / rows) * (prob_sums.sum(0) / rows)).sum())


def expert_shares(counts: torch.Tensor) -> dict:
    mean = counts.mean(dim=1).clamp_min(1e-12)
    return {"expert_share_max_over_mean": float((counts.max(dim=1).values / mean).max()),
            "expert_share_min_over_mean": float((counts.min(dim=1).values / mean).min())}


def router_metrics(watch: Optional[RouterWatch], device) -> dict:
    """The log line's router fields; none for a dense model."""
    return watch.window(device) if watch is not None else {}
