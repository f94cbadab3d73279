"""Process start-up paid once per test worker: a `python` that has imported torch, DeepSpeed, transformers,
datasets and PEFT (tests/workers/preloaded_server.py) forks each command the suite runs - a 2-rank launch
(`deepspeed --num_gpus 2 --master_port P train.py ...`), `python -m trainer generate ...`, a test worker script.

Each job is still a process of its own (own session, environment, directory, stdio and exit code; ranks get the
environment and failure policy of DeepSpeed's per-node launcher), so a test sees what a user's command does; what
it saves is ~7 s of imports per process (a 2-rank launch starts 4 Pythons: DeepSpeed's runner, its per-node
launcher and the ranks). Measured numbers are in docs/tests.md.

A job is forked from a server whose environment is the job's (other than the trainer's and the tests' own
TRAINER_*, TEST_* variables, wandb's, and PYTHONPATH and PYTHONUNBUFFERED, which the fork applies): a test's
TORCH_EXTENSIONS_DIR, HF_HOME or PATH reach third-party imports, so they get a server that imported under them.
A worker keeps its own environment's server and the last two of others (`Server.for_env`); a 2-rank launch in
a new environment starts one at once (one preload instead of four Pythons: DeepSpeed's runner, its per-node
launcher and the two ranks), a single command only when its environment comes a second time (before that, a
server would cost what the real process costs).
A command runs as a real process instead when the fork could differ from it:
- the command line is not one of the three shapes above (other interpreter flags, another launcher's options);
- TRAINER_TEST_PRELOAD=0 in the worker's environment (every command real: the check that the fork changes
  nothing) or in the command's (this one real);
- a single command in an environment seen for the first time (above).
Tests about the launchers themselves (their output, their signal handling) start them with subprocess directly.
A forked process shows the server's command line and first environment in /proc (the kernel's copy, made at exec,
without the per-test TRAINER_*, TEST_*, PYTEST_*, WANDB_* variables): find it by its session
(trainer/process_tree.py), not by a marker - a test that looks for its processes by a marker runs them real
(TRAINER_TEST_PRELOAD=0 in the command's environment); what a forked process execs shows its own.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
SERVER = REPO / "tests" / "workers" / "preloaded_server.py"
DEEPSPEED = Path(sys.executable).parent / "deepspeed"
# Variables a job may set differently from the server: read after the fork (by the trainer, the tests, pytest's
# PYTEST_CURRENT_TEST that changes at every test, wandb: none of them preloaded), or applied to the fork (sys.path
# from PYTHONPATH, stdio buffering)
AFTER_THE_FORK = ("TRAINER_", "TEST_", "PYTEST_", "WANDB_", "PYTHONPATH", "PYTHONUNBUFFERED")
# Of those, the ones a server does not start with: it outlives the test that started it (the pool keeps it), and a
# test that looks for its processes by a marker in their environment (TEST_MARKER) must not find the server
PER_TEST = ("TRAINER_", "TEST_", "PYTEST_", "WANDB_")
START_TIMEOUT_S = 300


def enabled() -> bool:
    return os.environ.get("TRAINER_TEST_PRELOAD", "1") != "0"


def job_for(cmd: list, cwd, env: Optional[dict], server_env: dict) -> Optional[dict]:
    """The job for `cmd`, or None when it must run as a real process."""
    words = [str(word) for word in cmd]
    env = dict(os.environ if env is None else env)
    if not enabled() or env.get("TRAINER_TEST_PRELOAD") == "0" or not same_imports(env, server_env):
        return None
    job = {"cwd": str(Path(cwd or os.getcwd()).resolve()), "env": env}
    if words[0] == str(DEEPSPEED):
        return ranks_job(words[1:], job)
    if words[0] != sys.executable or len(words) < 2:
        return None
    target = python_target(words[1:])
    return None if target is None else {**job, **target}


def same_imports(env: dict, reference: dict) -> bool:
    return environment_key(env) == environment_key(reference)


def python_target(words: list[str]) -> Optional[dict]:
    """`-m MODULE ARGS` or `SCRIPT.py ARGS`; None for anything else (-c, -u, -X ...), and for the trainer's light
    commands: they would not import the preloaded packages (trainer/commands.py), and must not find them imported."""
    if words[0] == "-m" and len(words) >= 2:
        if words[1] == "trainer" and not heavy_trainer_command(words[2:]):
            return None
        return {"kind": "module", "module": words[1], "args": words[2:]}
    if words[0].endswith(".py") and not words[0].startswith("-"):
        return {"kind": "script", "path": words[0], "args": words[1:]}
    return None


def heavy_trainer_command(args: list[str]) -> bool:
    from trainer.commands import COMMANDS
    command = next((word for word in args if not word.startswith("-")), None)
    return command in COMMANDS and COMMANDS[command].heavy and "--help" not in args and "-h" not in args


def ranks_job(words: list[str], job: dict) -> Optional[dict]:
    """`--num_gpus N --master_port P (--module MODULE | SCRIPT) ARGS`, the shape tests/distributed.py writes."""
    if len(words) < 5 or words[0] != "--num_gpus" or words[2] != "--master_port":
        return None
    rest = words[4:]
    if rest[0] == "--module":
        target = {"kind": "module", "module": rest[1]}
        args = rest[2:]
    elif rest[0].endswith(".py"):
        target = {"kind": "script", "path": rest[0]}
        args = rest[1:]
    else:
        return None
    return {**job, "kind": "ranks", "ranks": int(words[1]), "master_port": int(words[3]), "target": target,
            "args": args}


class Server:
    """A preloaded interpreter started under one environment (started when a job needs it, ended with the worker
    or when the pool makes room)."""
    pool: "dict[tuple, Server]" = {}  # environment (its third-party part) -> server, least recently used first
    seen: set = set()  # environments a single command came in without a server: the next one starts it
    OTHER_ENVIRONMENTS = 2  # servers kept besides the worker's own (each holds ~0.7 GB of imports)

    def __init__(self, env: dict):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.env = {k: v for k, v in env.items() if not k.startswith(PER_TEST)}
        self.proc = subprocess.Popen([sys.executable, str(SERVER), str(theirs.fileno())], pass_fds=[theirs.fileno()],
                                     cwd=REPO, env=self.env, stdin=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        self.channel = ours
        self.current: Optional[Forked] = None
        self.channel.settimeout(START_TIMEOUT_S)
        ready = self.receive()
        assert "ready" in ready, ready

    @classmethod
    def for_env(cls, env: dict, ranks: bool) -> Optional["Server"]:
        """The server for a job in `env`: the running one, or a new one when it pays (above); None: run it real."""
        key = environment_key(env)
        server = cls.pool.pop(key, None)
        if server is not None and server.proc.poll() is not None:
            server.close()
            server = None
        if server is None:
            worker = key == environment_key(dict(os.environ))
            if not (worker or ranks or key in cls.seen):
                cls.seen.add(key)
                return None
            if not worker:
                cls.make_room()
            server = Server(env)
        cls.pool[key] = server  # now the most recently used
        return server

    @classmethod
    def make_room(cls) -> None:
        """Close the least recently used servers of other environments than the worker's, keeping room for one."""
        worker = environment_key(dict(os.environ))
        others = [key for key in cls.pool if key != worker]
        for key in others[:max(0, len(others) - cls.OTHER_ENVIRONMENTS + 1)]:
            cls.pool.pop(key).close()

    def close(self) -> None:
        self.channel.close()  # the server exits at the end of its input
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def receive(self) -> dict:
        message = self.channel.recv(1 << 16)
        if not message:
            raise RuntimeError(f"the preloaded server (pid {self.proc.pid}) ended: exit {self.proc.wait()}")
        return json.loads(message)

    def start(self, job: dict, merge: bool, args: list) -> "Forked":
        if self.current is not None:  # one job at a time (a worker runs one test): the last one has been stopped
            self.current.wait(timeout=60)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe() if not merge else (None, None)
        fds = [out_w] if merge else [out_w, err_w]
        self.channel.settimeout(START_TIMEOUT_S)
        socket.send_fds(self.channel, [json.dumps(job).encode()], fds)
        for fd in fds:
            os.close(fd)
        reply = self.receive()
        self.current = Forked(self, reply["pid"], out_r, err_r, args)
        return self.current


class Forked:
    """A job's process, as much of subprocess.Popen as the harness uses (pid, poll, wait, returncode, stdout,
    stderr). Not our child (the server's): its exit code comes over the server's socket."""

    def __init__(self, server: Server, pid: int, out_fd: int, err_fd: Optional[int], args: list):
        self.server, self.pid, self.returncode, self.args = server, pid, None, args
        self.stdout = open(out_fd, "r", errors="replace")
        self.stderr = open(err_fd, "r", errors="replace") if err_fd is not None else None
        self.started = time.monotonic()

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.server.channel.settimeout(0)
            try:
                self.returncode = self.server.receive()["exit"]
            except (BlockingIOError, socket.timeout):
                return None
            log_process(self.args, time.monotonic() - self.started, self.returncode, forked=True)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode


def start(cmd: list, cwd=None, env: Optional[dict] = None, merge: bool = True):
    """A Forked job for `cmd` when it can be one, else None (the caller starts a real process)."""
    env = dict(os.environ if env is None else env)
    job = job_for(cmd, cwd, env, env) if enabled() else None
    server = None if job is None else Server.for_env(env, ranks=job["kind"] == "ranks")
    return None if server is None else server.start(job, merge, [str(word) for word in cmd])


def environment_key(env: dict) -> tuple:
    """What of an environment the preloaded packages read: all of it but the variables read after the fork."""
    return tuple(sorted((k, v) for k, v in env.items() if not k.startswith(AFTER_THE_FORK)))


def log_process(args: list, seconds: float, code: Optional[int], forked: bool) -> None:
    """Measurement (TRAINER_TEST_PROCESS_LOG, docs/tests.md "where the time goes"): one JSON line per process a test
    started - the test, the command's first words, seconds alive, forked or not. Workers append whole lines."""
    path = os.environ.get("TRAINER_TEST_PROCESS_LOG")
    if not path:
        return
    words = [os.path.basename(str(w)) for w in ([args] if isinstance(args, (str, bytes)) else args)][:8]
    line = json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", ""), "words": words, "seconds": round(seconds, 2),
                       "code": code, "forked": forked})
    with open(path, "a") as log:
        log.write(line + "\n")
