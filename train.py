"""Entry point for the launchers: `deepspeed train.py --preset NAME [--set k=v ...]` or `torchrun ... train.py`.

Everything lives in the `trainer` package; this file only forwards the command line (including the
launcher's --local_rank) to `python -m trainer train`.
"""
import sys

from trainer import jit_env
from trainer.__main__ import main

if __name__ == "__main__":
    jit_env.resolve_interpreter()  # a virtualenv reached through a symlink: run as its real path, before any op loads
    sys.exit(main(["train", *sys.argv[1:]]))
