"""GrpoObjective: the GRPO loss of a micro-batch as the loop (train/loop.py) asks for it, `objective(batch)`.

At the first micro-batch of a step whose iteration is 0, the objective makes the step's rollout: each of this rank's
prompts of the step (all its micro-batches') is completed grpo.num_generations times by the current policy
(rollout.py), scored by the reward functions (rewards.py), and turned into group-normalised advantages (loss.py);
with grpo.num_iterations > 1 the rollout-time log-probs are kept, with grpo.beta > 0 the reference's. Each micro-batch
then runs the policy over its completions and returns the clipped policy-gradient loss; the next num_iterations - 1
steps train on the same rollout. The rollout, and the sampler's generator, are part of every checkpoint
(`state_dict`, kept per rank in rng_rank<r>.json), so a resume in the middle of a cycle continues exactly.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from ..preference import Objective
from . import loss as grpo
from .rewards import build_rewards, score
from .rollout import generation_model, sample

METRIC_SUMS = ("completions", "reward", "reward_sq", "accuracy", "length", "kl", "low", "high", "region", "tokens",
               "entropy", "gen_tokens", "gen_seconds", "zero_std_groups", "groups", "truncated")


@dataclass
class Rollout:
    """One micro-batch's rollout: sequences (prompt + completion), masks, advantages, stored log-probs."""
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    advantages: torch.Tensor
    old_logps: Optional[torch.Tensor]
    ref_logps: Optional[torch.Tensor]
    step_tokens: float

    def to_state(self) -> dict:
        return {k: (v.cpu().tolist() if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}

    @classmethod
    def from_state(cls, state: dict, device) -> "Rollout":
        def tensor(key, dtype):
            return None if state[key] is None else torch.tensor(state[key], dtype=dtype, device=device)
        return cls(tensor("input_ids", torch.long), tensor("attention_mask", torch.long),
                   tensor("completion_mask", torch.long), tensor("advantages", torch.float32),
                   tensor("old_logps", torch.float32), tensor("ref_logps", torch.float32), float(state["step_tokens"]))


class GrpoObjective(Objective):
    def __init__(self, engine, cfg, tokenizer, prompts: list, reference: Optional[Callable], accumulation: int,
                 rank: int, world: int):
        super().__init__(engine)
        self.cfg, self.settings, self.tokenizer, self.prompts = cfg, cfg.grpo, tokenizer, prompts
        self.reference, self.accumulation, self.rank, self.world = reference, accumulation, rank, world
        self.rewards = build_rewards(cfg.grpo.rewards)
        self.weights = torch.tensor([r.weight for r in self.rewards], dtype=torch.float64)
        g = self.settings
        self.loss_settings = grpo.LossSettings(g.beta, g.epsilon, g.epsilon_high if g.epsilon_high is not None
                                               else g.epsilon, g.loss_type, g.max_new_tokens)
        from ...data.chat_format import stop_token_ids
        self.stops = stop_token_ids(tokenizer)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.generator = torch.Generator(device=engine.device)
        self.generator.manual_seed(cfg.train.seed * 1_000_003 + 7919 * rank + 1)
        self.buffer: Optional[list[Rollout]] = None
        self.rollout_sums: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # the rollout's metric sums
        self.sums = self._zero()
        self.window_start = time.perf_counter()
        self.names = [r.name for r in self.rewards]
        self.per_function = torch.zeros(len(self.rewards), dtype=torch.float64)

    # --- the loss -----------------------------------------------------------------------------------------------

    def __call__(self, batch: dict, record: bool = True) -> torch.Tensor:
        micro, iteration = int(batch["micro"]), int(batch["iteration"])
        generated = micro == 0 and (iteration == 0 or self.buffer is None)
        if generated:
            self.buffer = self.rollout(batch["prompts"])
        if micro == 0 and record and self.rollout_sums is not None:  # every step logs the rollout it trains on
            sums, per_function = self.rollout_sums
            if not generated:  # no generation this step: its time and tokens are not counted again
                sums = sums.clone()
                sums[METRIC_SUMS.index("gen_seconds")] = sums[METRIC_SUMS.index("gen_tokens")] = 0.0
            self.sums += sums
            self.per_function += per_function
        r = self.buffer[micro]
        width = r.completion_mask.shape[1]
        logits = self.engine(input_ids=r.input_ids, attention_mask=r.attention_mask, use_cache=False,
                             logits_to_keep=width + 1).logits  # the completion's positions only
        logps, entropies = grpo.completion_logps(logits, r.input_ids, width, self.settings.temperature)
        loss, stats = grpo.grpo_loss(logps, r.old_logps, r.ref_logps, r.advantages, r.completion_mask,
                                     self.loss_settings, self.accumulation, r.step_tokens, self.world)
        if record:
            mask = r.completion_mask.to(entropies.dtype)
            for key in ("kl", "low", "high", "region", "tokens"):
                if key in stats:
                    self.sums[METRIC_SUMS.index(key)] += float(stats[key])
            self.sums[METRIC_SUMS.index("entropy")] += float((entropies * mask).sum())
        return loss

    def weight(self, batch: dict) -> torch.Tensor:
        return torch.tensor(1)

    # --- the rollout --------------------------------------------------------------------------------------------

    def _left_padded(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row):] = 1
        return ids.to(self.engine.device), mask.to(self.engine.device)

    @torch.no_grad()
    def generate(self, records: list, greedy: bool = False) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                             torch.Tensor]]:
        """[(prompt ids, prompt mask, completion ids, completion mask)] per chunk of micro_batch_size rows."""
        g = self.settings
        chunk = max(1, self.cfg.train.micro_batch_size)
        out = []
        with generation_model(self.engine) as model:
            for first in range(0, len(records), chunk):
                part = records[first:first + chunk]
                ids, mask = self._left_padded([r.ids for r in part])
                completion, kept = sample(model, ids, mask, g.max_new_tokens, self.stops, self.pad,
                                          0.0 if greedy else g.temperature, g.top_k, g.top_p, self.generator)
                out.append((ids, mask, completion, kept))
        return out

    def decode(self, completion: torch.Tensor, kept: torch.Tensor) -> list[str]:
        texts = []
        for row, mask in zip(completion.tolist(), kept.tolist()):
            tokens = [t for t, m in zip(row, mask) if m and t not in self.stops]
            texts.append(self.tokenizer.decode(tokens, skip_special_tokens=True))
        return texts

    def score(self, records: list, chunks) -> tuple[torch.Tensor, list[int]]:
        """(completions, functions) rewards and each completion's token count."""
        texts, lengths = [], []
        for _, _, completion, kept in chunks:
            texts += self.decode(completion, kept)
            lengths += kept.sum(-1).tolist()
        table = score(self.rewards, [r.text for r in records], texts, [r.answer for r in records], lengths)
        return torch.tensor(table, dtype=torch.float64).T.reshape(len(texts), len(self.rewards)), lengths

    def rollout(self, prompt_index: torch.Tensor) -> list[Rollout]:
        g, started = self.settings, time.perf_counter()
        per_micro = prompt_index.shape[1]
        records = [self.prompts[int(i)] for i in prompt_index.reshape(-1).tolist() for _ in range(g.num_generations)]
        chunks = self.generate(records)
        gen_seconds = time.perf_counter() - started
        per_function, lengths = self.score(records, chunks)
        rewards = grpo.weighted_rewards(per_function, self.weights)
        batch_std = None
        if g.scale_rewards == "batch":
            batch_std = grpo.nanstd(gather_all(rewards, self.engine.device))
        advantages = grpo.group_advantages(rewards, g.num_generations, g.scale_rewards, batch_std).float()
        step_tokens = float(all_sum(torch.tensor([float(sum(lengths))], dtype=torch.float64), self.engine.device)[0])
        rollouts = []
        rows = per_micro * g.num_generations
        for k, (ids, mask, completion, kept) in enumerate(chunks):
            sequences = torch.cat([ids, completion], dim=1)
            full_mask = torch.cat([mask, kept], dim=1)
            width = completion.shape[1]
            old = ref = None
            if g.num_iterations > 1:
                old = self.logps_of(lambda i, m: self.engine(input_ids=i, attention_mask=m, use_cache=False,
                                                             logits_to_keep=width + 1).logits,
                                    sequences, full_mask, width)
            if g.beta != 0.0 and self.reference is not None:
                ref = self.logps_of(self.reference, sequences, full_mask, width)
            rollouts.append(Rollout(sequences, full_mask, kept, advantages[k * rows:(k + 1) * rows].to(
                self.engine.device), old, ref, step_tokens))
        self.rollout_sums = self.rollout_metrics(per_function, rewards, lengths, gen_seconds)
        return rollouts

    @torch.no_grad()
    def logps_of(self, forward: Callable, ids: torch.Tensor, mask: torch.Tensor, width: int) -> torch.Tensor:
        was = self.engine.module.training
        self.engine.module.eval()
        try:
            return grpo.completion_logps(forward(ids, mask), ids, width, self.settings.temperature, False)[0].float()
        finally:
            self.engine.module.train(was)

    # --- metrics --------------------------------------------------------------------------------------------

    def _zero(self) -> torch.Tensor:
        return torch.zeros(len(METRIC_SUMS), dtype=torch.float64)

    def rollout_metrics(self, per_function: torch.Tensor, rewards: torch.Tensor, lengths: list[int],
                        gen_seconds: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The rollout's contribution to the window's sums (and the reward functions' sums)."""
        s, i = self._zero(), METRIC_SUMS.index
        g = self.settings.num_generations
        s[i("completions")] += len(rewards)
        s[i("reward")] += float(rewards.sum())
        s[i("reward_sq")] += float((rewards ** 2).sum())
        if "exact_match" in self.names:
            s[i("accuracy")] += float(per_function[:, self.names.index("exact_match")].sum())
        s[i("length")] += float(sum(lengths))
        s[i("gen_tokens")] += float(sum(lengths))
        s[i("gen_seconds")] += gen_seconds
        s[i("truncated")] += float(sum(1 for n in lengths if n >= self.settings.max_new_tokens))
        grouped = rewards.view(-1, g)
        s[i("groups")] += grouped.shape[0]
        s[i("zero_std_groups")] += float((grouped.max(dim=1).values == grouped.min(dim=1).values).sum())
        return s, per_function.sum(0)

    def metrics(self, device, prefix: str = "") -> dict:
        """The window's GRPO metrics over every rank (one all-reduce; every rank calls it at the same step)."""
        packed = all_sum(torch.cat([self.sums, self.per_function]), device)
        sums = dict(zip(METRIC_SUMS, packed[:len(METRIC_SUMS)].tolist()))
        per_function = packed[len(METRIC_SUMS):].tolist()
        wall = time.perf_counter() - self.window_start
        self.sums, self.per_function = self._zero(), torch.zeros_like(self.per_function)
        self.window_start = time.perf_counter()
        n, tokens = sums["completions"], sums["tokens"]
        out = {}
        if n:
            mean = sums["reward"] / n
            variance = max(0.0, sums["reward_sq"] / n - mean * mean) * (n / (n - 1) if n > 1 else 1.0)
            out.update({"reward/mean": mean, "reward/std": math.sqrt(variance),
                        **{f"reward/{name}": value / n for name, value in zip(self.names, per_function)},
                        "completion_length": sums["length"] / n,
                        "completions_truncated": sums["truncated"] / n,
                        "groups_without_signal": sums["zero_std_groups"] / max(sums["groups"], 1.0),
                        "rollout_tokens_per_s": sums["gen_tokens"] / max(sums["gen_seconds"], 1e-9),
                        "gen_share": sums["gen_seconds"] / self.world / max(wall, 1e-9)})
            if "exact_match" in self.names:
                out["accuracy"] = sums["accuracy"] / n
        if tokens:
            out.update({"entropy": sums["entropy"] / tokens, "clip_ratio": sums["region"] / tokens,
                        "clip_ratio/low": sums["low"] / tokens, "clip_ratio/high": sums["high"] / tokens})
            if self.settings.beta != 0.0:
                out["kl"] = sums["kl"] / tokens
        return {prefix + k: v for k, v in out.items()}

    @contextlib.contextmanager
    def apart(self) -> Iterator[None]:
        kept = (self.sums, self.per_function)
        self.sums, self.per_function = self._zero(), torch.zeros_like(self.per_function)
        try:
            yield
        finally:
            self.sums, self.per_function = kept

    # --- evaluation -----------------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, eval_set) -> dict:
        """Mean reward (and accuracy) of one completion per eval prompt (greedy unless grpo.eval_greedy is off),
        the prompts dealt to the ranks; every rank takes part (the ZeRO-3 gather is collective)."""
        records = getattr(eval_set, "records", eval_set)
        mine = records[self.rank::self.world]
        state = self.generator.get_state()
        try:
            chunks = self.generate(mine, greedy=self.settings.eval_greedy)  # every rank: ZeRO-3 gathers together
        finally:
            self.generator.set_state(state)  # evaluation does not move the training sampler
        if mine:
            per_function, lengths = self.score(mine, chunks)
            rewards = grpo.weighted_rewards(per_function, self.weights)
            accuracy = (float(per_function[:, self.names.index("exact_match")].sum()) if "exact_match" in self.names
                        else 0.0)
            local = [float(len(mine)), float(rewards.sum()), accuracy, float(sum(lengths))]
        else:
            local = [0.0, 0.0, 0.0, 0.0]
        n, reward, accuracy, length = all_sum(torch.tensor(local, dtype=torch.float64), self.engine.device).tolist()
        out = {"eval_reward/mean": reward / max(n, 1.0), "eval_completion_length": length / max(n, 1.0),
               "eval_prompts": int(n)}
        if "exact_match" in self.names:
            out["eval_accuracy"] = accuracy / max(n, 1.0)
        return out

    # --- checkpoints ----------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """This rank's sampler generator and the current rollout (a resume mid-cycle trains on the same one)."""
        return {"sampler": self.generator.get_state().tolist(),
                "rollout": [r.to_state() for r in self.buffer] if self.buffer is not None else None,
                "rollout_sums": [t.tolist() for t in self.rollout_sums] if self.rollout_sums is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(torch.tensor(state["sampler"], dtype=torch.uint8))
        rollout = state.get("rollout")
        self.buffer = [Rollout.from_state(r, self.engine.device) for r in rollout] if rollout else None
        sums = state.get("rollout_sums")
        self.rollout_sums = tuple(torch.tensor(t, dtype=torch.float64) for t in sums) if sums else None


def all_sum(values: torch.Tensor, device) -> torch.Tensor:
    values = values.to(device)
    if dist.is_initialized():
        dist.all_reduce(values)
    return values.cpu()


def gather_all(values: torch.Tensor, device) -> torch.Tensor:
    values = values.to(device)
    if not dist.is_initialized():
        return values.cpu()
    every = [torch.zeros_like(values) for _ in range(dist.get_world_size())]
    dist.all_gather(every, values)
    return torch.cat(every).cpu()


@torch.no_grad()
def evaluate_prompts(model, tokenizer, records: list, cfg, device, greedy: bool = True, seed: int = 0,
                     share: tuple[int, int] = (0, 1)) -> dict:
    """`evaluate --task grpo`: one completion per prompt by a plain model (greedy, or sampled with grpo's settings
    and `seed`), scored by cfg.grpo.rewards; `share` = (this rank's share, shares): the prompts dealt to the ranks
    and the sums added up. Returns reward/mean, reward/<name>, accuracy (with exact_match) and completion_length."""
    from ...data.chat_format import stop_token_ids
    g = cfg.grpo
    built = build_rewards(g.rewards)
    names, weights = [r.name for r in built], torch.tensor([r.weight for r in built], dtype=torch.float64)
    stops = stop_token_ids(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    mine = records[share[0]::share[1]]
    chunk = max(1, int(cfg.train.micro_batch_size) if isinstance(cfg.train.micro_batch_size, int) else 8)
    texts, lengths = [], []
    model.eval()
    for first in range(0, len(mine), chunk):
        part = mine[first:first + chunk]
        width = max(len(r.ids) for r in part)
        ids = torch.full((len(part), width), pad, dtype=torch.long)
        mask = torch.zeros((len(part), width), dtype=torch.long)
        for i, r in enumerate(part):
            ids[i, width - len(r.ids):] = torch.tensor(r.ids)
            mask[i, width - len(r.ids):] = 1
        completion, kept = sample(model, ids.to(device), mask.to(device), g.max_new_tokens, stops, pad,
                                  0.0 if greedy else g.temperature, g.top_k, g.top_p, generator)
        for row, m in zip(completion.tolist(), kept.tolist()):
            texts.append(tokenizer.decode([t for t, k in zip(row, m) if k and t not in stops],
                                          skip_special_tokens=True))
            lengths.append(sum(m))
    sums = torch.zeros(3 + len(built), dtype=torch.float64)
    if mine:
        table = torch.tensor(score(built, [r.text for r in mine], texts, [r.answer for r in mine], lengths),
                             dtype=torch.float64).T
        sums[0], sums[1], sums[2] = len(mine), float(grpo.weighted_rewards(table, weights).sum()), float(sum(lengths))
        sums[3:] = table.sum(0)
    sums = all_sum(sums, device) if share[1] > 1 else sums
    n = max(float(sums[0]), 1.0)
    out = {"reward/mean": float(sums[1]) / n, **{f"reward/{name}": float(v) / n for name, v in
                                                  zip(names, sums[3:].tolist())},
           "completion_length": float(sums[2]) / n, "prompts": int(sums[0])}
    if "exact_match" in names:
        out["accuracy"] = out["reward/exact_match"]
    return out

