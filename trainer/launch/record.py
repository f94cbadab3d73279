"""What a launch prints and leaves behind: the command in full and `launch.json` in the run directory (0600),
both without secret values (`--set` secrets and secret-looking NAME=value assignments are <redacted>)."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Optional

from ..errors import UserError
from ..files import finite_json, write_text_atomic
from ..presets import REPO_ROOT
from ..redact import REDACTED, looks_secret, redact_argv
from ..resolve import Resolved
from ..run_dir import set_aside_previous_run
from .command import cpu_offloaded
from .fabric import Fabric
from ..shell import EnvAssignment, join
from .topology import Topology


def print_command(words: list[str]) -> None:
    """In full (secrets redacted), on its own line, so it can be copied and run by hand."""
    print("launch: the command:", flush=True)
    print(join(shown(words)), flush=True)


def shown(words: list[str]) -> list[str]:
    """`words` as they may be printed and recorded: secrets in --set items and assignments <redacted>."""
    return [EnvAssignment(word.name, REDACTED) if isinstance(word, EnvAssignment) and looks_secret(word.name)
            else redacted for word, redacted in zip(words, redact_argv(words))]


def record_launch(resolved: Resolved, args, topology: Topology, fabric: Optional[Fabric], words: list[str],
                  extra: Optional[dict] = None) -> Path:
    """`<output_dir>/launch.json`, written whole before the ranks start: how this run was started."""
    run_dir = Path(resolved.config.train.output_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"train.output_dir {str(run_dir)!r}: cannot create it ({err.strerror}); choose another with "
                        f"--set train.output_dir=PATH") from None
    record = {"launcher": topology.launcher, "command": join(shown(words)), "argv": [str(w) for w in shown(words)],
              "cwd": os.getcwd(), "world_size": topology.world_size, "nodes": topology.nodes,
              "ranks_per_node": topology.ranks_per_node, "cpu_offload": cpu_offloaded(resolved),
              "hostfile": topology.hostfile.as_dict() if topology.hostfile else None,
              "fabric": fabric.as_dict() if fabric else None,
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **(extra or {})}
    return write_text_atomic(str(run_dir / "launch.json"), finite_json(record) + "\n", flag="launch.json", mode=0o600)


PER_NODE_LAUNCHERS = ("torchrun", "local")  # started once on every node, each with its --node-rank


def owns_run_directory(args, launcher: str) -> bool:
    """Whether this launch reads and writes the run directory's start (the fresh-start rule, launch.json). One
    launch per job does: a per-node launcher is started on every node into one shared directory, and node 0's
    launch owns it - another node that checked it would find node 0's launch.json and refuse it, or set it aside."""
    return launcher not in PER_NODE_LAUNCHERS or not args.node_rank


def set_aside_for_a_fresh_launch(resolved: Resolved, starts_fresh: bool) -> None:
    """Before a launch that starts its run fresh writes anything: a previous run in the run directory (its launch
    records too) moves whole to previous/<time>/, as the training itself would (trainer/run_dir.py)."""
    if not starts_fresh:
        return
    moved = set_aside_previous_run(Path(resolved.config.train.output_dir), keep_startup_files=False)
    if moved:
        print(moved.message("launch"), file=sys.stderr, flush=True)


def script_path() -> str:
    """train.py as the launch line names it: relative from the repository root, else the absolute path."""
    return "train.py" if Path("train.py").resolve() == REPO_ROOT / "train.py" else str(REPO_ROOT / "train.py")
