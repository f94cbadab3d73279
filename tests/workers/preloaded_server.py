"""The preloaded interpreter behind tests/preloaded.py: it imports the third-party packages a rank or a heavy command
imports (torch, DeepSpeed, transformers, datasets, PEFT: ~7 s of a fresh process's start here) once, then runs
each job it is sent in a fork of itself - a new process with its own session, environment, working directory,
stdout/stderr and exit code, as `python ...` would be, minus the imports.

Jobs (one JSON message each on the socket, with the job's stdout and stderr as passed file descriptors):
  {"kind": "module", "module": "trainer", "args": [...]}         python -m trainer ARGS
  {"kind": "script", "path": "train.py", "args": [...]}          python train.py ARGS
  {"kind": "ranks", "ranks": N, "master_port": P, "target": ...}  deepspeed --num_gpus N --master_port P ...: N
      rank processes with the environment and `--local_rank=I` DeepSpeed's per-node launcher gives them, and its
      policy (deepspeed/launcher/launch.py): a rank that fails gets the others terminated (SIGTERM, SIGKILL after
      30 s) and its exit code is the job's; SIGINT/SIGTERM to the job is passed to every rank.
Replies: {"pid": PID} when the job's process exists, {"exit": CODE} when it has ended.

Only third-party packages are preloaded: the trainer's own modules (and the tests') are imported after the fork,
so they read the job's environment as in a fresh process. The client sends a job here only when its environment
equals this server's but for the trainer's and the tests' own variables (TRAINER_*, TEST_*); anything else runs
as a real process.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import runpy
import signal
import socket
import sys
import time

# deepspeed.runtime.zero.muon.muon_optimizer: every engine imports it (DeepSpeedEngine's optimizer sanity check ->
# is_zero_supported_optimizer), and it calls torch.compile at import, which imports torch._dynamo: 2.3 s of CPU per
# rank, paid again by every forked rank when it is not here (found by diffing a rank's sys.modules with this list).
PRELOAD = ("torch", "numpy", "yaml", "safetensors.torch", "tokenizers", "datasets", "deepspeed",
           "deepspeed.runtime.engine", "deepspeed.runtime.zero.muon.muon_optimizer", "transformers",
           "transformers.modeling_utils", "transformers.models.llama.modeling_llama", "peft")
TERMINATE_GRACE_S = 30  # DeepSpeed's launcher: psutil.wait_procs(children, timeout=30) before SIGKILL


def preload() -> None:
    """The imports, as the trainer makes them: with stdout sent to stderr (its commands keep stdout for their
    JSON/YAML, and DeepSpeed's logger binds the stdout it finds at import to its handler for good)."""
    with contextlib.redirect_stdout(sys.stderr):
        for name in PRELOAD:
            importlib.import_module(name)
    import transformers
    transformers.AutoModelForCausalLM, transformers.AutoTokenizer  # resolve the lazy names ranks use
    keep_cpu_info()


def keep_cpu_info() -> None:
    """py-cpuinfo's answer asked once here, for every fork. Each rank asks it at its first op load (DeepSpeed's
    compiler flags), and py-cpuinfo answers from a fresh Python subprocess: ~1.2 s of CPU per forked rank. The
    trainer keeps the answer for its process (trainer.distributed.cpu_info_once) and leaves a function marked
    `kept_for_the_process` alone, so a fork uses this one; the CPU is the same machine's."""
    import copy
    import cpuinfo
    answer = cpuinfo.get_cpu_info()

    def get_cpu_info():
        return copy.deepcopy(answer)
    get_cpu_info.kept_for_the_process = True
    cpuinfo.get_cpu_info = get_cpu_info


def serve(channel: socket.socket) -> tuple[dict, list[int]]:
    """Jobs until the client goes away; returns (job, its fds) in the forked job process only."""
    while True:
        message, fds, _, _ = socket.recv_fds(channel, 1 << 22, 2)
        if not message:
            os._exit(0)
        job = json.loads(message)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            channel.close()
            return job, fds
        for fd in fds:
            os.close(fd)
        channel.sendall(json.dumps({"pid": pid}).encode())
        _, status = os.waitpid(pid, 0)
        channel.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())


def become(job: dict, fds: list[int]) -> None:
    """This fork becomes the job's process: its own session, stdio, directory and environment."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[-1], 2)
    for fd in {null, *fds}:
        os.close(fd)
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in any fresh Python process
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def run_ranks(job: dict) -> dict:
    """DeepSpeed's per-node launcher, in this fork: returns, in each rank's fork, that rank's job; the launcher
    itself never returns (it exits with the job's code)."""
    ranks = job["ranks"]
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(job["master_port"]), "WORLD_SIZE": str(ranks),
            "CROSS_RANK": "0", "CROSS_SIZE": "1", "LOCAL_SIZE": str(ranks),
            "CUDA_VISIBLE_DEVICES": ",".join(map(str, range(ranks))),
            "PYTHONPATH": os.pathsep.join(p for p in (job["cwd"], os.environ.get("PYTHONPATH")) if p)}
    children = {}
    for rank in range(ranks):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            os.environ.update(base, RANK=str(rank), LOCAL_RANK=str(rank))
            return {**job, "args": [f"--local_rank={rank}", *job["args"]]}
        children[pid] = rank
    supervise(children)


def supervise(children: dict[int, int]) -> None:
    alive = set(children)
    code = 0

    def terminate(signum=None, frame=None):
        for pid in alive:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + TERMINATE_GRACE_S
        while alive and time.monotonic() < deadline:
            reap(block=False)
            time.sleep(0.1)
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        while alive:
            reap(block=True)
        os._exit(code if signum is None else 1)

    def reap(block: bool) -> None:
        nonlocal code
        pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
        if pid in alive:
            alive.discard(pid)
            exit_code = os.waitstatus_to_exitcode(status)
            if exit_code != 0 and code == 0:
                code = exit_code

    signal.signal(signal.SIGINT, terminate)
    signal.signal(signal.SIGTERM, terminate)
    while alive:
        reap(block=True)
        if code != 0:
            terminate()
    os._exit(0)


def python_path(first: str) -> list[str]:
    """sys.path as a fresh `python` would have it under this process's environment: `first` (the script's
    directory, or the working directory for -m), PYTHONPATH's entries, then the installation's own."""
    entries = [os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [first, *entries, *(p for p in SITE_PATH if p not in entries)]


def standard_streams() -> None:
    """stdout and stderr as a fresh process opens them on a pipe: block-buffered stdout unless PYTHONUNBUFFERED
    (the server's own are unbuffered), line-buffered stderr."""
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(open(1, "wb", buffering=0 if unbuffered else -1, closefd=False),
                                                   encoding="utf-8", write_through=unbuffered)
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(open(2, "wb", buffering=0 if unbuffered else -1, closefd=False),
                                                   encoding="utf-8", errors="backslashreplace",
                                                   line_buffering=True, write_through=unbuffered)


def run(job: dict) -> None:
    """`python -m MODULE ARGS` or `python SCRIPT ARGS` in this process (SystemExit ends it as it would end those)."""
    standard_streams()
    target = job["target"] if job["kind"] == "ranks" else job
    if target["kind"] == "module":
        sys.argv = [target["module"], *job["args"]]
        sys.path[:] = python_path(os.getcwd())
        runpy.run_module(target["module"], run_name="__main__", alter_sys=True)
    else:
        path = os.path.abspath(target["path"])
        sys.argv = [target["path"], *job["args"]]
        sys.path[:] = python_path(os.path.dirname(path))
        runpy.run_path(path, run_name="__main__")


if __name__ == "__main__":
    SITE_PATH = [p for p in sys.path[1:]  # the installation's own: what the server's PYTHONPATH did not add
                 if p not in {os.path.abspath(e) for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e}]
    channel = socket.socket(fileno=int(sys.argv[1]))
    preload()
    import gc
    gc.freeze()
    channel.sendall(json.dumps({"ready": os.getpid()}).encode())
    job, fds = serve(channel)
    become(job, fds)
    if job["kind"] == "ranks":
        job = run_ranks(job)
    del channel, fds
    run(job)
