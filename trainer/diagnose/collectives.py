"""NCCL timeouts read by their pattern: which collective timed out, on which ranks, at which sequence number.

- ranks at different collective sequence numbers (or at the same number with different collectives) took
  different code paths: a rank-dependent branch, not the network;
- the first small collective (a few elements, sequence number <= 10) is a barrier: the other ranks waited
  while one rank (rank 0) did something alone - preparing the data, typically;
- a timeout with the ranks in step, on a real collective, points at the fabric.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from .findings import Diagnosis, Found, Proposal
from .logtext import Log

WATCHDOG = re.compile(r"(?:\[Rank (\d+)\][^\[\n]*?)?WorkNCCL\(SeqNum=(\d+), OpType=(\w+), NumelIn=(\d+)"
                      r"(?:.*?Timeout\(ms\)=(\d+))?")
FINGERPRINT = re.compile(r"\[Rank (\d+)\] Running collective: CollectiveFingerPrint\(SequenceNumber=(\d+), "
                         r"OpType=(\w+)")
MISMATCH = re.compile(r"(Detected mismatch between collectives on ranks|Mismatched collective detected|"
                      r"collective mismatch error)")
NCCL_TIMEOUT = re.compile(r"(Watchdog caught collective operation timeout|NCCL.*[Tt]imeout|DistBackendError.*[Tt]imeout|"
                          r"timed out in blocking wait|" + r"retrieving ncclUniqueId from \[0\].*(?:[Tt]imeout|timed out))")
# the ranks' first communicator: every other rank asks rank 0's store for its NCCL id, which rank 0 publishes only
# when it reaches its first collective - a timeout here is a barrier at collective #0, whatever the fabric
FIRST_COMMUNICATOR = re.compile(r"retrieving ncclUniqueId from \[0\]")
THIS_TRAINER = re.compile(r"(--preset\b|python -m trainer\b|[\\/]trainer[\\/](?:train|launch)[\\/])")
HF_TRAINER = re.compile(r"(transformers[\\/]trainer\.py|--per_device_train_batch_size|--ddp_timeout|llamafactory|"
                        r"llmtuner|TrainingArguments)")
DATA_PREP = re.compile(r"(Running tokenizer on dataset|Tokeniz|tokeniz|Generating train split|Map( \(num_proc=\d+\))?:|"
                       r"Preparing|prepare-data|Downloading data)")
BARRIER_SEQ, BARRIER_NUMEL = 10, 1024


@dataclass(frozen=True)
class Collective:
    rank: int  # -1 when the line does not say
    seq: int
    op: str
    numel: int
    timeout_ms: int = 0


def collectives(log: Log) -> list[Collective]:
    found = [Collective(int(m.group(1) or -1), int(m.group(2)), m.group(3), int(m.group(4)), int(m.group(5) or 0))
             for m in log.all(WATCHDOG)]
    return found + [Collective(int(m.group(1)), int(m.group(2)), m.group(3), -1) for m in log.all(FINGERPRINT)]


def out_of_step(seen: list[Collective]) -> dict[int, int]:
    """Each rank's furthest collective when the ranks disagree (a different sequence number, or the same one
    with a different operation or size); empty when they are in step."""
    by_rank: dict[int, Collective] = {}
    for c in seen:
        if c.rank >= 0 and (c.rank not in by_rank or c.seq > by_rank[c.rank].seq):
            by_rank[c.rank] = c
    seqs = {c.seq for c in by_rank.values()}
    shapes = {(c.op, c.numel) for c in by_rank.values() if c.numel >= 0}
    return {rank: c.seq for rank, c in sorted(by_rank.items())} if len(seqs) > 1 or len(shapes) > 1 else {}


def find_nccl(log: Log):
    """The evidence line of an NCCL failure: a watchdog timeout, a mismatch report, or fingerprints of ranks
    at different collectives."""
    index = log.first(NCCL_TIMEOUT)
    if index is None:
        index = log.first(MISMATCH)
    if index is None and out_of_step(collectives(log)):
        index = log.first(FINGERPRINT)
    return index


def diagnose_nccl(f: Found) -> Diagnosis:
    seen = collectives(f.log)
    apart = out_of_step(seen)
    if apart or f.log.has(MISMATCH):
        return _config_cause(f, _desync(f, apart))
    timed = [c for c in seen if c.timeout_ms] or seen
    if not timed and f.log.has(FIRST_COMMUNICATOR):
        timed = [Collective(0, 0, "the first communicator's setup (rank 0's NCCL id)", 0)]
    if timed and min(c.seq for c in timed) <= BARRIER_SEQ and max(c.numel for c in timed) <= BARRIER_NUMEL:
        return _barrier(f, timed)
    return _config_cause(f, _fabric(f, timed[0] if timed else None))


def _config_cause(f: Found, d: Diagnosis) -> Diagnosis:
    """A hang the config itself causes (lint's rule, from the same entry: an MoE at ZeRO-3 whose expert blocks are
    not leaf modules) is the first proposal; the pattern's advice stays."""
    from .lint import moe_leaf_risk
    risk = moe_leaf_risk(f.resolved)
    if risk is not None:
        what, overrides = risk
        d.proposal = Proposal("make the MoE blocks ZeRO-3 leaf modules" + ("" if overrides else
                                                                          ": set model.zero3_leaf_modules"),
                              overrides, what)
    return d


def _desync(f: Found, apart: dict[int, int]) -> Diagnosis:
    where = ", ".join(f"rank {rank} at collective #{seq}" for rank, seq in apart.items())
    d = Diagnosis("nccl_desync", f"NCCL ranks out of step{': ' + where if where else ''}", f.line)
    d.advice += [
        "the ranks are waiting on different collectives, so they took different code paths: a rank-dependent "
        "branch (a collective only rank 0 runs - evaluation, saving, logging a reduced metric), data-dependent "
        "control flow (MoE routing, skipping a micro-batch, an uneven last batch) or an exception one rank "
        "swallowed",
        "name the mismatching collective: rerun with TORCH_DISTRIBUTED_DEBUG=DETAIL (checks every collective's "
        "op and shapes across ranks) and NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=COLL",
        "raising the timeout cannot help: the ranks will never meet at the same collective",
    ]
    return d


def _barrier(f: Found, timed: list[Collective]) -> Diagnosis:
    first = min(timed, key=lambda c: c.seq)
    seconds = first.timeout_ms // 1000 or f.resolved.config.train.dist_timeout_s
    d = Diagnosis("nccl_barrier_timeout", f"NCCL timeout at collective #{first.seq} ({first.op} of {first.numel} "
                                          f"element{'s' if first.numel != 1 else ''} after {seconds} s): the "
                                          f"other ranks waited at a barrier", f.line)
    preparing = next(iter(f.log.all(DATA_PREP)), None)
    while_doing = f" - the log shows it preparing data ('{preparing.group(0)}')" if preparing else ""
    preset = f.resolved.config.name
    prepare = Proposal(f"prepare the data first: python -m trainer prepare-data --preset {preset}", [],
                       f"run it once (with the same --set overrides), then train: a small first collective that never completes is a barrier the other ranks "
                       f"reached while rank 0 was still busy alone{while_doing}. The trainer prepares a small "
                       f"local source on rank 0 inside a barrier (data.auto_prepare_max_gb); prepared shards are "
                       f"read at once")
    longer = max(2 * seconds, 2 * f.resolved.config.train.dist_timeout_s, 3600)
    timeout = Proposal("or raise the process-group timeout", [f"train.dist_timeout_s={longer}"],
                       f"every collective waits {longer} s instead of {seconds} s, long enough for rank 0 to "
                       f"finish preparing; a real hang then takes that long to surface")
    if f.log.has(THIS_TRAINER) or not (preparing or f.log.has(HF_TRAINER)):
        d.proposal, d.then = prepare, [timeout]
        return d
    # another framework's run, preparing on rank 0 while the others wait: its own timeout knob is the fix it has
    knob = ("--ddp_timeout (TrainingArguments.ddp_timeout, seconds)" if f.log.has(HF_TRAINER) else
            "timeout=datetime.timedelta(...) in init_process_group / deepspeed.init_distributed")
    d.proposal = replace(timeout, step=f"raise the process-group timeout above the preparation's time: {knob} "
                                       f"(train.dist_timeout_s={longer} with this trainer); or tokenize once before "
                                       f"the launch and load the saved result (this trainer: python -m trainer "
                                       f"prepare-data --preset {preset})")
    d.then = [prepare]
    return d


def _fabric(f: Found, c) -> Diagnosis:
    op = f" ({c.op} after {c.timeout_ms // 1000} s)" if c is not None and c.timeout_ms else (
        f" ({c.op})" if c is not None else "")
    d = Diagnosis("nccl_timeout", f"NCCL collective timed out{op}", f.line)
    d.advice += [
        "one rank stopped reaching the collective: look for the first error of any rank earlier in the log "
        "(an OOM, an exception, a stuck data loader) - the timeout is the symptom, not the cause",
        "if no rank failed, the ranks are in step and the fabric did not deliver: rerun with NCCL_DEBUG=INFO "
        "(look for NET/IB vs NET/Socket), set NCCL_SOCKET_IFNAME to the fast interface, NCCL_IB_DISABLE=0 with "
        "InfiniBand; on one node with PCIe GPUs test with NCCL_P2P_DISABLE=1 - if that passes, peer-to-peer "
        "through the PCIe switch/IOMMU (ACS) is broken: disable ACS/IOMMU in the BIOS or keep P2P off",
        "do not just raise the timeout: a hang stays a hang",
    ]
    from .classes import network
    if network.one_node(f) and network.pcie_gpus(f):  # one node's PCIe GPUs: the transport that hangs most often
        d.proposal = network.p2p_test(f)
    from .. import ds as dsc
    r = f.resolved
    if r.config.hardware.nodes > 1 and dsc.zero_stage(r.ds) == 3 and dsc.hpz_partition_size(r.ds) <= 1:
        d.advice.append("once the hang is fixed, a slow cross-node link is helped by ZeRO++ hpZ (see "
                        "`python -m trainer lint`)")
    return d
