"""Collective bandwidth the way nccl-tests reports it (its doc/PERFORMANCE.md), so the numbers compare with
the figures fabric vendors and cluster admins quote.

- time: warm-up iterations, then `iters` timed back-to-back iterations on each rank (the device synchronised
  at the end), per-iteration time = elapsed / iters, and the slowest rank's time counts (a collective is only
  as fast as its last rank);
- algbw = bytes / time;
- busbw = algbw x 2(n-1)/n for all-reduce, x (n-1)/n for all-gather: what each link carried, comparable
  across rank counts (with n ranks a ring all-reduce moves 2(n-1)/n of the buffer over every link).
For all-gather, `bytes` is the gathered (output) size, each rank sending bytes/n, as nccl-tests counts it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..errors import UserError
from ..numbers import parse_size


GB = 1e9  # nccl-tests' GB/s are decimal


OPS = ("all_reduce", "all_gather")




MAX_MESSAGE_FRACTION = 0.25  # a message buffer (sent and received: twice) beyond a quarter of RAM is not a test


def parse_sizes(text: str) -> list[int]:
    """'64K,1M,16M' -> bytes (binary units, as nccl-tests' -b/-e flags take them), each at most a quarter of this
    machine's memory (the collective holds the buffer twice per rank)."""
    import psutil
    ceiling = int(psutil.virtual_memory().total * MAX_MESSAGE_FRACTION)
    sizes, bad = [], []
    for item in (part.strip() for part in text.split(",")):
        try:
            sizes.append(parse_size(item, "message size", ceiling))
        except ValueError as err:
            bad.append(str(err))
    if bad or not sizes:
        raise UserError(f"--sizes {text!r}: {'; '.join(bad) or 'no size'}; give sizes with K/M/G, e.g. --sizes "
                        f"64K,1M,16M")
    return sorted(set(sizes))


def bus_factor(op: str, ranks: int) -> float:
    """busbw / algbw for `op` on `ranks` ranks (nccl-tests PERFORMANCE.md)."""
    if op == "all_reduce":
        return 2 * (ranks - 1) / ranks
    if op == "all_gather":
        return (ranks - 1) / ranks
    raise ValueError(f"unknown collective {op!r}")


@dataclass(frozen=True)
class Measurement:
    op: str
    bytes: int
    ranks: int
    time_s: float      # per iteration, the slowest rank's

    @property
    def algbw_gbps(self) -> float:
        return self.bytes / self.time_s / GB

    @property
    def busbw_gbps(self) -> float:
        return self.algbw_gbps * bus_factor(self.op, self.ranks)

    def as_dict(self) -> dict:
        return {"op": self.op, "bytes": self.bytes, "ranks": self.ranks, "time_s": self.time_s,
                "algbw_gbps": self.algbw_gbps, "busbw_gbps": self.busbw_gbps}


def measure(op: str, size: int, device, warmup: int, iters: int, group=None) -> Measurement:
    """Time `op` on a `size`-byte float32 buffer in `group` (every member calls this together)."""
    import torch
    import torch.distributed as dist
    ranks = dist.get_world_size(group)
    run = _collective(op, size, ranks, device, group)
    for _ in range(warmup):
        run()
    _synchronize(device)
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iters):
        run()
    _synchronize(device)
    per_iteration = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(per_iteration, op=dist.ReduceOp.MAX, group=group)
    return Measurement(op, _counted_bytes(op, size, ranks), ranks, float(per_iteration.item()))


def _counted_bytes(op: str, size: int, ranks: int) -> int:
    """The bytes actually moved as the formula counts them: all-gather's output is a whole number of
    float32 elements per rank."""
    if op == "all_gather":
        return max(1, size // (4 * ranks)) * 4 * ranks
    return max(1, size // 4) * 4


def _collective(op: str, size: int, ranks: int, device, group):
    import torch
    import torch.distributed as dist
    if op == "all_reduce":
        buffer = torch.ones(_counted_bytes(op, size, ranks) // 4, dtype=torch.float32, device=device)
        return lambda: dist.all_reduce(buffer, group=group)
    per_rank = _counted_bytes(op, size, ranks) // 4 // ranks
    send = torch.ones(per_rank, dtype=torch.float32, device=device)
    gathered = torch.empty(per_rank * ranks, dtype=torch.float32, device=device)
    return lambda: dist.all_gather_single(gathered, send, group=group)  # torch 2.13 name of all_gather_into_tensor


def _synchronize(device) -> None:
    if device.type == "cuda":
        import torch
        torch.cuda.synchronize(device)
