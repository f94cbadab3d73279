"""The launch topology (nodes x ranks per node, from a hostfile, the flags or the preset) checked against the
preset: its world size resolved into the config, and the groups that must stay inside a node checked."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .. import ds as dsc
from ..errors import UserError
from ..options import resolved_with_overrides
from ..presets import load_preset, preset_path
from ..resolve import Resolved
from .hostfile import Hostfile, check_against_preset, read_hostfile


@dataclass(frozen=True)
class Topology:
    launcher: str
    nodes: int
    ranks_per_node: int
    hostfile: Optional[Hostfile] = None

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


def topology_of(args, config) -> Topology:
    """Nodes and ranks per node: the hostfile's, else the flags', else the preset's hardware section."""
    hw = config.hardware
    if args.hostfile:
        if args.launcher in ("slurm", "local"):
            raise UserError(f"--hostfile with --launcher {args.launcher}: the nodes come from "
                            f"{'the allocation' if args.launcher == 'slurm' else '--nnodes'}; leave --hostfile out")
        hostfile = read_hostfile(args.hostfile)
        if args.nnodes is not None and args.nnodes != hostfile.nodes:
            raise UserError(f"--nnodes {args.nnodes} but the hostfile {hostfile.path} lists {hostfile.nodes} "
                            f"host(s): leave --nnodes out (the hostfile says), or list the hosts to run on")
        check_against_preset(hostfile, args.nproc_per_node or hw.gpus_per_node)
        return Topology(args.launcher, hostfile.nodes, hostfile.hosts[0][1], hostfile)
    nodes = hw.nodes if args.nnodes is None else args.nnodes
    per_node = hw.gpus_per_node if args.nproc_per_node is None else args.nproc_per_node
    if nodes < 1 or per_node < 1:
        raise UserError(f"--nnodes {nodes} x --nproc-per-node {per_node}: both must be >= 1")
    if args.launcher == "deepspeed" and nodes > 1:
        raise UserError(f"the preset runs on hardware.nodes={nodes} nodes: give --hostfile FILE (one `host slots="
                        f"{hw.gpus_per_node}` line per node), or --launcher slurm / torchrun, or --set "
                        f"hardware.nodes=1 for one node")
    return Topology(args.launcher, nodes, per_node)


def resolve_for(args, config, topology: Topology) -> Resolved:
    """The config resolved for the ranks that will run, refused here rather than by every rank later."""
    world = topology.world_size
    if args.world_size is not None and args.world_size != world:
        raise UserError(f"--world-size {args.world_size} but the launch starts {topology.nodes} node(s) x "
                        f"{topology.ranks_per_node} rank(s) = {world}: leave --world-size out (launch sets it)")
    try:
        resolved = resolved_with_overrides(lambda overrides: config if overrides == args.overrides
                                           else load_preset(args.preset, overrides),
                                           args.overrides, str(preset_path(args.preset)), world)
    except UserError as err:
        source = (f"the hostfile {topology.hostfile.path}" if topology.hostfile
                  else "the launch flags / hardware section")
        raise UserError(f"{err}\n(resolved for the launch: {topology.nodes} node(s) x {topology.ranks_per_node} "
                        f"rank(s) = world size {world}, from {source})") from None
    check_fits_topology(resolved, topology)
    args.world_size = world
    return resolved


def check_fits_topology(resolved: Resolved, topology: Topology) -> None:
    """What only the topology can refuse. hpZ's secondary shards and AutoTP's shards are meant to live on one
    node (NVLink): a group across the node boundary puts every layer's all-gather (or every TP all-reduce) on
    the inter-node network."""
    per_node, problems = topology.ranks_per_node, []
    hpz, tp = dsc.hpz_partition_size(resolved.ds), dsc.autotp_size(resolved.ds)
    if topology.nodes > 1 and hpz > 1 and per_node % hpz:
        problems.append(f"deepspeed.zero_optimization.zero_hpz_partition_size={hpz} does not divide the {per_node} "
                        f"rank(s) per node: its groups would span nodes; set it to {per_node} (ranks per node)")
    if topology.nodes > 1 and tp > 1 and per_node % tp:
        problems.append(f"deepspeed.tensor_parallel.autotp_size={tp} does not divide the {per_node} rank(s) per "
                        f"node: tensor-parallel all-reduces would cross nodes; use a divisor of {per_node}")
    if topology.nodes > 1 and dsc.quantized_gradients(resolved.ds) and resolved.config.hardware.gpu == "cpu":
        # checked here: across nodes ZeRO-3 calls all_to_all_quant_reduce, whose quantizer op DeepSpeed's CPU
        # backend lacks ("This op had not been implemented on CPU backend" at the first step); on one node it
        # falls back to a plain reduce-scatter
        problems.append("deepspeed.zero_optimization.zero_quantized_gradients across nodes needs GPUs: DeepSpeed's "
                        "CPU backend has no quantizer kernel for the inter-node gradient all-to-all; turn it off "
                        "on CPU ranks (zero_hpz_partition_size works)")
    if problems:
        raise UserError("the launch topology does not fit the preset:\n  " + "\n  ".join(problems))
