"""One extensions directory and one ninja per Python environment, for DeepSpeed's JIT-built ops.

torch builds each op in <extensions root>/<op>/ with ninja, from the sources and flags its build.ninja lists, and
keeps the .so there. Environments that share torch's default root (~/.cache/torch_extensions/<py>_<accelerator>:
two checkouts, each with its own virtualenv) rewrite each other's build.ninja - their DeepSpeed sources, torch
headers and python differ - and so rebuild each other's ops, 1.5-3 min each on 2 cores. Two ninjas do the same
(Debian's 1.11 and a virtualenv's 1.13, whichever PATH finds first: each reads the other's .ninja_log as a
changed command).

So when the trainer is imported - before DeepSpeed loads anything - this environment gets its own root, a
function of the interpreter's environment (sys.prefix), unless the user chose one with TORCH_EXTENSIONS_DIR; and
the environment's own ninja goes first on PATH. Every rank imports the trainer, so ranks started by any launcher
(DeepSpeed's runner over pdsh/ssh, torchrun, `launch`, Slurm) get the same root and the same ninja without
anything being passed to them; a TORCH_EXTENSIONS_DIR the user sets reaches them as any variable does.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Optional

VARIABLE = "TORCH_EXTENSIONS_DIR"
CHOSEN_FOR = "TRAINER_EXTENSIONS_DIR_FOR"  # the environment (sys.prefix) `settle` chose the root for

NINJA_PIN = "ninja==1.13.2"  # what `pip install` takes when the environment has none (scripts/setup.sh does)


def environment_prefix() -> Path:
    return Path(sys.prefix).resolve()


RESOLVED_ONCE = "TRAINER_INTERPRETER_RESOLVED"  # set before the one re-exec below: never a second


def resolve_interpreter() -> None:
    """Run as the environment's real path when it was reached through a symlink (a virtualenv under a symlinked
    home, a checkout's `.venv` linked to another's): DeepSpeed and torch write the include paths of the modules'
    own locations into each op's build.ninja, so two spellings of one environment would rewrite it in turn and
    rebuild every op at each switch (~8 min on 2 cores). Called first by the entry points (`python -m trainer`,
    train.py, scripts/build_ops.py): re-executes this same command line with the resolved interpreter, once - the
    pid, environment and open files stay; only a process started as this command line is re-executed (a forked
    or embedded interpreter is left alone)."""
    executable = real_executable()
    if executable == Path(sys.executable) or os.environ.get(RESOLVED_ONCE) or not started_as(sys.argv):
        return
    os.environ[RESOLVED_ONCE] = sys.prefix
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(executable, [str(executable), *sys.orig_argv[1:]])


def real_executable() -> Path:
    """This interpreter under the environment's real path (itself when the environment was not reached through a
    symlink, or when the real path has no such interpreter)."""
    prefix, current = Path(sys.prefix), Path(sys.executable)
    if not current.is_relative_to(prefix):
        return current
    executable = environment_prefix() / current.relative_to(prefix)
    return executable if os.access(executable, os.X_OK) else current


def started_as(argv: list[str]) -> bool:
    """This process was started as `python [options] SCRIPT|-m MODULE argv[1:]`: its command line ends with argv's
    arguments, after the script argv names or a `-m`."""
    original, tail = sys.orig_argv, argv[1:]
    start = len(original) - len(tail)
    if start < 2 or original[start:] != tail:
        return False
    return original[start - 1] == argv[0] or original[start - 2] == "-m"


def environment_root(prefix: Optional[Path] = None) -> Path:
    """This environment's extensions root: beside torch's default one, named by the python version and the
    environment's path (readable) plus a digest of it (unique)."""
    prefix = prefix or environment_prefix()
    digest = hashlib.sha256(str(prefix).encode()).hexdigest()[:10]
    readable = re.sub(r"[^A-Za-z0-9._]+", "-", str(prefix)).strip("-")[-48:]
    tag = f"py{sys.version_info.major}{sys.version_info.minor}"
    return torch_cache_root() / f"{tag}-{readable}-{digest}"


def torch_cache_root() -> Path:
    """torch's ~/.cache/torch_extensions (cpp_extension.get_default_build_root), without importing torch."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(os.path.realpath(os.path.join(cache, "torch_extensions")))


def environment_bin() -> Path:
    """Where this environment's console scripts live (a virtualenv's bin/, whether activated or not)."""
    return Path(sysconfig.get_path("scripts"))


def environment_ninja() -> Optional[Path]:
    candidate = environment_bin() / "ninja"
    return candidate if candidate.is_file() and os.access(candidate, os.X_OK) else None


ARCH_LIST = "TORCH_CUDA_ARCH_LIST"
ARCH_LIST_AS_SET = "TRAINER_TORCH_CUDA_ARCH_LIST_AS_SET"  # the value before arch_list_for_deepspeed rewrote it
DEEPSPEED_ARCH = re.compile(r"^(\d+)\.(\d+)(\+PTX)?$")


def arch_list_for_deepspeed(environ=os.environ) -> None:
    """TORCH_CUDA_ARCH_LIST in the form DeepSpeed 0.19.8 parses. Its builder (OpBuilder.compute_capability_args)
    reads each entry as integers around a dot, allowing only '+PTX'; an arch-specific entry such as '9.0a' (CUDA
    images for Hopper set it) fails every op build with "invalid literal for int() with base 10: '0a'". The ops'
    kernels use nothing arch-specific, so the suffix is dropped ('9.0a' -> '9.0'); the value as set is kept in
    TRAINER_TORCH_CUDA_ARCH_LIST_AS_SET."""
    value = environ.get(ARCH_LIST, "")
    entries = [e for e in value.replace(" ", ";").split(";") if e]
    if all(DEEPSPEED_ARCH.match(e) for e in entries):
        return
    fixed = []
    for entry in entries:
        found = re.match(r"^(\d+)\.(\d+)[a-z]*(\+PTX)?$", entry)
        if found:
            fixed.append(f"{found.group(1)}.{found.group(2)}{found.group(3) or ''}")
    environ.setdefault(ARCH_LIST_AS_SET, value)
    environ[ARCH_LIST] = ";".join(dict.fromkeys(fixed))


def settle(environ=os.environ) -> None:
    """Give this process (and so every process it starts) the environment's extensions root, unless the user
    chose one, the environment's ninja first on PATH, and a TORCH_CUDA_ARCH_LIST DeepSpeed can read
    (arch_list_for_deepspeed). Idempotent; cheap (no torch import).

    A root another environment's trainer chose (a test run by one virtualenv starting another's python) is
    not the user's choice: it is replaced by this environment's."""
    if not environ.get(VARIABLE) or chosen_by_an_environment(environ):
        environ[VARIABLE] = str(environment_root())
        environ[CHOSEN_FOR] = str(environment_prefix())
    arch_list_for_deepspeed(environ)
    ninja = environment_ninja()
    if ninja is None:
        return
    path = environ.get("PATH", "")
    found = shutil.which("ninja", path=path)
    if found is None or Path(found).resolve() != ninja.resolve():
        environ["PATH"] = os.pathsep.join([str(ninja.parent)] + [p for p in path.split(os.pathsep)
                                                                  if p and p != str(ninja.parent)])


def chosen_by_an_environment(environ=os.environ) -> bool:
    """TORCH_EXTENSIONS_DIR is the root `settle` chose for some environment (not a value the user set)."""
    prefix = environ.get(CHOSEN_FOR)
    return bool(prefix) and environ.get(VARIABLE) == str(environment_root(Path(prefix)))


def root_origin(environ=os.environ) -> str:
    """How the extensions root was chosen, for the lines that name it."""
    if chosen_by_an_environment(environ):
        return f"this environment's, {environ[CHOSEN_FOR]}"
    return "TORCH_EXTENSIONS_DIR, as set"


def ninja_in_use(environ=os.environ) -> tuple[Optional[str], str]:
    """(path, version) of the ninja torch will run (the first on PATH), (None, '') when there is none."""
    found = shutil.which("ninja", path=environ.get("PATH", ""))
    if found is None:
        return None, ""
    try:
        version = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        version = "?"
    return found, version


def missing_ninja_message(op: str) -> str:
    return (f"DeepSpeed's {op} op must be compiled on first use, with ninja, and there is no `ninja` in this "
            f"environment ({environment_bin()}) nor on PATH. Install it into the environment that runs the ranks: "
            f"{sys.executable} -m pip install {NINJA_PIN} (scripts/setup.sh does), then rerun - the trainer puts "
            f"that ninja first on PATH for every rank")
