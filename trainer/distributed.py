"""Start-up and shut-down of a rank: the process group (with the run's timeout), this rank's device, seeds,
and DeepSpeed's shared-memory buffer that it leaves behind. Training, inference and preflight start the
same way; `ranks` answers "which rank am I" once a group exists (or not).
"""
from __future__ import annotations

import os
import random
import socket
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from . import jit_locks, ranks


def start_distributed(timeout_s: int = 1800) -> int:
    """deepspeed.init_distributed under a launcher; a one-rank group for a plain `python` run. Each rank
    binds its accelerator first, so collectives before deepspeed.initialize use the right device."""
    import datetime

    import deepspeed
    from deepspeed.accelerator import get_accelerator
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    if get_accelerator().device_name() != "cpu":
        get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if "LOCAL_SIZE" not in os.environ and "LOCAL_WORLD_SIZE" in os.environ:
        # DeepSpeed's CPU shared-memory all-reduce sets itself up only when LOCAL_SIZE (its launcher's name) equals
        # the world size, yet AutoTP's layers call it regardless: under torchrun (LOCAL_WORLD_SIZE) it segfaults
        os.environ["LOCAL_SIZE"] = os.environ["LOCAL_WORLD_SIZE"]
    remove_shm_buffer()  # a stale one of a crashed job on this port would be read by the peers before reset
    # init_distributed builds DeepSpeed's CPU all-reduce op, deepspeed.initialize its optimizers: a lock file left
    # by a killed build would make them wait for ever in silence
    jit_locks.check_and_watch(_to_stderr)
    timeout = datetime.timedelta(seconds=timeout_s)
    # DeepSpeed builds its data/model-parallel groups with new_group(timeout=None), which takes torch's
    # default (30 min gloo, 10 min NCCL), not the world group's: set the default itself, so every
    # collective of the run (ZeRO's gradient reduction included) gives up after train.dist_timeout_s.
    from torch.distributed import distributed_c10d
    distributed_c10d.default_pg_timeout = distributed_c10d.default_pg_nccl_timeout = timeout
    deepspeed.init_distributed(timeout=timeout)
    return dist.get_rank()


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
    """DeepSpeed's CPU shared-memory all-reduce buffer of this rank (69 MB in /dev/shm), which DeepSpeed
    0.19.8 never unlinks (its shm.cpp names it uid_addr_port_rank): every CPU job would leave one per rank."""
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{os.environ.get('RANK', '0')}")
    return Path("/dev/shm") / name


def remove_shm_buffer() -> None:
    try:
        shm_buffer_path().unlink()
    except (FileNotFoundError, PermissionError, IsADirectoryError):
        pass


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


def rank0_first(build):
    """Run `build` on rank 0 first, then on the others: a data error is reported once, by rank 0, while the
    others wait (the launcher then stops them), and a hub dataset is downloaded once into the cache."""
    if ranks.rank() != 0:
        ranks.barrier()
    result = build()
    if ranks.rank() == 0:
        ranks.barrier()
    return result
