"""Ranks grouped into nodes, the node pairs to test, and which pair links are slow. Pure functions of the
per-rank facts the ranks exchange, so they are tested with made-up hostnames.

A node is a hostname plus the node index the launcher gave the rank (torchrun's GROUP_RANK, DeepSpeed's
CROSS_RANK, `trainer launch`'s NODE_RANK, Slurm's SLURM_NODEID): two containers can share a hostname, and on
one test machine two "nodes" do. Each node's rank count is checked against the LOCAL_WORLD_SIZE its ranks
were told.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Optional


NODE_INDEX_VARIABLES = ("GROUP_RANK", "CROSS_RANK", "NODE_RANK", "SLURM_NODEID")


# A link is slow below this fraction of the median pair's bus bandwidth (or of --expect-busbw when given).
# nccl-tests runs on healthy fabrics agree within ~10-20% between pairs; half the median is a broken or
# mis-routed link (a NIC at a lower speed, traffic falling back to TCP), not noise.
SLOW_FRACTION = 0.5


def node_index(env: dict) -> Optional[str]:
    """The node index the launcher set for this rank, or None (plain single-node launches set none)."""
    return next((env[name] for name in NODE_INDEX_VARIABLES if env.get(name, "") != ""), None)


def node_key(hostname: str, index: Optional[str]) -> str:
    return hostname if index is None else f"{hostname}#{index}"


@dataclass(frozen=True)
class Node:
    key: str            # hostname, or hostname#index
    ranks: tuple        # global ranks on it, sorted


def group_nodes(keys: list[str]) -> list[Node]:
    """`keys[rank]` is rank's node key; nodes in order of their lowest rank."""
    nodes: dict[str, list[int]] = {}
    for rank, key in enumerate(keys):
        nodes.setdefault(key, []).append(rank)
    return [Node(key, tuple(members)) for key, members in nodes.items()]


def local_size_problems(nodes: list[Node], local_world_sizes: list[Optional[int]]) -> list[str]:
    """A node whose rank count differs from the LOCAL_WORLD_SIZE its ranks were told: two machines that share a
    hostname (containers), or a launcher started with the wrong --nproc_per_node."""
    problems = []
    for node in nodes:
        told = {local_world_sizes[r] for r in node.ranks} - {None}
        if told and told != {len(node.ranks)}:
            problems.append(f"node {node.key}: {len(node.ranks)} rank(s) ({_ranks(node.ranks)}) but they were told "
                            f"LOCAL_WORLD_SIZE={'/'.join(str(t) for t in sorted(told))}: hosts that share a "
                            f"hostname, or a launcher with the wrong ranks per node")
    return problems


def node_pairs(nodes: list[Node]) -> list[tuple[int, int]]:
    """Every pair of nodes (by index into `nodes`), each tested with one rank from each node."""
    return [(a, b) for a in range(len(nodes)) for b in range(a + 1, len(nodes))]


def pair_ranks(nodes: list[Node], pair: tuple[int, int]) -> tuple[int, int]:
    """The ranks that stand for the two nodes: each node's lowest rank (local rank 0 under every launcher)."""
    return nodes[pair[0]].ranks[0], nodes[pair[1]].ranks[0]


def slow_pairs(busbw: list[float], expected: Optional[float] = None,
               fraction: float = SLOW_FRACTION) -> tuple[float, list[int]]:
    """(threshold, indices of the slow pairs): below `fraction` of the median pair, or of `expected` (GB/s, the
    fabric's figure) when given -- with few pairs the median is no reference (one pair is its own median)."""
    if not busbw:
        return 0.0, []
    reference = expected if expected else statistics.median(busbw)
    threshold = fraction * reference
    return threshold, [i for i, value in enumerate(busbw) if value < threshold]


def _ranks(ranks) -> str:
    return "rank " + ", ".join(str(r) for r in ranks) if len(ranks) < 6 else f"ranks {ranks[0]}-{ranks[-1]}"
