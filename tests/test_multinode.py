"""Beyond one machine, proven on one (issue 11): DeepSpeed's real multi-node launcher over pdsh/ssh, torchrun's
two-node rendezvous, and ZeRO++'s hpZ across nodes, each started by `python -m trainer launch` on loopback
"nodes" (nothing leaves 127.0.0.0/8), each giving the single-node trajectory."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid

import pytest
import yaml

from conftest import STAGES, TINY
from distributed import REPO, last_wins, losses, new_port
from distributed import launch as distributed_launch
from loopback_ssh import end_sessions, install_if_missing, loopback_sshd
from processes import leftovers, run_group, stop_tree
from trainer import jit_env

pytestmark = pytest.mark.multirank

STEPS = 20
RUN = TINY + ["train.grad_accum=1", f"train.max_steps={STEPS}", "train.eval_every=0", "train.save_every=0",
              "logging.progress_bar=false"]
ONE_RANK_PER_NODE = ["hardware.gpus_per_node=1"]


def sets(items: list[str]) -> list[str]:
    return [word for item in last_wins(items) for word in ("--set", item)]


def env_with(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true", **extra}


def launch_raw(args: list[str], env: dict | None = None, timeout: int = 900, stop_on=None):
    """`python -m trainer launch ...` in its own session: (exit code, output). A timeout (or a `stop_on` line)
    raises subprocess.TimeoutExpired; either way nothing is left of it, on the local side (its tree) or the
    "remote" one (the loopback sshd's logins)."""
    try:
        proc = run_group([sys.executable, "-m", "trainer", "launch", *args], cwd=REPO, env=env or env_with(),
                         timeout=timeout, stop_on=stop_on)
    finally:
        end_sessions()
    return proc.returncode, proc.stdout


def launch(args: list[str], env: dict | None = None, timeout: int = 900) -> str:
    """`python -m trainer launch ...`: its output; fails with the tail when it fails."""
    code, output = launch_raw(args, env, timeout)
    assert code == 0, f"launch {' '.join(args)} failed ({code}):\n{output[-6000:]}"
    return output


def start(args: list[str], log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainer", "launch", *args], cwd=REPO, env=env_with(),
                            stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def nodes(per_node_args, out_dir, tmp_path, timeout: int = 300) -> list[str]:
    """Start one launch per "node" (node 1 first: node 0 hosts the rendezvous), wait for all; their outputs. A run
    here takes under a minute: past `timeout` (all nodes together) every node is stopped and the test fails with
    what each node printed (a hang shows where each one was)."""
    procs, logs = [], []
    for node in reversed(range(len(per_node_args))):
        logs.insert(0, open(tmp_path / f"{out_dir.name}-node{node}.log", "w+"))
        procs.insert(0, start(per_node_args[node], logs[0]))
    deadline = time.monotonic() + timeout
    codes: list = [None] * len(procs)
    try:
        while None in codes and time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if any(code not in (None, 0) for code in codes):
                break  # one node failed: the others would wait for it at the next collective
            time.sleep(0.2)
    finally:
        for p in procs:  # also after a normal exit: nothing a node's launch started outlives it
            stop_tree(p.pid)
            p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    if any(code != 0 for code in codes):
        shown = {None: f"still running after {timeout} s or after another node failed: stopped"}
        raise AssertionError("a node did not finish cleanly; what each node printed:\n" + "\n".join(
            f"--- node {n}: {shown.get(c, f'exit {c}')}\n{o[-4000:]}" for n, (c, o) in enumerate(zip(codes, outputs))))
    return outputs


def assert_same_trajectory(run, reference, tolerance: float = 0.0) -> float:
    ours, theirs = losses(run), losses(reference)
    assert len(ours) == len(theirs) == STEPS
    worst = max(abs(a - b) for a, b in zip(ours, theirs))
    assert worst <= tolerance, f"losses differ by up to {worst:.3g}:\n{ours}\n{theirs}"
    return worst


@pytest.fixture(scope="module")
def single_node(tmp_path_factory):
    """The reference: 2 ranks on one node (`deepspeed --num_gpus 2`, forked from the worker's preloaded interpreter:
    the launch command's own path on one node is test_launch.py's). Its ranks get the thread count the loopback
    "nodes" give theirs: each is alone on its node, so it takes every core (distributed.threads_per_rank); a
    different intra-op thread count changes float sums in the last bit."""
    out = tmp_path_factory.mktemp("single") / "run"
    distributed_launch(["train.py", "--preset", "tiny_cpu", *sets(RUN + STAGES["z2"] + [f"train.output_dir={out}"])],
                       env={"OMP_NUM_THREADS": str(len(os.sched_getaffinity(0)))})
    return out


@pytest.fixture(scope="module")
def ssh_path(tmp_path_factory):
    """A PATH whose `ssh` reaches a private sshd on 127.0.0.1 (tests/loopback_ssh.py); the daemon is stopped
    after the module."""
    why = install_if_missing()
    if why:
        pytest.skip(f"DeepSpeed's pdsh launcher: {why}")
    with loopback_sshd(tmp_path_factory.mktemp("sshd"), new_port()) as bin_dir:
        yield f"{bin_dir}:{os.environ['PATH']}"


def test_deepspeed_hostfile_over_pdsh_trains_like_one_node(single_node, ssh_path, tmp_path):
    """Two "hosts" of one slot each, `deepspeed --hostfile` over pdsh and ssh as on a cluster: the same losses as
    2 ranks on one node, and the fabric profile reached both nodes through DS_ENV_FILE (an ssh session does not
    inherit the launcher's environment: it can only have come through DeepSpeed's export)."""
    hosts = tmp_path / "hostfile"
    hosts.write_text("# two nodes on loopback\nlocalhost slots=1\n127.0.0.1 slots=1\n")
    out = tmp_path / "run"
    output = launch(["tiny_cpu", "--hostfile", str(hosts), "--fabric", "tcp", "--master-addr", "127.0.0.1",
                     "--master-port", str(new_port()), *sets(RUN + STAGES["z2"] + ONE_RANK_PER_NODE +
                                                             [f"train.output_dir={out}"])],
                    env=env_with(PATH=ssh_path))
    assert "pdsh -S -f 1024 -w localhost,127.0.0.1" in output  # DeepSpeed's runner took the multi-node path
    assert_same_trajectory(out, single_node)
    for rank in (0, 1):
        line = next(line for line in output.splitlines() if f"network: rank {rank} on " in line)
        assert "NCCL_IB_DISABLE=1 NCCL_NSOCKS_PERTHREAD=4 NCCL_SOCKET_IFNAME=^lo,docker0 NCCL_SOCKET_NTHREADS=4" in line
    assert (out / "deepspeed_env").read_text() == ("NCCL_IB_DISABLE=1\nNCCL_SOCKET_IFNAME=^lo,docker0\n"
                                                   "NCCL_SOCKET_NTHREADS=4\nNCCL_NSOCKS_PERTHREAD=4\n")
    record = json.loads((out / "launch.json").read_text())
    assert record["hostfile"]["hosts"] == [{"host": "localhost", "slots": 1}, {"host": "127.0.0.1", "slots": 1}]
    assert record["fabric"]["name"] == "tcp" and record["world_size"] == 2


def test_a_timed_out_launch_over_pdsh_leaves_no_process_on_either_side(ssh_path, tmp_path):
    """`launch --hostfile` over pdsh/ssh, stopped as a timeout would once the ranks of a "remote" node load
    DeepSpeed's comm op: nothing of it is left - runner, pdsh, ssh clients (the launch's tree) nor the logins,
    remote launchers and ranks (the sshd's). Their command lines all name the run directory.

    The ranks came up in an ssh login (no virtualenv on PATH, Debian's ninja first): they still load the op from
    this environment's extensions directory with its ninja."""
    hosts = tmp_path / "hostfile"
    hosts.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    out = tmp_path / f"run-{uuid.uuid4().hex[:12]}"
    loading = re.compile(r"op deepspeed_shm_comm: built before")
    with pytest.raises(subprocess.TimeoutExpired) as stopped:
        launch_raw(["tiny_cpu", "--hostfile", str(hosts), "--master-addr", "127.0.0.1", "--master-port",
                    str(new_port()), *sets(RUN + STAGES["z2"] + ONE_RANK_PER_NODE + [f"train.output_dir={out}"])],
                   env=env_with(PATH=ssh_path), timeout=600, stop_on=loading)
    line = next(line for line in stopped.value.output.splitlines() if loading.search(line))
    assert f"in {jit_env.environment_root() / 'deepspeed_shm_comm'} " in line, line
    assert f"({jit_env.environment_ninja()})" in line, line
    time.sleep(1)
    assert leftovers(str(out)) == []


def test_torchrun_two_node_rendezvous_trains_like_one_node(single_node, tmp_path):
    out = tmp_path / "run"
    port = str(new_port())
    common = ["tiny_cpu", "--launcher", "torchrun", "--nnodes", "2", "--nproc-per-node", "1", "--master-addr",
              "127.0.0.1", "--master-port", port, "--fabric", "tcp",
              *sets(RUN + STAGES["z2"] + [f"train.output_dir={out}"])]
    outputs = nodes([common + ["--node-rank", str(n)] for n in (0, 1)], out, tmp_path)
    assert "torchrun --nproc_per_node 1 --nnodes 2 --node_rank 1 --master_addr 127.0.0.1" in outputs[1]
    for rank, output in enumerate(outputs):  # the profile reached each node's rank through torchrun's environment
        assert f"network: rank {rank} on " in output and "NCCL_IB_DISABLE=1 NCCL_NSOCKS_PERTHREAD=4" in output
    assert_same_trajectory(out, single_node)
    assert json.loads((out / "launch.json").read_text())["command"].split(" --node_rank ")[1].startswith("0 ")


ZERO3 = STAGES["z3"]
HPZ = ZERO3 + ["deepspeed.zero_optimization.zero_hpz_partition_size=2"]
HPZ_TOLERANCE = 1e-6  # measured here: 0 (identical losses); hpZ's secondary copy holds the same fp32 values


def two_by_two(overrides: list[str], out, tmp_path) -> None:
    """2 nodes x 2 ranks, each node its own node-local launcher (as srun starts them)."""
    port = str(new_port())
    common = ["tiny_cpu", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port,
              *sets(RUN + overrides + [f"train.output_dir={out}"])]
    nodes([common + ["--node-rank", str(n)] for n in (0, 1)], out, tmp_path)


def test_zero_plus_plus_hpz_across_two_nodes_tracks_plain_zero3(tmp_path):
    """hpZ with the secondary partition = the 2 ranks of a node, across 2 nodes x 2 ranks: trains, within
    HPZ_TOLERANCE of plain ZeRO-3 on the same 4 ranks. (zero_quantized_gradients, which acts only across
    nodes, has no CPU kernel: test_launch_cli checks the launch refuses it on CPU ranks.)

    The plain ZeRO-3 reference runs its 4 ranks on one node, forked from the worker's preloaded interpreter (one
    job instead of two launchers' and four ranks' start-ups): plain ZeRO-3 does not know nodes, and its ranks get
    the thread count the loopback nodes give theirs (one core's share each: distributed.threads_per_rank)."""
    plain, hpz = tmp_path / "zero3", tmp_path / "hpz"
    distributed_launch(["train.py", "--preset", "tiny_cpu",
                        *sets(RUN + ZERO3 + ["hardware.gpus_per_node=4", f"train.output_dir={plain}"])], ranks=4)
    two_by_two(HPZ, hpz, tmp_path)
    worst = assert_same_trajectory(hpz, plain, HPZ_TOLERANCE)
    print(f"hpZ vs ZeRO-3, 2 nodes x 2 ranks, {STEPS} steps: largest loss difference {worst:.3g}")
    assert losses(hpz)[-1] < losses(hpz)[0]  # it trains
    resolved = yaml.safe_load((hpz / "config.resolved.yaml").read_text())
    assert resolved["deepspeed"]["zero_optimization"]["zero_hpz_partition_size"] == 2  # what the engine was given
