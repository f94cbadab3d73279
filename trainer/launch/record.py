"""What a launch prints and leaves behind: the command in full, `launch.json` in the run directory, and the
`.deepspeed_env` for DeepSpeed's pdsh runner."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Optional

from ..errors import UserError
from ..files import finite_json, write_text_atomic
from ..presets import REPO_ROOT
from ..redact import redact_argv
from ..resolve import Resolved
from .command import cpu_offloaded, join
from .fabric import Fabric, deepspeed_env_text
from .topology import Topology


def print_command(words: list[str]) -> None:
    """In full (secrets in --set redacted), on its own line, so it can be copied and run by hand."""
    print("launch: the command:", flush=True)
    print(join(redact_argv(words)), flush=True)


def record_launch(resolved: Resolved, args, topology: Topology, fabric: Optional[Fabric], words: list[str],
                  extra: Optional[dict] = None) -> Path:
    """`<output_dir>/launch.json`, written whole before the ranks start: how this run was started."""
    run_dir = Path(resolved.config.train.output_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"train.output_dir {str(run_dir)!r}: cannot create it ({err.strerror}); choose another with "
                        f"--set train.output_dir=PATH") from None
    record = {"launcher": topology.launcher, "command": join(redact_argv(words)), "argv": redact_argv(words),
              "cwd": os.getcwd(), "world_size": topology.world_size, "nodes": topology.nodes,
              "ranks_per_node": topology.ranks_per_node, "cpu_offload": cpu_offloaded(resolved),
              "hostfile": topology.hostfile.as_dict() if topology.hostfile else None,
              "fabric": fabric.as_dict() if fabric else None,
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **(extra or {})}
    return write_text_atomic(str(run_dir / "launch.json"), finite_json(record) + "\n", flag="launch.json")


def script_path() -> str:
    """train.py as the launch line names it: relative from the repository root, else the absolute path."""
    return "train.py" if Path("train.py").resolve() == REPO_ROOT / "train.py" else str(REPO_ROOT / "train.py")


def deepspeed_env_file(resolved: Resolved, fabric: Optional[Fabric], dry_run: bool) -> tuple[Optional[str], str]:
    """(path, text) of the .deepspeed_env for DeepSpeed's pdsh runner, in the run directory (DS_ENV_FILE names
    it): the user's own ~/.deepspeed_env and ./.deepspeed_env are merged in, never overwritten."""
    if fabric is None:
        return None, ""
    text, notes = deepspeed_env_text(fabric)
    for note in notes:
        print(f"launch: note: {note}", file=sys.stderr)
    path = str(Path(resolved.config.train.output_dir).resolve() / "deepspeed_env")
    if not dry_run:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, text, flag="deepspeed_env")
    return path, text
