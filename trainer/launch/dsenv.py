"""The `.deepspeed_env` that DeepSpeed's multi-node (pdsh) runner exports on every node, and where it lies.

DeepSpeed's runner reads the file named by DS_ENV_FILE (default `.deepspeed_env`) in ~ and in the working
directory (`os.path.join(dir, name)`: an absolute DS_ENV_FILE is that one file, for both) and pastes every line
into each node's ssh command as `export NAME=value;`. The launch names its own file in DS_ENV_FILE so the fabric
profile gets there, with the user's ~/.deepspeed_env and ./.deepspeed_env merged in (theirs win), as DeepSpeed
would have read them; each of their lines is checked (file:line) since it reaches each node's shell.

Secrets. Those files may hold WANDB_API_KEY, HF_TOKEN, ... (names that `redact.looks_secret`). DS_ENV_FILE is
the only way DeepSpeed exports a variable to the other nodes (ssh does not carry the launcher's environment),
so the values must be in the file it names; they never lie in the run directory and are never printed:
- `<run>/deepspeed_env` (0600) is the record, secret values written as <redacted>; when nothing secret is in it,
  it is also the file DS_ENV_FILE names;
- otherwise DS_ENV_FILE names a private copy holding the values: 0600 in a fresh 0700 directory under the
  temporary directory, removed when DeepSpeed's runner exits (it reads the file once, at its start);
- DeepSpeed logs its pdsh command, exports included: the runner's output passes through `start_redacted`,
  which writes every secret value as <redacted>.
(DeepSpeed still puts the exports on the pdsh and ssh command lines, visible in `ps` on the launching node
and in each node's process list while the ranks start: that is DeepSpeed's mechanism, as without the launch.)
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from ..errors import UserError
from ..files import read_text, write_text_atomic
from ..redact import REDACTED, looks_secret
from .fabric import NAME, Fabric, duplicate
from ..shell import export_value_problem


MIN_REDACTED_LENGTH = 4  # shorter values are not searched for in the output: "1" would be redacted everywhere
PRIVATE = 0o600


@dataclass(frozen=True)
class DeepSpeedEnv:
    entries: tuple[tuple[str, str], ...]  # (NAME, value) as DeepSpeed exports them, later files winning
    secrets: tuple[str, ...]              # the names whose values are secret
    notes: tuple[str, ...] = ()

    def text(self, redacted: bool = True) -> str:
        """Plain `NAME=value` lines (DeepSpeed splits every line at the first '='; no comments)."""
        return "".join(f"{name}={REDACTED if redacted and name in self.secrets else value}\n"
                       for name, value in self.entries)

    @property
    def secret_values(self) -> list[str]:
        return [value for name, value in self.entries if name in self.secrets and len(value) >= MIN_REDACTED_LENGTH]


@dataclass(frozen=True)
class EnvFile:
    path: str         # what DS_ENV_FILE names
    record: str       # <run>/deepspeed_env
    env: DeepSpeedEnv

    def as_dict(self) -> dict:
        return {"path": self.path, "record": self.record, "text": self.env.text(), "secrets": list(self.env.secrets)}


def deepspeed_env(fabric: Optional[Fabric]) -> DeepSpeedEnv:
    """The profile, then the user's own files as DeepSpeed would have read them, so theirs still win."""
    profile = dict(fabric.env) if fabric else {}
    merged, notes = dict(profile), []
    for path in user_env_files():
        if not path.is_file():
            continue
        for name, value in parse_user_env(read_text(path, "DeepSpeed environment file", allow_empty=True,
                                                    also_read_by="DeepSpeed's runner"),
                                          str(path)):
            if name in profile and profile[name] != value:  # a profile never holds a secret (fabric.parse_env)
                notes.append(f"{path} sets {name}={value} over the fabric profile's {profile[name]}")
            merged[name] = value
    return DeepSpeedEnv(tuple(merged.items()), tuple(n for n in merged if looks_secret(n)), tuple(notes))


def user_env_files() -> list[Path]:
    """Where DeepSpeed's runner would look for the user's file (runner.py: DS_ENV_FILE, else .deepspeed_env,
    joined to ~ and to the working directory, in that order; an absolute name is one file)."""
    name = os.environ.get("DS_ENV_FILE", ".deepspeed_env")
    paths = [Path(os.path.expanduser("~")) / name, Path(name) if os.path.isabs(name) else Path(".") / name]
    return paths[:1] if paths[0] == paths[1] else paths


def parse_user_env(text: str, source: str) -> list[tuple[str, str]]:
    """A user's .deepspeed_env: `NAME=value` lines (blank and # lines skipped: DeepSpeed itself would stop on
    them); every line that DeepSpeed would break on, or that the node's shell would run as code, is refused
    with its file:line."""
    entries, problems, first = [], [], {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = (part.strip() for part in line.partition("="))
        where = f"{source}:{number}"
        twice = duplicate(name, number, first, source) if sep and NAME.match(name) else None
        if twice:
            problems.append(twice)
        elif not sep or not NAME.match(name):  # the line itself is not quoted: it may be a bare secret
            problems.append(f"{where}: not NAME=value{f' ({name[:40]!r} is no variable name)' if sep else ''}: "
                            f"DeepSpeed's runner splits each line at '=' and exports NAME on every node")
        elif export_value_problem(value, variables=True):
            problems.append(f"{where}: the value of {name}: {export_value_problem(value, variables=True)}; "
                            f"write it without them")
        else:
            entries.append((name, value))
    if problems:
        raise UserError("DeepSpeed environment file problems:\n  " + "\n  ".join(problems))
    return entries


@contextmanager
def deepspeed_env_file(fabric: Optional[Fabric], run_dir: Path, dry_run: bool) -> Iterator[Optional[EnvFile]]:
    """The file for DS_ENV_FILE, written (unless a dry run) for as long as the block runs; None when there
    is nothing to export. A private copy holding secret values is removed when the block ends."""
    env = deepspeed_env(fabric)
    if not env.entries:
        yield None
        return
    for note in env.notes:
        print(f"launch: note: {note}", file=sys.stderr)
    record = str(run_dir.resolve() / "deepspeed_env")
    private = None
    if not dry_run:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(record, env.text(), flag="deepspeed_env", mode=PRIVATE)
        if env.secrets:
            private = tempfile.mkdtemp(prefix="trainer-deepspeed-env-")  # 0700
            write_private(os.path.join(private, "deepspeed_env"), env.text(redacted=False))
    path = (os.path.join(private, "deepspeed_env") if private else
            os.path.join(tempfile.gettempdir(), "trainer-deepspeed-env-XXXXXXXX", "deepspeed_env") if env.secrets
            else record)
    try:
        yield EnvFile(path, record, env)
    finally:
        if private:
            shutil.rmtree(private, ignore_errors=True)


def write_private(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)


def start_redacted(argv: list[str], env: dict, secrets: list[str]) -> tuple[subprocess.Popen, Callable[[], None]]:
    """Popen(argv) whose stdout and stderr reach ours with every secret value written as <redacted>; and the
    function that waits for the last of its output. Without secrets the child writes to ours directly."""
    if not secrets:
        return subprocess.Popen(argv, env=env), lambda: None
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    pumps = [threading.Thread(target=_pump, args=(source, sink, [s.encode() for s in secrets]), daemon=True)
             for source, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))]
    for pump in pumps:
        pump.start()

    def finish() -> None:
        for pump in pumps:
            pump.join(timeout=10)  # a grandchild that keeps the pipe open must not hold the exit
    return proc, finish


def _pump(source, sink, secrets: list[bytes]) -> None:
    out = sink.buffer if hasattr(sink, "buffer") else None
    for line in iter(source.readline, b""):
        for secret in secrets:
            line = line.replace(secret, REDACTED.encode())
        if out is not None:
            out.write(line)
            out.flush()
        else:
            sink.write(line.decode("utf-8", "replace"))
            sink.flush()
