"""Ulysses sequence parallelism's preconditions, failed in a run that skipped the trainer's resolve (a script of
the user's on DeepSpeed's classes, or another trainer). DeepSpeed checks them where it uses them, each at one site
of deepspeed/runtime/sequence_parallel/ulysses_sp.py; the trainer checks the same ones before any step (rules.py,
and the group check in train/sequence_parallel.py). The doctor finds the innermost frame of the failing traceback
in that code and reads which precondition failed from the site - not from the wording of the message - then takes
the numbers the message gives (heads, sizes, lengths) to compute the rule's own fix for the preset.

| site (function)                          | precondition                                 | first change                   |
|------------------------------------------|----------------------------------------------|--------------------------------|
| UlyssesSPAttentionHF.__init__            | SP size divides the query heads (and KV)     | an SP size that divides them   |
| register_with_transformers               | attention is not eager (needs a 4D mask)     | model.attn_implementation=sdpa |
| UlyssesSPDataLoaderAdapter.refill, forward | seq_len divisible by the SP size           | data.seq_len, rounded down     |
| check_one_sample_per_group (trainer)     | a group's ranks read the same micro-batch    | shard data by rank // sp       |
"""
from __future__ import annotations

import re
from typing import Optional

from ... import ds as dsc
from ..findings import Diagnosis, Found, Proposal
from ..logtext import EXCEPTION, TRACEBACK_LINES, Log

ULYSSES_CODE = re.compile(r"deepspeed[\\/]runtime[\\/]sequence_parallel[\\/]")
SITE_CODE = re.compile(ULYSSES_CODE.pattern + "|check_one_sample_per_group")
NUMBER = re.compile(r"\b\d+\b")
SITES = {"__init__": "heads", "register_with_transformers": "attention", "refill": "seq_len", "forward": "seq_len",
         "check_one_sample_per_group": "one_sample"}


def site_of(log: Log, index: int) -> Optional[str]:
    """The precondition the exception at `index` enforces: its innermost frame in DeepSpeed's sequence-parallel
    code (or the trainer's group check), looked up by function name."""
    for frame in reversed(log.frames(index)):
        if frame.func == "check_one_sample_per_group" or ULYSSES_CODE.search(frame.file):
            return SITES.get(frame.func.rsplit(".", 1)[-1])
    return None


def find(log: Log) -> Optional[int]:
    """The first exception raised at one of the sites. An exception can have its frame there only when a line
    naming that code lies within its traceback, so those lines are found first (one search of the log; most logs
    have none) and only the exceptions up to a traceback's length after each are read - not every exception of a
    log that has 200,000."""
    checked: set[int] = set()
    site = log.first(SITE_CODE)
    while site is not None:
        exception = log.first(EXCEPTION, site)
        while exception is not None and exception - site <= TRACEBACK_LINES:
            if exception not in checked:
                checked.add(exception)
                if site_of(log, exception):
                    return exception
            exception = log.first(EXCEPTION, exception + 1)
        site = log.first(SITE_CODE, site + 1)
    return None


def diagnose(f: Found) -> Diagnosis:
    site = site_of(f.log, f.index)
    numbers = [int(n) for n in NUMBER.findall(EXCEPTION.sub("", f.log.line(f.index)))]
    return {"heads": _heads, "attention": _attention, "seq_len": _seq_len, "one_sample": _one_sample}[site](f, numbers)


def _sp(f: Found, numbers: list[int], position: int) -> int:
    """The SP size the failed run had: from the message, else the preset's."""
    return numbers[position] if len(numbers) > position else dsc.sequence_parallel_size(f.resolved.ds)


def _keep_sp(f: Found, sp: int) -> list[str]:
    return [] if dsc.sequence_parallel_size(f.resolved.ds) == sp else [f"deepspeed.sequence_parallel_size={sp}"]


def _heads(f: Found, numbers: list[int]) -> Diagnosis:
    heads = numbers[0] if numbers else f.resolved.config.model.num_heads
    sp, world = _sp(f, numbers, 1), f.resolved.world_size
    fits = [d for d in range(1, world + 1) if world % d == 0 and heads % d == 0]
    size = max(d for d in fits if d <= sp)
    d = Diagnosis("sequence_parallel", f"sequence parallel size {sp} does not divide the {heads} attention heads",
                  f.line)
    d.proposal = Proposal(f"sequence parallel size {size}", [f"deepspeed.sequence_parallel_size={size}"],
                          f"Ulysses' all-to-all hands every rank of a group whole heads: heads / sp of them. Sizes "
                          f"that divide {heads} heads and {world} ranks: {fits}; {size} is the largest up to {sp}")
    return d


def _attention(f: Found, numbers: list[int]) -> Diagnosis:
    sp = dsc.sequence_parallel_size(f.resolved.ds)
    d = Diagnosis("sequence_parallel", "eager attention under Ulysses sequence parallelism", f.line)
    d.proposal = Proposal("sdpa attention", ["model.attn_implementation=sdpa"] + _keep_sp(f, max(sp, 2)),
                          "DeepSpeed's Ulysses attention drops the attention mask and attends causally by position; "
                          "eager attention needs the 4D mask (O(seq_len^2) memory). sdpa (or flash_attention_2 on "
                          "GPUs) computes the same attention")
    return d


def _seq_len(f: Found, numbers: list[int]) -> Diagnosis:
    seq_len = numbers[0] if numbers else f.resolved.config.data.seq_len
    sp = _sp(f, numbers, 1)
    fixed = seq_len // sp * sp or sp
    d = Diagnosis("sequence_parallel", f"sequence length {seq_len} is not divisible by sequence parallel size {sp}",
                  f.line)
    d.proposal = Proposal(f"data.seq_len {fixed}", [f"data.seq_len={fixed}"] + _keep_sp(f, sp),
                          f"each rank of a group holds seq_len / {sp} tokens of every sample; {fixed} is the longest "
                          f"length up to {seq_len} that splits evenly")
    return d


def _one_sample(f: Found, numbers: list[int]) -> Diagnosis:
    d = Diagnosis("sequence_parallel", "the ranks of a sequence-parallel group read different samples", f.line)
    d.proposal = Proposal("shard the data by data-parallel rank (rank // sequence_parallel_size), not by rank, "
                          "with no per-rank shuffle - or train through the trainer, whose loader does", [],
                          "a group trains on one sample, each rank on its slice of the sequence: ranks reading their "
                          "own samples would attend across slices of unrelated sequences")
    return d
