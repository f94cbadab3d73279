"""`python -m trainer launch` keeps the preemption promise where schedulers really signal (issue:
reliability round 2): Kubernetes signals PID 1 only, Slurm the batch shell; and a second signal gets a
rank out of a collective that will never finish."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

import psutil
import pytest

from conftest import STAGES, TINY
from distributed import REPO, last_wins, new_port, read_metrics
from trainer import shm_buffers
from trainer.train import checkpoint

pytestmark = pytest.mark.multirank

RUN = TINY + STAGES["z2"] + ["train.max_steps=400", "train.save_every=0", "train.eval_every=0", "logging.log_every=1",
                              "logging.progress_bar=false"]


def launch_command(out, *extra, launcher_args=()) -> list[str]:
    cmd = [sys.executable, "-m", "trainer", "launch", "--launcher", "local", "--master-port", str(new_port()),
           *launcher_args, "--preset", "tiny_cpu"]
    for item in last_wins(RUN + [f"train.output_dir={out}", *extra]):
        cmd += ["--set", item]
    return cmd


def start(cmd, env=None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true", **(env or {})}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def wait_for_step(out, step: int, proc, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        rows = read_metrics(out)[0] if (out / "metrics.jsonl").exists() else []
        if rows and rows[-1]["step"] >= step:
            return
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached")


def ranks_of(launcher_pid: int) -> dict[int, psutil.Process]:
    """{RANK: process} of the ranks a launcher started."""
    children = psutil.Process(launcher_pid).children()
    return {int(p.environ()["RANK"]): p for p in children}


@contextmanager
def job(cmd, env=None):
    """A started job that is killed, whole process group, if the test leaves it running."""
    proc = start(cmd, env)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def finish(proc, timeout: float = 300) -> tuple[int, str]:
    output = proc.communicate(timeout=timeout)[0]
    return proc.returncode, output


def hang_rank_1(out, proc, after_step: int = 3) -> dict[int, psutil.Process]:
    """Once `after_step` is logged, SIGSTOP rank 1 (a hung peer); returns the ranks."""
    wait_for_step(out, after_step, proc)
    ranks = ranks_of(proc.pid)
    ranks[1].suspend()
    return ranks


SECRET = "comet-key-93be1d"
WITH_A_SECRET = ("logging.wandb_mode=offline", "logging.wandb_project=tests",
                 f"deepspeed.comet={{enabled: false, api_key: {SECRET}}}")


def test_sigterm_to_pid_1_only_saves_and_exits_0_and_secrets_stay_out_of_the_log_and_wandb(tmp_path):
    """As in a Kubernetes pod: the launcher is PID 1 of its own PID namespace and only it is signalled. The same
    launch carries a secret on its command line (one launch for both, issue 36): it stays out of the launch log,
    wandb's offline files and the resolved config."""
    out = tmp_path / "run"
    with job(["unshare", "--pid", "--fork", "--mount-proc", *launch_command(out, *WITH_A_SECRET)]) as proc:
        wait_for_step(out, 3, proc)
        (pid_1,) = psutil.Process(proc.pid).children()  # unshare forks; its child is PID 1 inside
        assert "trainer" in pid_1.cmdline() and "launch" in pid_1.cmdline()
        os.kill(pid_1.pid, signal.SIGTERM)
        code, output = finish(proc)
    assert code == 0, output[-4000:]
    assert "launch: SIGTERM received, forwarding it to 2 rank(s)" in output
    assert "launch: every rank exited 0 after the signal (checkpoint saved)" in output
    latest = (out / "checkpoints" / "latest").read_text().strip()
    stopped = int(latest.split("_")[1])
    assert 3 <= stopped < 400 and f"stopped at step {stopped} (signal (SIGTERM))" in output
    assert checkpoint.find_resume("auto", out / "checkpoints") == out / "checkpoints" / latest
    assert SECRET not in output
    assert "deepspeed.comet={api_key: <redacted>, enabled: false}" in output  # the launcher's own log line
    assert "puts a secret on the command line" in output and "env:VARIABLE" in output
    wandb_files = [p for p in (out / "wandb").rglob("*") if p.is_file()]
    assert wandb_files and not any(SECRET.encode() in p.read_bytes() for p in wandb_files)
    assert SECRET not in (out / "config.resolved.yaml").read_text()


@pytest.mark.parametrize("launcher", ["deepspeed", "torchrun"])
def test_sigterm_to_a_launch_through_another_launcher_reaches_the_ranks_they_save_and_the_requeue_resumes(
        tmp_path, launcher):
    """The default single-node launcher is DeepSpeed's runner, which has no SIGTERM handler on one node: signalled,
    it died and left launch.py and the ranks training until the SIGKILL (CI saw a whole run go on after the signal).
    torchrun passes it on but exits 1 whatever the ranks did. The launch sends the signal to the ranks under either
    instead: they save, the job exits 0, and the same command run again (a requeue) resumes from that checkpoint."""
    out = tmp_path / "run"
    command = launch_command(out, launcher_args=("--launcher", launcher))
    with job(command) as proc:
        wait_for_step(out, 3, proc)
        proc.send_signal(signal.SIGTERM)
        code, output = finish(proc)
    assert code == 0, output[-4000:]
    assert "launch: SIGTERM received, forwarding it to 2 rank(s)" in output, output[-4000:]
    latest = (out / "checkpoints" / "latest").read_text().strip()
    stopped = int(latest.split("_")[1])
    assert 3 <= stopped < 400 and f"stopped at step {stopped} (signal (SIGTERM))" in output
    assert "launch: every rank exited 0 after the signal (checkpoint saved)" in output
    with job(launch_command(out, f"train.max_steps={stopped + 2}", launcher_args=("--launcher", launcher))) as proc:
        code, output = finish(proc)
    assert code == 0, output[-4000:]
    assert [row["step"] for row in read_metrics(out)[0] if "loss" in row][-1] == stopped + 2


def test_a_second_signal_gets_a_rank_out_of_a_blocked_collective(tmp_path):
    """Rank 1 is stopped, so rank 0 waits in an all-reduce forever; the second SIGTERM still ends it."""
    out = tmp_path / "run"
    with job(launch_command(out, "train.dist_timeout_s=600")) as proc:
        ranks = hang_rank_1(out, proc)
        time.sleep(2)  # rank 0 is now inside a collective that cannot complete
        ranks[0].send_signal(signal.SIGTERM)
        time.sleep(6)  # more than SAME_SIGNAL_S: a new request, not the launcher's echo of the first
        assert ranks[0].is_running() and ranks[0].status() != psutil.STATUS_ZOMBIE, "rank 0 left too early"
        sent = time.monotonic()
        ranks[0].send_signal(signal.SIGTERM)
        code, output = finish(proc, timeout=60)
        took = time.monotonic() - sent
    assert "second SIGTERM: exiting now without a checkpoint" in output, output[-3000:]
    assert code == 128 + signal.SIGTERM, output[-3000:]
    assert "launch: rank 0 exited with code 143" in output
    assert took < 15, f"the second signal took {took:.1f}s to end the run"


def test_the_process_group_timeout_ends_a_run_whose_peer_hangs(tmp_path):
    """train.dist_timeout_s: with rank 1 stopped, rank 0's collective fails after that long, not 30 minutes."""
    out = tmp_path / "run"
    with job(launch_command(out, "train.dist_timeout_s=8")) as proc:
        hang_rank_1(out, proc)
        stopped = time.monotonic()
        code, output = finish(proc, timeout=120)
        took = time.monotonic() - stopped
    assert code != 0 and "launch: rank 0 exited with code" in output, output[-3000:]
    assert "timed out" in output.lower() or "timeout" in output.lower(), output[-3000:]
    assert took < 60, f"rank 0 waited {took:.0f}s for a peer that hangs (train.dist_timeout_s=8)"


def test_a_dead_rank_stops_the_job_with_its_exit_code(tmp_path):
    """Rank 1 is SIGKILLed (the OOM killer, a node fault): rank 0, waiting for it in a collective, is killed
    after the grace period and the launcher exits with the dead rank's code."""
    out = tmp_path / "run"
    cmd = launch_command(out, "train.dist_timeout_s=600")
    port = cmd[cmd.index("--master-port") + 1]
    with job(cmd) as proc:
        wait_for_step(out, 3, proc)
        buffers = shm_buffers.job_buffers(port)
        ranks_of(proc.pid)[1].kill()
        code, output = finish(proc)
    assert code == 128 + signal.SIGKILL, output[-3000:]
    assert "launch: rank 1 exited with code 137; the other 1 rank(s) get 5s to exit, then are killed" in output
    assert "launch: failed: rank 1 exited with code 137" in output
    # neither rank ran its clean-up; the launcher removed their DeepSpeed all-reduce buffers (69 MB of RAM each)
    assert len(buffers) == 2, buffers
    assert "launch: removed 2 shared-memory buffer(s) the failed ranks left in /dev/shm" in output
    assert shm_buffers.job_buffers(port) == []


def test_a_secret_can_come_from_the_environment(monkeypatch):
    from trainer.errors import UserError
    from trainer.presets import load_preset
    monkeypatch.setenv("COMET_KEY_FOR_TEST", "from-env-1234")
    cfg = load_preset("tiny_cpu", ["deepspeed.comet={enabled: false, api_key: env:COMET_KEY_FOR_TEST}"])
    assert cfg.deepspeed["comet"]["api_key"] == "from-env-1234"
    monkeypatch.delenv("COMET_KEY_FOR_TEST")
    with pytest.raises(UserError, match=r"deepspeed.comet.api_key: 'env:COMET_KEY_FOR_TEST' names the environment "
                                        r"variable COMET_KEY_FOR_TEST, which is not set"):
        load_preset("tiny_cpu", ["deepspeed.comet={enabled: false, api_key: env:COMET_KEY_FOR_TEST}"])


def test_the_command_line_is_redacted_for_logs():
    from trainer.redact import redact_argv
    argv = ["--preset", "x", "--set", "deepspeed.comet.api_key=abc", "--set=logging.hf_token=xyz",
            "--set", "deepspeed.comet.api_key=env:COMET", "--set", "train.lr=1e-4"]
    assert redact_argv(argv) == ["--preset", "x", "--set", "deepspeed.comet.api_key=<redacted>",
                                 "--set=logging.hf_token=<redacted>", "--set", "deepspeed.comet.api_key=env:COMET",
                                 "--set", "train.lr=1e-4"]


def test_launch_refuses_a_bad_topology():
    proc = subprocess.run([sys.executable, "-m", "trainer", "launch", "--nnodes", "2", "--node-rank", "2",
                           "--preset", "tiny_cpu"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "--node-rank=2 must be in [0, --nnodes=2)" in proc.stderr


ORPHANS = """
import os, subprocess, sys
from trainer.launch.supervisor import Supervisor
assert os.getpid() == 1
parent = subprocess.Popen(["sh", "-c", "sleep 0.3 & exit 0"])  # its child is orphaned, reparented to PID 1
rank = subprocess.Popen(["sleep", "1.5"])
code = Supervisor({rank.pid: 0, parent.pid: 1}, failure_grace_s=5).run()
zombies = [pid for pid in os.listdir("/proc") if pid.isdigit()
           and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"]
print("code", code, "zombies", zombies)
"""


def test_as_pid_1_the_launcher_reaps_orphans():
    proc = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", ORPHANS], cwd=REPO,
                          capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr
    assert "code 0 zombies []" in proc.stdout, proc.stdout + proc.stderr
