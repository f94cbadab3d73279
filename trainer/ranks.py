"""Which rank this process is, whether or not a process group exists (a plain `python` run, a unit test
and the first lines of a launch have none): one place instead of `if dist.is_initialized()` everywhere."""
from __future__ import annotations

import torch.distributed as dist


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def launched_world_size() -> int:
    """The ranks the launcher started (WORLD_SIZE), known before the process group exists; 1 without one."""
    import os
    return int(os.environ.get("WORLD_SIZE", "1"))
