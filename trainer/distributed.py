"""Start-up and shut-down of a rank: the process group (with the run's timeout), this rank's device, seeds,
and DeepSpeed's shared-memory buffer that it leaves behind. Training, inference and preflight start the
same way; `ranks` answers "which rank am I" once a group exists (or not).
"""
from __future__ import annotations

import json
import os
import random
import socket
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from . import jit_ops, ranks, shm_buffers
from .errors import UserError


def start_distributed(timeout_s: int = 1800) -> int:
    """deepspeed.init_distributed under a launcher; a one-rank group for a plain `python` run. Each rank
    binds its accelerator first, so collectives before deepspeed.initialize use the right device."""
    import datetime

    import deepspeed
    from deepspeed.accelerator import get_accelerator
    cpu_info_once()  # before the ops load: init_distributed loads DeepSpeed's comm op, deepspeed.initialize its Adam
    launch = ranks.launch_environment()  # a leftover half of a launcher's variables is a named error here
    if launch is None:  # one process: a group of one, so the code is the same as under a launcher
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    if get_accelerator().device_name() != "cpu":
        get_accelerator().set_device(launch.local_rank if launch else 0)
    threads_per_rank()
    if "LOCAL_SIZE" not in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        # DeepSpeed's CPU shared-memory all-reduce sets itself up only when LOCAL_SIZE (its launcher's name) equals
        # the world size, yet AutoTP's layers call it regardless: under torchrun (LOCAL_WORLD_SIZE) it segfaults
        os.environ["LOCAL_SIZE"] = os.environ["LOCAL_WORLD_SIZE"]
    remove_shm_buffer()  # a stale one of a crashed job on this port would be read by the peers before reset
    # init_distributed builds DeepSpeed's CPU all-reduce op, deepspeed.initialize its optimizers: each op load is
    # announced (and a lock file left by a killed build named) instead of minutes of silence
    jit_ops.install(_to_stderr)
    if launch is None or launch.world_size == 1:
        no_shared_memory_op()
    timeout = datetime.timedelta(seconds=timeout_s)
    # DeepSpeed builds its data/model-parallel groups with new_group(timeout=None), which takes torch's
    # default (30 min gloo, 10 min NCCL), not the world group's: set the default itself, so every
    # collective of the run (ZeRO's gradient reduction included) gives up after train.dist_timeout_s.
    from torch.distributed import distributed_c10d
    distributed_c10d.default_pg_timeout = distributed_c10d.default_pg_nccl_timeout = timeout
    deepspeed.init_distributed(timeout=timeout)
    return dist.get_rank()


def threads_per_rank() -> int:
    """Each rank's share of this node's cores as its intra-op thread count, unless OMP_NUM_THREADS says otherwise.
    torch starts one thread per core in every process and DeepSpeed's launcher sets OMP_NUM_THREADS only with
    --bind_cores_to_rank, so N ranks on a node would run N x cores threads: on CPU ranks (and for the CPU Adam of
    offloaded runs) that oversubscription made a TP=2 generate 3-10x slower than one thread per rank. Every launch
    line (README, presets, plan, doctor, launch) gets the fit this way, without an environment prefix to forget."""
    if os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()  # the user's (or --bind_cores_to_rank's) choice
    named = os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or "1"
    if not named.isdigit():
        return torch.get_num_threads()  # not a launcher's count: torch's own choice stands (the launcher fails on it)
    local_ranks = int(named)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = max(1, cores // max(local_ranks, 1))
    if threads < torch.get_num_threads():
        torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # for processes this rank starts (op builds, data workers)
    return torch.get_num_threads()


def no_shared_memory_op() -> None:
    """One rank has no peer to share memory with, yet DeepSpeed's TorchBackend builds (1.5 min on 2 cores, the
    first time) or loads its CPU shared-memory all-reduce op whatever the world size (comm/torch.py build_shm_op in
    0.19.8). Without the op its collectives are torch.distributed's, which return at once on one rank: a one-rank
    generate, evaluate or training builds nothing it does not use."""
    import importlib
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None  # not `from deepspeed.comm
    # import torch`: that package's `torch` attribute is torch itself


def cpu_info_once() -> None:
    """py-cpuinfo's answer kept for the process. DeepSpeed asks it twice for every op it loads, built or not
    (op_builder's cpu_arch and simd_width, for the compiler flags), and py-cpuinfo answers each call from a fresh
    Python subprocess: about 1.2 s a call on 2 busy cores, 2.5 s per op before the first step. The CPU does not
    change under a running process; each caller gets its own copy of the first answer."""
    try:
        import cpuinfo
    except ImportError:
        return  # DeepSpeed then asks lscpu
    if getattr(cpuinfo.get_cpu_info, "kept_for_the_process", False):
        return
    import copy
    import functools
    ask = functools.lru_cache(maxsize=1)(cpuinfo.get_cpu_info)

    @functools.wraps(cpuinfo.get_cpu_info)
    def get_cpu_info():
        return copy.deepcopy(ask())
    get_cpu_info.kept_for_the_process = True
    cpuinfo.get_cpu_info = get_cpu_info  # DeepSpeed imports it by name at every call


def _to_stderr(message: str) -> None:
    print(f"[rank {os.environ.get('RANK', '0')}] {message}", file=sys.stderr, flush=True)


def end_distributed(succeeded: bool = True) -> None:
    """After a successful run: wait for every rank, remove this rank's shared-memory buffer, and tear the
    process group down before the interpreter exits."""
    if not dist.is_initialized():
        return
    if succeeded:
        dist.barrier()  # no peer still reads this rank's buffer
        remove_shm_buffer()
    dist.destroy_process_group()


def shm_buffer_path() -> Path:
    """DeepSpeed's CPU shared-memory all-reduce buffer of this rank (trainer/shm_buffers.py), which DeepSpeed
    0.19.8 never unlinks: every CPU job would leave one per rank."""
    return shm_buffers.buffer_path(os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", ""),
                                   os.environ.get("RANK", "0"))


def remove_shm_buffer() -> None:
    shm_buffers.remove([shm_buffer_path()])


def comm_device():
    """The device collectives run on before the engine exists (CPU under gloo, this rank's GPU under NCCL)."""
    from deepspeed.accelerator import get_accelerator
    return torch.device(get_accelerator().current_device_name())


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def seed_everything(seed: int, rank: int) -> None:
    """Dropout and other runtime randomness differ per rank; init and data order have their own seeds."""
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)


def all_gather_text(text: str, device) -> list[str]:
    """Every rank's `text`, in rank order, on every rank. Also a synchronisation point (no pickle between ranks)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [text]
    data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device))
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    gathered = [torch.zeros(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return [bytes(g[:int(s.item())].cpu().tolist()).decode() for g, s in zip(gathered, sizes)]


def gather_text(text: str) -> list[str]:
    """`all_gather_text` on the collective device; [text] without a process group (no accelerator import)."""
    if ranks.world_size() == 1:
        return [text]
    return all_gather_text(text, comm_device())


def rank0_first(build):
    """Run `build` on rank 0 first, then on the others (a hub dataset is downloaded once, a cache prepared once),
    and end together: a failure on any rank is raised on every rank with its message (rank 0's before the others
    start), so no rank waits in a later collective for one that has given up."""
    if ranks.world_size() == 1:
        return build()
    rank = ranks.rank()
    result, failure = _attempt(build) if rank == 0 else (None, None)
    _raise_shared(gather_text(_described(failure))[0], 0, failure)
    if rank != 0:
        result, failure = _attempt(build)
    for other, text in enumerate(gather_text(_described(failure))):
        _raise_shared(text, other, failure)
    return result


def rank0_only(work) -> None:
    """Run `work` on rank 0 alone (writing a shared file) while the others wait; a failure there is raised on every
    rank with its message, so no rank waits in a later collective for one that has given up."""
    failure = _attempt(work)[1] if ranks.rank() == 0 else None
    _raise_shared(gather_text(_described(failure))[0], 0, failure)


def shared_problems(problems: list[str]) -> list[str]:
    """Every rank's problems, the same list on every rank (each problem once, rank 0's first)."""
    views = gather_text(json.dumps(problems))
    return list(dict.fromkeys(p for view in views for p in json.loads(view)))


def _attempt(build):
    try:
        return build(), None
    except BaseException as err:  # shared first, then raised again on this rank
        return None, err


def _described(failure) -> str:
    if failure is None:
        return ""
    if isinstance(failure, UserError):
        return json.dumps({"user": True, "message": str(failure)})
    return json.dumps({"user": False, "message": f"{type(failure).__name__}: {failure}"})


def _raise_shared(text: str, rank: int, own) -> None:
    """Raise the failure `rank` shared: this rank's own exception when it is the one that failed, else the same
    message (a UserError for a user's mistake, so the CLI prints it without a traceback)."""
    if not text:
        return
    if own is not None:
        raise own
    shared = json.loads(text)
    if shared["user"]:
        raise UserError(shared["message"])
    raise RuntimeError(f"rank {rank} failed: {shared['message']}")
