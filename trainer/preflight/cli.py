"""`python -m trainer preflight`: measure the fabric and check the ranks agree, under the launcher the run will use.

    deepspeed --num_gpus 8 --module trainer preflight --preset 7b_8xa100 [--set k=v ...] [--json preflight.json]
    deepspeed --hostfile hostfile --module trainer preflight --preset 70b_32xa100 --expect-busbw 40
    torchrun --nnodes 2 --nproc_per_node 8 ... -m trainer preflight --preset 70b_32xa100

Every rank resolves the preset as the run would (the same --preset and --set), reports its versions, the
resolved config's hash and its free device memory (host RAM on CPU ranks), and times all-reduce and all-gather
over --sizes (bandwidth.py: nccl-tests' algbw and busbw); then one rank of each node pair times an all-reduce
between the two nodes alone. Rank 0 prints one report (stdout; logs go to stderr) and writes --json FILE whole.
Exit 0 when everything agrees and no link is slow; 1 naming each mismatch or slow link. gloo on CPU ranks,
NCCL on GPUs (whatever deepspeed.init_distributed picks for the accelerator).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys

from .. import numbers, paths
from .. import ranks
from ..errors import UserError
from ..files import check_target, write_text_atomic
from ..options import add_preset_arguments, load_and_resolve
from ..provenance import resolved_hash  # the hash each run records in config.resolved.yaml
from . import nodes as nd
from .agree import disagreements, versions
from .bandwidth import OPS, measure, parse_sizes
from .report import render


CPU_SIZES = "64K,1M,16M"            # gloo over loopback: larger sizes only take longer
GPU_SIZES = "1M,16M,128M,1G"        # NCCL reaches its plateau bus bandwidth from a few hundred MB


# A rank with less than this fraction of the median rank's free device memory is named (a stray process on
# that GPU, or a smaller card): a warning, since the run may still fit.
LOW_MEMORY_FRACTION = 0.8


def preflight_arguments(parser: argparse.ArgumentParser) -> None:
    add_preset_arguments(parser, positional=False)
    parser.add_argument("--sizes", help=f"message sizes in bytes with K/M/G (default {CPU_SIZES} on CPU ranks, "
                                        f"{GPU_SIZES} on GPUs)")
    parser.add_argument("--warmup", type=numbers.COUNT_OR_ZERO, default=5,
                        help="untimed iterations per size (default 5)")
    parser.add_argument("--iters", type=numbers.COUNT, default=20, help="timed iterations per size (default 20)")
    parser.add_argument("--expect-busbw", type=numbers.POSITIVE, metavar="GBPS",
                        help="the fabric's all-reduce bus bandwidth between two nodes in GB/s (e.g. nccl-tests on a "
                             "healthy pair): links below half of it are slow (default: half the median pair)")
    parser.add_argument("--json", metavar="FILE", type=paths.output_file("JSON report"),
                        help="also write the report as JSON (rank 0, written whole)")
    parser.add_argument("--timeout-s", type=numbers.WHOLE_SECONDS, default=300,
                        help="give up on a collective after this long")
    parser.add_argument("--local_rank", "--local-rank", type=numbers.RANK, help=argparse.SUPPRESS)  # set by launchers


def preflight(args) -> int:
    from ..distributed import comm_device, end_distributed, start_distributed
    check_settings(args)
    if args.json:
        check_target(args.json, "--json")
    facts = rank_facts(args)
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs on stdout; the report owns it
        start_distributed(args.timeout_s)
    succeeded = False
    try:
        device = comm_device()
        facts.update(rank=ranks.rank(), device=str(device), **free_memory(device))
        everyone = gather(facts)
        report = run_checks(args, everyone, device)
        if ranks.rank() == 0:
            print(render(report), flush=True)
            if args.json:
                write_text_atomic(args.json, json.dumps(report, indent=2) + "\n", "--json")
        ranks.barrier()
        succeeded = True
        return 0 if report["verdict"] == "ok" else 1
    finally:
        end_distributed(succeeded)


def check_settings(args) -> None:
    problems = []  # the numbers' own ranges are their flags' types (trainer/numbers.py)
    running = ranks.launched_world_size()
    if args.world_size is not None and args.world_size != running:
        problems.append(f"--world-size {args.world_size}, but {running} rank(s) are running: preflight checks the "
                        f"ranks that are here; launch {args.world_size} (e.g. deepspeed --num_gpus "
                        f"{args.world_size} --module trainer preflight ...) or drop --world-size")
    if args.sizes is not None:  # '' too: not the default sizes
        try:
            parse_sizes(args.sizes)
        except UserError as err:
            problems.append(str(err))
    if problems:
        raise UserError("; ".join(problems))


def rank_facts(args) -> dict:
    """What this rank knows before the group exists: host, node index, versions, and the preset resolved at
    the launched world size (a preset that does not resolve is reported, not raised: the other ranks would
    wait for this one until the timeout)."""
    if args.world_size is None:
        args.world_size = ranks.launched_world_size()
    facts = {"host": socket.gethostname(), "node_index": nd.node_index(dict(os.environ)),
             "local_world_size": _int_or_none(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE")),
             "versions": versions(), "config_hash": None, "config_error": None, "config": None}
    try:
        record = load_and_resolve(args).record()
        facts.update(config_hash=resolved_hash(record), config=record)
    except UserError as err:
        facts["config_error"] = str(err)
    return facts


def free_memory(device) -> dict:
    """Free and total bytes of this rank's device; available and total host RAM on a CPU rank."""
    if device.type == "cuda":
        import torch
        free, total = torch.cuda.mem_get_info(device)
        return {"memory": "device", "free_bytes": int(free), "total_bytes": int(total)}
    import psutil
    ram = psutil.virtual_memory()
    return {"memory": "host", "free_bytes": int(ram.available), "total_bytes": int(ram.total)}


def gather(facts: dict) -> list[dict]:
    import torch.distributed as dist
    everyone: list = [None] * ranks.world_size()
    dist.all_gather_object(everyone, facts)
    return everyone


def run_checks(args, everyone: list[dict], device) -> dict:
    """Measure (every rank takes part) and judge (the same verdict on every rank, from the same facts)."""
    node_list = nd.group_nodes([nd.node_key(r["host"], r["node_index"]) for r in everyone])
    sizes = parse_sizes(args.sizes or (GPU_SIZES if device.type == "cuda" else CPU_SIZES))
    collectives = [measure(op, size, device, args.warmup, args.iters).as_dict() for op in OPS for size in sizes]
    pairs = measure_pairs(node_list, max(sizes), device, args.warmup, args.iters)
    threshold, slow = nd.slow_pairs([p["busbw_gbps"] for p in pairs], args.expect_busbw)
    for index in slow:
        pairs[index]["slow"] = True
    problems = disagreements(everyone) + nd.local_size_problems(node_list, [r["local_world_size"] for r in everyone])
    problems += [f"slow link {p['nodes'][0]} <-> {p['nodes'][1]} (ranks {p['ranks'][0]}, {p['ranks'][1]}): "
                 f"{p['busbw_gbps']:.2f} GB/s < {threshold:.2f} GB/s" for p in pairs if p["slow"]]
    return {"world_size": len(everyone), "backend": _backend(), "device": device.type,
            "nodes": [{"node": n.key, "ranks": list(n.ranks)} for n in node_list],
            "ranks": [{k: v for k, v in r.items() if k != "config"} for r in everyone],
            "collectives": collectives, "node_pairs": pairs,
            "slow_threshold_gbps": threshold, "slow_fraction": nd.SLOW_FRACTION,
            "slow_reference": "expected" if args.expect_busbw else "median",
            "warnings": memory_warnings(everyone), "problems": problems,
            "verdict": "ok" if not problems else "fail"}


def measure_pairs(node_list: list[nd.Node], size: int, device, warmup: int, iters: int) -> list[dict]:
    """For each node pair, an all-reduce between one rank of each alone (every rank creates every group, as
    torch requires; the others wait at the barrier). Results gathered from the pairs' first ranks."""
    import torch.distributed as dist
    mine = []
    for index, pair in enumerate(nd.node_pairs(node_list)):
        members = nd.pair_ranks(node_list, pair)
        group = dist.new_group(ranks=list(members))
        if ranks.rank() in members:
            result = measure("all_reduce", size, device, warmup, iters, group)
            if ranks.rank() == members[0]:
                mine.append({"nodes": [node_list[pair[0]].key, node_list[pair[1]].key], "ranks": list(members),
                             "bytes": result.bytes, "time_s": result.time_s, "busbw_gbps": result.busbw_gbps,
                             "slow": False, "index": index})
        dist.barrier()
    everyone: list = [None] * ranks.world_size()
    dist.all_gather_object(everyone, mine)
    found = sorted((p for part in everyone for p in part), key=lambda p: p["index"])
    return [{k: v for k, v in p.items() if k != "index"} for p in found]


def memory_warnings(everyone: list[dict]) -> list[str]:
    import statistics
    median = statistics.median(r["free_bytes"] for r in everyone)
    return [f"rank {r['rank']} ({r['host']}): {r['free_bytes'] / 1e9:.1f} GB free of {r['total_bytes'] / 1e9:.1f}, "
            f"< {LOW_MEMORY_FRACTION:g} x the median rank's {median / 1e9:.1f} GB (another process on it?)"
            for r in everyone if r["free_bytes"] < LOW_MEMORY_FRACTION * median]


def _backend() -> str:
    import torch.distributed as dist
    return str(dist.get_backend())


def _int_or_none(text):
    return int(text) if text and text.isdigit() else None
