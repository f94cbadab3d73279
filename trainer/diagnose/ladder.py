"""The OOM ladder, priced by the planner: every rung is the preset with one change, estimated with the same
`plan_for_resolved` that `python -m trainer plan` prints, and the cheapest change that fits comes first.

The rungs, in order of cost (seed step 7.1, with DeepSpeed ALST's for long sequences where the planner puts them):
1 smaller micro-batch (same global batch), 2 activation checkpointing, 3 ZeRO stage up (0/1 -> 2 -> 3), 3b tiled
logits + loss, 3c tiled MLP, 3d sequence parallelism (same global batch), 4 optimizer offload to CPU, 4b parameter
offload, 4c activation checkpoints in host memory, 5 smaller stage-3 buffers, 6 NVMe offload, 7 LoRA. The
long-context rungs (3b-3d, 4c) exist only for long sequences, where one rank's share of one sequence spans two of
ALST's MLP tiles (2 x hidden_size tokens) or more, and only where they change something (a rank's logits of 1 GiB
or more, a larger valid Ulysses size); like every rung, each is proposed only where it fits. The phase decides which rungs can help at all: before the first step
and at the optimizer step no activations are live (only model states can move), and a ZeRO-3 gather is
bounded by the prefetch and live-parameter limits first.

The estimate is calibrated with the log when the log comes from the preset's GPU: what PyTorch had allocated
plus what it tried to allocate is what the run really needed; the part the planner does not account for is
added to every rung, scaled with the rung's activations (the states are DeepSpeed's exact estimators, the
activations the uncertain part). A change is proposed only when it fits by that estimate; when no single
change does, the cheapest combination that fits; when nothing on the ladder fits, the doctor says so.
"""
from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass, replace
from typing import Callable, Optional

from .. import ds as dsc
from .. import hardware
from ..errors import UserError
from ..loss_path import fused_loss_possible
from ..plan.estimate import Candidate, Estimate, gb, inputs_for_resolved, plan_for_resolved
from ..plan.steptime import step_seconds
from ..plan.inputs import sequence_parallel_sizes
from ..resolve import LOGITS_TILE_BYTES, Resolved, alst_mlp_tiles
from .findings import Found, Proposal, Reresolve, first_error_line, planned

Rung = Callable[[Resolved], Optional[Proposal]]
NVME_PLACEHOLDER = "/local_nvme"  # the NVMe rungs' path: the user points it at their NVMe mount
GIB = 2 ** 30
SAME_GPU = 0.08  # a log whose GPU capacity is within 8% of the preset's GPU comes from that GPU


# --- the rungs -----------------------------------------------------------------------------------------------


def smaller_micro_batch(r: Resolved, smaller: Optional[int] = None) -> Optional[Proposal]:
    """The next smaller divisor of the micro-batch (or `smaller`), with the accumulation that keeps the global batch."""
    micro, accum = r.batch.micro_batch_size, r.batch.grad_accum
    if micro == 1:
        return None
    smaller = smaller or max(d for d in range(1, micro) if micro % d == 0)
    return Proposal("1. smaller micro-batch", [f"train.micro_batch_size={smaller}",
                                               f"train.grad_accum={accum * micro // smaller}"],
                    f"activations scale with the micro-batch; {micro} -> {smaller} with grad_accum "
                    f"{accum} -> {accum * micro // smaller} keeps the global batch ({r.batch.global_batch_size})")


def _micro_batch_one(r: Resolved) -> Optional[Proposal]:
    return smaller_micro_batch(r, 1)


def activation_checkpointing(r: Resolved) -> Optional[Proposal]:
    if r.config.model.gradient_checkpointing:
        return None
    return Proposal("2. activation checkpointing", ["model.gradient_checkpointing=true"],
                    "keeps only each layer's input and recomputes the rest in backward: activations drop to "
                    "~1/20 for ~30% more compute")


def stage_up(r: Resolved) -> Optional[Proposal]:
    stage = dsc.zero_stage(r.ds)
    if stage == 3 or r.world_size < 2:  # one rank: a higher stage shards across nobody
        return None
    target = 2 if stage < 2 else 3
    new = dsc.base_config(target, dsc.offload_optimizer_device(r.ds), "none")
    what = "gradients and optimizer states" if target == 2 else "parameters too"
    return Proposal(f"3. ZeRO stage {stage} -> {target}", dsc.zero_overrides(r.ds, new),
                    f"stage {target} shards {what} across the {r.world_size} ranks"
                    + (" (same communication as stage 1)" if target == 2 else " (~1.5x communication)"))


def long_sequence(r: Resolved) -> bool:
    """One rank's share of one sequence spans at least two of ALST's MLP tiles (hidden_size tokens each)."""
    return alst_mlp_tiles(r.config.model.hidden_size, r.config.data.seq_len, dsc.sequence_parallel_size(r.ds), 1) >= 2


def tiled_logits(r: Resolved) -> Optional[Proposal]:
    m, sp = r.config.model, dsc.sequence_parallel_size(r.ds)
    logits = 4 * r.config.data.seq_len // sp * r.batch.micro_batch_size * m.vocab_size  # fp32, one rank's share
    fused = fused_loss_possible(r.config.data.task, m.liger, dsc.zero_stage(r.ds), sp)  # no logits to tile
    if not long_sequence(r) or (m.tiled_logits or 0) >= 2 or logits < LOGITS_TILE_BYTES or m.tie_word_embeddings \
            or fused:
        return None
    if dsc.precision(r.ds) == "fp16" or r.config.data.task == "preference":
        return None
    tiles = -(-logits // LOGITS_TILE_BYTES)
    return Proposal("3b. tiled logits + loss", [f"model.tiled_logits={tiles}"],
                    f"the LM head and loss in {tiles} tiles along the sequence (DeepSpeed's TiledFusedLogitsLoss): "
                    f"one tile's fp32 logits exist at a time instead of {logits / GIB:.1f} GiB")


def tiled_mlp(r: Resolved) -> Optional[Proposal]:
    m, sp = r.config.model, dsc.sequence_parallel_size(r.ds)
    tiles = alst_mlp_tiles(m.hidden_size, r.config.data.seq_len, sp, r.batch.micro_batch_size)
    if not long_sequence(r) or m.tiled_mlp >= 2 or not m.gradient_checkpointing or m.num_experts:
        return None
    return Proposal("3c. tiled MLP", [f"model.tiled_mlp={tiles}"],
                    f"each MLP in {tiles} tiles of ~hidden_size tokens (DeepSpeed's TiledMLP): no layer keeps its "
                    f"SwiGLU tensors whole; one more MLP forward per layer in backward")


def sequence_parallel(r: Resolved) -> Optional[Proposal]:
    """The next Ulysses size that can work, with the accumulation that keeps the global batch: an SP group of n
    ranks trains one sequence, so the data-parallel ranks drop by n / sp."""
    sp, accum = dsc.sequence_parallel_size(r.ds), r.batch.grad_accum
    larger = [n for n in sequence_parallel_sizes(inputs_for_resolved(r)) if n > sp and n % sp == 0]
    if not long_sequence(r) or not larger or dsc.autotp_size(r.ds) > 1 or dsc.autoep_size(r.ds) > 1 \
            or r.config.data.task == "preference":
        return None
    n = larger[0]
    return Proposal(f"3d. sequence parallel {sp} -> {n}", [f"deepspeed.sequence_parallel_size={n}",
                                                           f"train.grad_accum={accum * n // sp}"],
                    f"DeepSpeed Ulysses: each GPU holds {r.config.data.seq_len // n} of the {r.config.data.seq_len} "
                    f"tokens' activations (an all-to-all per attention); grad_accum {accum} -> {accum * n // sp} "
                    f"keeps the global batch ({r.batch.global_batch_size})")


def checkpoint_offload(r: Resolved) -> Optional[Proposal]:
    if not long_sequence(r) or not r.config.model.gradient_checkpointing or dsc.cpu_checkpointing(r.ds):
        return None
    return Proposal("4c. activation checkpoints in host memory",
                    dsc.activation_checkpointing_overrides(r.config.deepspeed, True, offload=True),
                    "DeepSpeed's cpu_checkpointing keeps every layer's checkpointed input but the newest in pinned "
                    "host RAM until its backward (ALST's checkpoint offload): PCIe traffic of all of them, twice "
                    "a micro-step")


def optimizer_offload(r: Resolved) -> Optional[Proposal]:
    stage = dsc.zero_stage(r.ds)
    if stage == 0 or dsc.offload_optimizer_device(r.ds) != "none":
        return None
    new = dsc.base_config(stage, "cpu", dsc.offload_param_device(r.ds))
    return Proposal("4. optimizer offload to CPU", dsc.zero_overrides(r.ds, new),
                    "fp32 master weights, Adam moments and fp32 gradients move to host RAM (12-16 bytes/param "
                    "off the GPU); the step runs on the CPU - launch with --bind_cores_to_rank")


def param_offload(r: Resolved) -> Optional[Proposal]:
    if dsc.zero_stage(r.ds) != 3 or dsc.offload_param_device(r.ds) != "none":
        return None
    new = dsc.base_config(3, dsc.offload_optimizer_device(r.ds), "cpu")
    return Proposal("4b. parameter offload to CPU", dsc.zero_overrides(r.ds, new),
                    "16-bit parameter partitions live in host RAM and are fetched per layer: the GPU holds "
                    "about one layer's weights")


def smaller_buffers(r: Resolved) -> Optional[Proposal]:
    overrides = dsc.smaller_stage3_buffers(r.ds) if dsc.zero_stage(r.ds) == 3 else []
    if not overrides:
        return None
    return Proposal("5. smaller stage-3 buffers", overrides,
                    "fewer parameters prefetched and kept live between uses (some throughput lost)")


def nvme_offload(r: Resolved) -> Optional[Proposal]:
    if dsc.zero_stage(r.ds) != 3 or (dsc.offload_optimizer_device(r.ds), dsc.offload_param_device(r.ds)) == (
            "nvme", "nvme"):
        return None
    new = dsc.base_config(3, "nvme", "nvme", NVME_PLACEHOLDER)
    return Proposal("6. NVMe offload (ZeRO-Infinity)", dsc.zero_overrides(r.ds, new),
                    "optimizer states and parameters go to a local NVMe drive; host RAM keeps only swap buffers. "
                    "Point nvme_path at your NVMe mount (it must exist); set hardware.nvme_gb for the planner")


def lora(r: Resolved) -> Optional[Proposal]:
    if r.config.model.lora.enabled:
        return None
    note = "" if r.config.model.name_or_path else " (needs pretrained weights: set model.name_or_path)"
    return Proposal("7. LoRA", ["model.lora.enabled=true"],
                    f"train low-rank adapters only: gradients and Adam states shrink to <1% of the model{note}")


OOM_LADDER: list[Rung] = [smaller_micro_batch, activation_checkpointing, stage_up, tiled_logits, tiled_mlp,
                          sequence_parallel, optimizer_offload, param_offload, checkpoint_offload, smaller_buffers,
                          nvme_offload, lora]
# The rungs `search` prices together (the others - long-sequence rungs, buffers, NVMe, LoRA - come after).
SEARCHED: list[Rung] = [smaller_micro_batch, activation_checkpointing, stage_up, optimizer_offload, param_offload]
# Before the first step and at the optimizer step no activations are live: only model states can move.
STATES_LADDER: list[Rung] = [stage_up, optimizer_offload, param_offload, nvme_offload, lora]
# A ZeRO-3 gather holds the prefetched and live parameters: their limits first, then the usual ladder.
GATHER_LADDER: list[Rung] = [smaller_buffers, smaller_micro_batch, activation_checkpointing, tiled_logits, tiled_mlp,
                             sequence_parallel, param_offload, optimizer_offload, checkpoint_offload, nvme_offload,
                             lora]
LADDERS = {"init": STATES_LADDER, "step": STATES_LADDER, "gather": GATHER_LADDER}


# --- what the OOM message says ---------------------------------------------------------------------------------

_UNIT = {"B": 1, "bytes": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": GIB, "TiB": 2 ** 40}
_SIZE = r"([\d.]+) (B|bytes|KiB|MiB|GiB|TiB)"


def _size(pattern: str, text: str) -> Optional[int]:
    match = re.search(pattern.replace("SIZE", _SIZE), text)
    return int(float(match.group(1)) * _UNIT[match.group(2)]) if match else None


@dataclass(frozen=True)
class OomNumbers:
    """The numbers of a PyTorch CUDA OOM message (torch >= 2.1 wording, and the older one), in bytes."""
    requested: Optional[int] = None
    capacity: Optional[int] = None
    free: Optional[int] = None
    this_process: Optional[int] = None       # including non-PyTorch memory (CUDA context, NCCL, cuBLAS)
    allocated: Optional[int] = None          # by PyTorch's caching allocator
    reserved_unallocated: Optional[int] = None

    @classmethod
    def of(cls, text: str) -> "OomNumbers":
        allocated = _size(r"SIZE is allocated by PyTorch", text) or _size(r"SIZE already allocated", text)
        reserved = _size(r"SIZE is reserved by PyTorch but unallocated", text)
        total_reserved = _size(r"SIZE reserved in total by PyTorch", text)
        if reserved is None and total_reserved is not None and allocated is not None:
            reserved = max(0, total_reserved - allocated)
        return cls(_size(r"Tried to allocate SIZE", text),
                   _size(r"total capacity of SIZE", text) or _size(r"SIZE total capacity", text),
                   _size(r"of which SIZE is free", text) or _size(r"SIZE free", text),
                   _size(r"this process has SIZE memory in use", text), allocated, reserved)

    @property
    def demand(self) -> Optional[int]:
        """What the run needed at the failure: PyTorch's allocations plus the allocation that failed."""
        return None if self.allocated is None else self.allocated + (self.requested or 0)

    @property
    def others(self) -> Optional[int]:
        """Memory on the GPU held outside this process (another job, a leftover rank, a notebook)."""
        if None in (self.capacity, self.free, self.this_process):
            return None
        return max(0, self.capacity - self.free - self.this_process)


def same_gpu(numbers: OomNumbers, r: Resolved) -> Optional[bool]:
    """Whether the log's GPU is the preset's (None when the log does not say)."""
    if numbers.capacity is None or r.config.hardware.gpu == "cpu":
        return None
    expected = hardware.gpu(r.config.hardware.gpu).memory_bytes
    return abs(numbers.capacity - expected) <= SAME_GPU * expected


# --- pricing -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Price:
    """A config's estimate and its per-GPU bytes after calibration with the log."""
    estimate: Estimate
    total: int

    @property
    def fits(self) -> bool:
        e = self.estimate
        return self.total <= e.gpu_budget and e.fits_cpu and (e.fits_nvme or not e.nvme_budget)


@dataclass(frozen=True)
class Pricer:
    """Prices configs of one preset against a base estimate; `excess` is what the log shows the run needed
    beyond the planner's estimate (0 without a calibration)."""
    base: Estimate
    excess: int = 0

    def price(self, estimate: Optional[Estimate]) -> Optional[Price]:
        if estimate is None:
            return None
        before = self.base.activations.total
        scale = estimate.activations.total / before if before else 1.0
        return Price(estimate, estimate.gpu_total + int(self.excess * scale))

    def words(self, before: Price, after: Price) -> str:
        fits = "fits" if after.fits else "does not fit"
        note = " (calibrated with the log)" if self.excess else ""
        return (f"planner: {gb(before.total)} -> {gb(after.total)} GB per GPU of {gb(after.estimate.gpu_budget)} "
                f"- {fits}{note}")


def pricer_for(f: Found, numbers: OomNumbers) -> Optional[Pricer]:
    base = planned(f.resolved)
    if base is None:
        return None
    demand = numbers.demand if same_gpu(numbers, f.resolved) else None
    return Pricer(base, max(0, demand - base.gpu_total) if demand is not None else 0)


@dataclass
class Ladder:
    """The ladder's answer: the proposal and what follows it (each priced), or nothing that fits."""
    proposal: Optional[Proposal]
    then: list[Proposal]
    now: Optional[Price] = None
    best: Optional[Price] = None  # the lowest estimate the whole ladder reaches, when nothing fits


def walk(f: Found, rungs: list[Rung], pricer: Optional[Pricer]) -> Ladder:
    """The cheapest change in step time that fits (`search`: micro-batch down to 1, checkpointing, ZeRO stage and
    offloads priced together); where that search does not apply (a ZeRO-3 gather, long sequences: their own
    rungs) or finds nothing, the cheapest single rung that fits, else the cheapest run of rungs (in cost order)
    that fits. Then the remaining rungs, each on top of the ones before it, as long as they lower the estimate;
    each later step carries every earlier change, so each is one command line."""
    if pricer is None or f.reresolve is None:
        steps = cumulative(f.resolved, rungs, f.reresolve)
        return Ladder(steps[0] if steps else None, steps[1:])
    now = pricer.price(pricer.base)
    found = search(f, rungs, pricer, now)
    if found is not None:
        (proposal, applied, price), chosen = found, []
    else:
        single = next(((rung, p) for rung in rungs if (p := _priced(f, pricer, rung, f.resolved, [], now))
                       and p[1].fits), None)
        if single is not None:
            chosen, applied, price = [single[0]], single[1][0].overrides, single[1][1]
            proposal = single[1][0]
        else:
            chosen, applied, proposal, price = _cheapest_run(f, pricer, rungs, now)
            if proposal is None:
                return Ladder(None, [], now, price)
    then = _after(f, pricer, [r for r in rungs if r not in chosen], applied, price)
    return Ladder(proposal, then, now)


# --- the search: every combination of the rungs that trade memory against step time ---------------------------


def search(f: Found, rungs: list[Rung], pricer: Pricer, now: Price):
    """Every combination of a micro-batch (each divisor of the current one, down to 1, keeping the global
    batch), activation checkpointing, a ZeRO stage at or above the current one and CPU offload of the optimizer
    and the parameters - those of them the phase's ladder holds - priced by the planner with the log's
    calibration; of those that fit, the one with the shortest step (plan.steptime) is proposed, as one change.
    (proposal, overrides, price), or None where the search does not apply or nothing it reaches fits."""
    r = f.resolved
    if smaller_buffers is rungs[0] or not any(rung in rungs for rung in SEARCHED):
        return None
    inputs, micro, accum = inputs_for_resolved(r), r.batch.micro_batch_size, r.batch.grad_accum
    current = (micro, r.config.model.gradient_checkpointing, dsc.zero_stage(r.ds),
               dsc.offload_optimizer_device(r.ds), dsc.offload_param_device(r.ds))
    timed = []
    for point in _points(r, rungs, current):
        if point == current:
            continue
        m, checkpointing, stage, optimizer, params = point
        candidate = Candidate("doctor", stage, optimizer, params)
        try:
            price = pricer.price(plan_for_resolved(r, micro_batch=m, checkpointing=checkpointing,
                                                   candidate=candidate))
        except UserError:
            continue
        if price.fits:
            seconds = step_seconds(inputs, candidate, m, accum * micro // m, checkpointing)
            changes = sum(a != b for a, b in zip(point, current))
            timed.append((seconds, changes, point))
    for seconds, _, point in sorted(timed):
        proposal = _point_proposal(r, current, point)
        resolved = _for_pricing(f, proposal.overrides)
        price = pricer.price(planned(resolved))
        if price is None or not price.fits:
            continue
        return replace(proposal, estimate=pricer.words(now, price),
                       reason=f"{proposal.reason} - the shortest step of the changes that fit (~{seconds:.1f} s per "
                              f"step by the planner's step-time model)"), proposal.overrides, price
    return None


def _points(r: Resolved, rungs: list[Rung], current: tuple):
    micro, checkpointing, stage, optimizer, params = current
    micros = [d for d in range(micro, 0, -1) if micro % d == 0] if smaller_micro_batch in rungs else [micro]
    checkpointings = [checkpointing] + ([True] if activation_checkpointing in rungs and not checkpointing else [])
    stages = [stage] + ([s for s in (2, 3) if s > stage] if stage_up in rungs and r.world_size > 1 else [])
    for m in micros:
        for c in checkpointings:
            for s in stages:
                optimizers = [optimizer] + (["cpu"] if optimizer_offload in rungs and optimizer == "none" and s > 0
                                            else [])
                for o in optimizers:
                    param_choices = [params] + (["cpu"] if param_offload in rungs and params == "none" and s == 3
                                                else [])
                    for p in param_choices:
                        yield m, c, s, o, p


def _point_proposal(r: Resolved, current: tuple, point: tuple) -> Proposal:
    """One proposal for a point of the search: its parts' steps and reasons, its overrides in one list."""
    micro, checkpointing, stage, optimizer, params = point
    parts = []
    if micro != current[0]:
        parts.append(smaller_micro_batch(r, micro))
    if checkpointing != current[1]:
        parts.append(activation_checkpointing(r))
    if (stage, optimizer, params) != current[2:]:
        parts.append(_zero_change(r, stage, optimizer, params))
    return Proposal(" + ".join(p.step for p in parts), _merged([o for p in parts for o in p.overrides]),
                    "; ".join(p.reason for p in parts))


def _zero_change(r: Resolved, stage: int, optimizer: str, params: str) -> Proposal:
    now = dsc.zero_stage(r.ds)
    steps, reasons = [], []
    if stage != now:
        what = "gradients and optimizer states" if stage == 2 else "parameters, gradients and optimizer states"
        steps.append(f"3. ZeRO stage {now} -> {stage}")
        reasons.append(f"stage {stage} shards {what} across the {r.world_size} ranks"
                       + (" (same communication as stage 1)" if stage == 2 else " (~1.5x communication)"))
    if optimizer != dsc.offload_optimizer_device(r.ds):
        steps.append("4. optimizer offload to CPU")
        reasons.append("fp32 master weights, Adam moments and fp32 gradients move to host RAM; the step runs on "
                       "the CPU - launch with --bind_cores_to_rank")
    if params != dsc.offload_param_device(r.ds):
        steps.append("4b. parameter offload to CPU")
        reasons.append("16-bit parameter partitions live in host RAM and are fetched per layer")
    return Proposal(" + ".join(steps), dsc.zero_overrides(r.ds, dsc.base_config(stage, optimizer, params)),
                    "; ".join(reasons))


def _priced(f: Found, pricer: Pricer, rung: Rung, r: Resolved, applied: list[str], before: Price):
    proposal = rung(r)
    if proposal is None:
        return None
    price = pricer.price(planned(_for_pricing(f, _merged(applied + proposal.overrides))))
    if price is None:
        return None
    return replace(proposal, estimate=pricer.words(before, price)), price


def _cheapest_run(f: Found, pricer: Pricer, rungs: list[Rung], now: Price):
    """Rungs applied in cost order until the estimate fits: (rungs, overrides, combined proposal, price)."""
    applied, chosen, parts, price, r = [], [], [], now, f.resolved
    for rung in rungs:
        if rung is smaller_micro_batch:  # nothing single fits: the micro-batch goes to 1 at once
            rung = _micro_batch_one
        priced = _priced(f, pricer, rung, r, applied, now)
        if priced is None:
            continue
        proposal, price = priced
        chosen.append(rung)
        parts.append(proposal)
        applied = applied + proposal.overrides
        r = _for_pricing(f, _merged(applied)) or r
        if price.fits:
            combined = Proposal(" + ".join(p.step for p in parts), _merged(applied),
                                "no single change fits: " + "; ".join(p.reason for p in parts),
                                estimate=pricer.words(now, price))
            return chosen, applied, combined, price
    return chosen, applied, None, price


def _after(f: Found, pricer: Pricer, rungs: list[Rung], applied: list[str], price: Price) -> list[Proposal]:
    out, r = [], _for_pricing(f, _merged(applied)) or f.resolved
    for rung in rungs:
        priced = _priced(f, pricer, rung, r, applied, price)
        if priced is None or priced[1].total >= price.total or not priced[1].fits:
            continue
        applied, price = applied + priced[0].overrides, priced[1]
        out.append(replace(priced[0], overrides=_merged(applied)))  # every change so far: one command line
        r = _for_pricing(f, _merged(applied)) or r
    return out


def _for_pricing(f: Found, overrides: list[str]) -> Optional[Resolved]:
    """The config with `overrides` for the planner: an NVMe rung names /local_nvme, which the strict loader wants
    to exist; the estimate does not depend on the path, so a directory that exists stands in for it here."""
    resolved = f.resolves(overrides)
    if resolved is None and any(NVME_PLACEHOLDER in o for o in overrides):
        resolved = f.resolves([o.replace(NVME_PLACEHOLDER, tempfile.gettempdir()) for o in overrides])
    return resolved


def _merged(overrides: list[str]) -> list[str]:
    """Later settings of a key win: each key once, at its last value."""
    last = {o.split("=", 1)[0]: o for o in overrides}
    return [o for o in overrides if last[o.split("=", 1)[0]] is o]


def cumulative(r: Resolved, ladder: list[Rung], reresolve: Optional[Reresolve] = None) -> list[Proposal]:
    """Each rung not yet taken, in order, unpriced; with `reresolve`, each rung sees the config after the earlier
    proposals (after a stage-up, the optimizer offload is the stage-3 kind)."""
    proposals, applied = [], []
    for rung in ladder:
        proposal = rung(r)
        if proposal is None:
            continue
        proposals.append(proposal)
        if reresolve is not None:
            try:
                r = reresolve(_merged(applied + proposal.overrides))
                applied += proposal.overrides
            except UserError as err:  # e.g. an NVMe path that does not exist on this machine
                proposals[-1] = replace(proposal, reason=f"{proposal.reason} (not checked on this machine: "
                                        f"{first_error_line(err)}; the next rungs are judged without it)")
    return proposals
