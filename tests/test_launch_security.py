"""The launch under attack (issue 22): every test is the attack itself, run for real.

- Slurm: the generated job.sbatch is run by bash with stub `sbatch`/`scontrol`/`srun` on PATH (Slurm cannot
  run here); `$(touch MARKER)`, backquotes, quotes and newlines in output dirs, preset names and paths,
  overrides, partitions and the Python path either are refused by name or arrive as data: no marker appears.
- Hostfiles and --master-addr: a host `-oProxyCommand=...` (an ssh option that runs a command) is refused
  with its file:line before DeepSpeed's runner could hand it to ssh.
- Secrets in the user's ~/.deepspeed_env reach the ranks (through DeepSpeed's own pdsh export) but never the
  run directory, the printed command or the launch's output; the files the launch writes there are 0600.
- Signals from the first instant: a SIGTERM while the launch is still importing, at the last moment before
  the ranks start, or between two ranks' starts is obeyed, with the exit code it promises.
"""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from conftest import TINY
from distributed import REPO, last_wins, new_port, read_metrics
from loopback_ssh import install_if_missing, loopback_sshd
from trainer.errors import UserError
from trainer.launch.hostfile import parse_hostfile
from trainer.shell import ShellVariable, host_problem, join, quote
from trainer.launch.slurm import SlurmJob, sbatch_script

DS_RUNNER = pytest.importorskip("deepspeed.launcher.runner")

# the stand-ins for Slurm: sbatch runs the job at once (as if every node were free), scontrol names one node,
# srun runs its command once as node 0
SBATCH = """#!/bin/bash
export SLURM_JOB_ID=4242 SLURM_JOB_NODELIST=localhost
echo "$@" >> "$(dirname "$0")/sbatch.calls"
exec bash "${@: -1}"
"""
SCONTROL = """#!/bin/bash
[ "$1 $2" = "show hostnames" ] && echo localhost
"""
SRUN = """#!/bin/bash
while [[ $1 == --* ]]; do shift; done
export SLURM_NODEID=0 SLURM_PROCID=0 SLURM_LOCALID=0
exec "$@"
"""
# a stand-in Python for the node launcher: records the words it was started with, one per NUL
RECORDING_PYTHON = """#!/bin/bash
printf '%s\\0' "$@" > "$ARGV_FILE"
"""
PAYLOADS = ["$(touch {m}1)", "`touch {m}2`", "'; touch {m}3; '", '"; touch {m}4; "', "\\$(touch {m}5)"]


def tool(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(text)
    path.chmod(0o755)
    return path


def slurm_bin(tmp_path: Path) -> Path:
    folder = tmp_path / "slurm-bin"
    for name, text in (("sbatch", SBATCH), ("scontrol", SCONTROL), ("srun", SRUN)):
        tool(folder, name, text)
    return folder


def markers(root: Path) -> list[Path]:
    """Marker files a payload made: anywhere under `root`, or in the repository (a job's working directory)."""
    return list(root.rglob("MARK*")) + list(REPO.glob("MARK*"))


def launch(args: list[str], env: dict | None = None, cwd: Path = REPO, timeout: int = 600):
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true", **(env or {})}
    return subprocess.run([sys.executable, "-m", "trainer", "launch", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def sets(items: list[str]) -> list[str]:
    return [word for item in items for word in ("--set", item)]


# --- 1. Slurm script injection ----------------------------------------------------------------------------------

def test_a_generated_sbatch_script_passes_every_hostile_word_as_data(tmp_path):
    """The script's body, run by bash with stub scontrol/srun: the node launcher (a recording stand-in, at a
    path full of shell syntax) receives every word exactly as written, and no payload ran."""
    words = [p.format(m="MARK") for p in PAYLOADS]  # relative: a path component holds no /
    python = tool(tmp_path / f"py {words[0]} {words[2]}", "python", RECORDING_PYTHON)
    workdir = tmp_path / f"cwd {words[1]} {words[3]}"
    workdir.mkdir()
    job = SlurmJob(nodes=1, gpus_per_node=0, ranks_per_node=2, time="01:00:00", grace_s=60,
                   run_dir=str(tmp_path / "run"), job_name="benign")
    env = (("TRAINER_TEST_NOTE", words[2]), ("NCCL_SOCKET_IFNAME", "^lo,docker0"))
    overrides = [f"logging.run_name={w}" for w in words]
    script = sbatch_script(job, f"{tmp_path}/{words[4]}.yaml", overrides, 2, env, ["--resume", words[0]],
                           str(python), str(workdir), 29601)
    (tmp_path / "job.sbatch").write_text(script)
    argv_file = tmp_path / "argv"
    proc = subprocess.run(["bash", str(tmp_path / "job.sbatch")], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path,
                          env={**os.environ, "PATH": f"{slurm_bin(tmp_path)}:{os.environ['PATH']}",
                               "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "localhost", "ARGV_FILE": str(argv_file)})
    assert proc.returncode == 0, proc.stderr
    assert markers(tmp_path) == []
    received = argv_file.read_text().split("\0")[:-1]
    assert received == ["-m", "trainer", "launch", "--launcher", "local", "--nproc-per-node", "2", "--master-port",
                        "29601", "--preset", f"{tmp_path}/{words[4]}.yaml", "--world-size", "2",
                        *sets(overrides), "--resume", words[0]]
    assert (tmp_path / "run" / "hostfile.7").read_text() == "localhost slots=2\n"


@pytest.mark.parametrize("flag, value", [("--partition", "gpu\ntouch {m}"), ("--account", "acct;touch {m}"),
                                         ("--time", "01:00:00\ntouch {m}"), ("--partition", "$(touch {m})")])
def test_a_hostile_sbatch_directive_value_is_refused_by_its_flag(tmp_path, flag, value):
    marker = tmp_path / "MARK"
    proc = launch(["tiny_cpu", "--launcher", "slurm", flag, value.format(m=marker),
                   "--set", f"train.output_dir={tmp_path / 'run'}"],
                  env={"PATH": f"{slurm_bin(tmp_path)}:{os.environ['PATH']}"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"{flag} {value.format(m=marker)!r}" in proc.stderr
    assert "`#SBATCH` directive, which sbatch reads without a shell's quoting" in proc.stderr \
        or "not a Slurm time" in proc.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "slurm-bin" / "sbatch.calls").exists()
    assert markers(tmp_path) == []


@pytest.mark.slow
def test_names_and_run_directories_that_would_be_commands_are_refused_by_key(tmp_path):
    """A preset name or an output directory that lands in `#SBATCH` lines; a newline in a config string is
    refused at resolve time, by key, for every launcher."""
    marker = tmp_path / "MARK"
    evil_preset = tmp_path / "p$(touch MARK).yaml"  # a file name holds no /: the marker is relative
    evil_preset.write_text((REPO / "presets" / "tiny_cpu.yaml").read_text())
    env = {"PATH": f"{slurm_bin(tmp_path)}:{os.environ['PATH']}"}
    by_name = launch([str(evil_preset), "--launcher", "slurm", "--set", f"train.output_dir={tmp_path / 'a'}"], env)
    assert by_name.returncode == 2 and "error: name (the preset's name; --set name=JOB) 'p$(touch" in by_name.stderr
    by_dir = launch(["tiny_cpu", "--launcher", "slurm", "--set", f"train.output_dir={tmp_path}/b $(touch {marker})"],
                    env)
    assert by_dir.returncode == 2 and "error: train.output_dir (the run directory) " in by_dir.stderr
    for launcher in ("slurm", "local", "deepspeed"):
        newline = launch(["tiny_cpu", "--launcher", launcher, "--dry-run",
                          "--set", f'train.output_dir="{tmp_path}/c\\ntouch {marker}"', "--set", 'name="x\\ny"'], env)
        assert newline.returncode == 2, newline.stdout
        assert "train.output_dir: " in newline.stderr and "holds a newline (U+000A)" in newline.stderr
        assert "  - name: 'x\\ny' holds a newline" in newline.stderr
    assert markers(tmp_path) == [] and not (tmp_path / "slurm-bin" / "sbatch.calls").exists()


@pytest.mark.multirank
def test_a_slurm_job_with_hostile_values_runs_them_as_data(tmp_path):
    """`launch --launcher slurm` for real: job.sbatch written and submitted (stub sbatch runs it), the node
    launcher and its 2 ranks train 2 steps. The preset's directory, an override and a fabric value are full
    of shell syntax; they arrive as data (the resolved config holds the override verbatim), nothing runs."""
    words = [p.format(m=tmp_path / "MARK") for p in PAYLOADS]
    preset_dir = tmp_path / " ".join(["presets", *[p.format(m="MARK") for p in PAYLOADS[:3]]])
    preset_dir.mkdir()
    (preset_dir / "benign.yaml").write_text((REPO / "presets" / "tiny_cpu.yaml").read_text())
    fabric = tmp_path / "mine.env"
    fabric.write_text(f"# a value with quotes, ; and spaces: fine in an export, and data\nTRAINER_NOTE={words[2]}\n")
    out = tmp_path / "run"
    run_name = f"a {words[0]} b {words[1]} c {words[2]} d {words[3]}"  # a YAML plain scalar: no `: ` nor ` #`
    items = last_wins(TINY + ["train.max_steps=2", "train.save_every=0", "train.eval_every=0",
                              f"train.output_dir={out}", f"logging.run_name={run_name}"])
    proc = launch([str(preset_dir / "benign.yaml"), "--launcher", "slurm", "--fabric", str(fabric),
                   "--master-port", str(new_port()), *sets(items)],
                  env={"PATH": f"{slurm_bin(tmp_path)}:{os.environ['PATH']}"})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert markers(tmp_path) == []
    assert (tmp_path / "slurm-bin" / "sbatch.calls").read_text() == f"{out}/job.sbatch\n"
    assert [row["step"] for row in read_metrics(out)[0]] == [1, 2]
    assert yaml.safe_load((out / "config.resolved.yaml").read_text())["logging"]["run_name"] == run_name


# --- 2. Hosts ---------------------------------------------------------------------------------------------------

HOSTILE_HOSTS = ["-oProxyCommand=touch${IFS}MARK", "-p2222", "a;touch${IFS}MARK", "$(touch${IFS}MARK)",
                 "`touch${IFS}MARK`", "a|b", "node[1-4]", "a,b", "user@node1", "-", "node-", "1.2.3.999", "[::1]",
                 "fe80::1%eth0", "a..b"]


@pytest.mark.parametrize("host", HOSTILE_HOSTS)
def test_a_host_that_is_not_a_name_or_address_is_refused_with_its_line(host):
    with pytest.raises(UserError) as err:
        parse_hostfile(f"# nodes\nworker-0 slots=1\n{host} slots=1\n", "hosts.txt")
    assert f"hosts.txt:3: host {host!r}: " in str(err.value)


def test_real_host_names_and_addresses_are_accepted():
    for host in ["worker-0", "node_1.cluster.local", "gpu-a100-017", "10.0.0.1", "::1", "fe80::1", "localhost",
                 "2001:db8::7"]:
        assert host_problem(host) is None, host


@pytest.mark.slow
def test_a_proxycommand_host_never_reaches_ssh(tmp_path):
    """DeepSpeed's own parser takes `-oProxyCommand=...` as a host and its ssh check would hand it to ssh as an
    option; the launch refuses the file first, naming file:line, and nothing runs."""
    marker = tmp_path / "MARK"
    hosts = tmp_path / "hostfile"
    hosts.write_text(f"localhost slots=1\n-oProxyCommand=touch${{IFS}}{marker} slots=1\n")
    assert "-oProxyCommand=touch${IFS}" + str(marker) in DS_RUNNER._parse_hostfile(
        hosts.read_text().splitlines(keepends=True))  # DeepSpeed would have taken it
    proc = launch(["tiny_cpu", "--hostfile", str(hosts), "--set", "hardware.gpus_per_node=1",
                   "--set", f"train.output_dir={tmp_path / 'run'}", "--master-addr", "127.0.0.1"])
    assert proc.returncode == 2
    assert f"{hosts}:2: host '-oProxyCommand=touch${{IFS}}{marker}': it starts with '-': ssh and pdsh would read " \
           f"it as an option" in proc.stderr
    assert markers(tmp_path) == [] and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_a_master_addr_that_is_not_a_host_is_refused():
    for launcher in ("local", "torchrun", "deepspeed"):
        proc = launch(["tiny_cpu", "--launcher", launcher, "--master-addr=-oProxyCommand=id", "--dry-run"])
        assert proc.returncode == 2 and "error: --master-addr '-oProxyCommand=id': it starts with '-'" in proc.stderr


@pytest.mark.slow
def test_arguments_deepspeeds_pdsh_runner_would_paste_into_a_shell_are_refused(tmp_path):
    """Over pdsh DeepSpeed writes each training argument into the node's shell command (quoted only when it
    holds a space): a `$(...)` there would run on every node. Refused for that launcher, by the word; the same
    value is data for torchrun."""
    marker = tmp_path / "MARK"
    hosts = tmp_path / "hostfile"
    hosts.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    item = f"logging.run_name=x$(touch {marker})"
    proc = launch(["tiny_cpu", "--hostfile", str(hosts), "--set", "hardware.gpus_per_node=1", "--set", item,
                   "--master-addr", "127.0.0.1", "--set", f"train.output_dir={tmp_path / 'run'}"])
    assert proc.returncode == 2
    assert "DeepSpeed's pdsh runner pastes these into the command line each node's shell runs" in proc.stderr
    assert f"argument {item!r}: it holds $, which the node's shell reads inside double quotes" in proc.stderr
    assert markers(tmp_path) == [] and not (tmp_path / "run").exists()
    torchrun = launch(["tiny_cpu", "--launcher", "torchrun", "--set", item, "--dry-run"])
    assert torchrun.returncode == 0 and quote(item) in torchrun.stdout
    exported = launch(["tiny_cpu", "--hostfile", str(hosts), "--set", "hardware.gpus_per_node=1", "--dry-run"],
                      {"PYTHONSTARTUP": f"$(touch {marker})"})  # DeepSpeed's runner exports PYTHON* variables
    assert exported.returncode == 2 and "the environment variable PYTHONSTARTUP (DeepSpeed's runner exports" \
        in exported.stderr


def test_only_the_launchs_own_variables_are_expanded_by_the_shell():
    assert join(["--node-rank", ShellVariable("SLURM_NODEID"), "$HOME", ShellVariable("MASTER_ADDR").followed_by(
        ":29500")]) == "--node-rank \"$SLURM_NODEID\" '$HOME' \"$MASTER_ADDR\":29500"


# --- 3. Secrets -------------------------------------------------------------------------------------------------

SECRETS = {"WANDB_API_KEY": "wandb-secret-6c1f0a9e", "HF_TOKEN": "hf_secret_93be1d77"}
# the stand-ins for the network: ssh answers DeepSpeed's reachability check; pdsh records the command line it was
# given for the nodes (NUL-separated) instead of running it
FAKE_SSH = "#!/bin/sh\nexit 0\n"
RECORDING_PDSH = "#!/bin/bash\nprintf '%s\\0' \"$@\" > \"$PDSH_ARGV\"\n"


def fake_home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    env_file = home / ".deepspeed_env"
    env_file.write_text("# mine\n" + "".join(f"{k}={v}\n" for k, v in SECRETS.items()) + "NCCL_IB_HCA=mlx5_2\n")
    env_file.chmod(0o600)
    return home


def assert_no_secret_under(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert not any(v.encode() in data for v in SECRETS.values()), f"a secret value is in {path}"


@pytest.mark.slow
def test_secrets_in_the_users_deepspeed_env_reach_pdsh_but_not_the_run_directory_nor_the_output(tmp_path):
    home, out = fake_home(tmp_path), tmp_path / "run"
    net = tmp_path / "net"
    tool(net, "ssh", FAKE_SSH)
    tool(net, "pdsh", RECORDING_PDSH)
    hosts = tmp_path / "hostfile"
    hosts.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    args = ["tiny_cpu", "--hostfile", str(hosts), "--fabric", "tcp", "--master-addr", "127.0.0.1",
            "--master-port", str(new_port()), "--set", "hardware.gpus_per_node=1", "--set", f"train.output_dir={out}"]
    env = {"HOME": str(home), "PATH": f"{net}:{os.environ['PATH']}", "PDSH_ARGV": str(tmp_path / "pdsh.argv")}
    dry = launch([*args, "--dry-run"], env)
    assert dry.returncode == 0, dry.stderr
    assert not any(v in dry.stdout + dry.stderr for v in SECRETS.values())
    assert f"{out}/deepspeed_env would hold (secrets as <redacted>" in dry.stdout
    assert "WANDB_API_KEY=<redacted>\nHF_TOKEN=<redacted>\nNCCL_IB_HCA=mlx5_2" in dry.stdout
    assert not out.exists()

    proc = launch(args, env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "cmd = pdsh" in proc.stdout + proc.stderr  # DeepSpeed logged the pdsh command line, exports included...
    assert not any(v in proc.stdout + proc.stderr for v in SECRETS.values())  # ...with the values redacted
    exports = next(w for w in (tmp_path / "pdsh.argv").read_text().split("\0") if w.startswith("export "))
    for name, value in SECRETS.items():  # what every node's shell runs: DeepSpeed's export of each secret
        assert f"export {name}={value}; " in exports
    assert "export NCCL_IB_DISABLE=1; " in exports and "export NCCL_IB_HCA=mlx5_2; " in exports
    assert_no_secret_under(out)
    for name in ("deepspeed_env", "launch.json"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o600, name
    assert "WANDB_API_KEY=<redacted>\n" in (out / "deepspeed_env").read_text()
    record = json.loads((out / "launch.json").read_text())["deepspeed_env"]
    assert record["secrets"] == ["WANDB_API_KEY", "HF_TOKEN"] and record["record"] == str(out / "deepspeed_env")
    assert not Path(record["path"]).is_relative_to(out) and not Path(record["path"]).exists()  # removed after


@pytest.mark.slow
def test_a_line_of_the_users_deepspeed_env_that_would_run_on_every_node_is_refused(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".deepspeed_env").write_text(f"PATH=$PATH:/opt/bin\nX=$(touch {tmp_path}/MARK)\nhf_bare_token_1\n"
                                         f"export Y=1\n")
    hosts = tmp_path / "hostfile"
    hosts.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    proc = launch(["tiny_cpu", "--hostfile", str(hosts), "--set", "hardware.gpus_per_node=1", "--dry-run"],
                  {"HOME": str(home)})
    assert proc.returncode == 2
    assert f"{home}/.deepspeed_env:2: the value of X: it holds $, which the node's shell reads as code" in proc.stderr
    assert f"{home}/.deepspeed_env:3: not NAME=value: DeepSpeed's runner splits" in proc.stderr
    assert f"{home}/.deepspeed_env:4: not NAME=value ('export Y' is no variable name)" in proc.stderr
    assert "hf_bare_token_1" not in proc.stderr
    assert ":1:" not in proc.stderr  # $PATH, a variable the node expands, is what DeepSpeed documents


def test_a_fabric_profile_holding_a_secret_is_refused(tmp_path):
    mine = tmp_path / "mine.env"
    mine.write_text("NCCL_IB_HCA=mlx5\nHF_TOKEN=hf_abc\n")
    proc = launch(["tiny_cpu", "--fabric", str(mine), "--dry-run"])
    assert proc.returncode == 2 and f"{mine}:2: HF_TOKEN looks like a secret" in proc.stderr
    assert "hf_abc" not in proc.stdout + proc.stderr


def test_a_literal_secret_is_not_written_into_a_slurm_script(tmp_path):
    proc = launch(["tiny_cpu", "--launcher", "slurm", "--dry-run", "--set",
                   "deepspeed.comet={enabled: false, api_key: comet-93be1d}"])
    assert proc.returncode == 2 and "comet-93be1d" not in proc.stdout + proc.stderr
    assert "would write a secret into job.sbatch" in proc.stderr and "env:VARIABLE" in proc.stderr


@pytest.mark.parametrize("name", ["WANDB_API_KEY", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "GITHUB_TOKEN",
                                  "DB_PASSWORD", "OPENAI_API_KEY", "AWS_SESSION_TOKEN", "hfToken", "GPG_PASSPHRASE"])
def test_secret_environment_names_look_secret(name):
    from trainer.redact import looks_secret, redact_argv
    assert looks_secret(name)
    assert redact_argv([f"{name}=s3cr3t", "deepspeed"]) == [f"{name}=<redacted>", "deepspeed"]


@pytest.mark.parametrize("name", ["NCCL_IB_HCA", "TOKENIZERS_PARALLELISM", "NCCL_SOCKET_IFNAME", "PYTHONPATH",
                                  "max_new_tokens", "tokenizer", "NCCL_IB_GID_INDEX", "PWD", "MASTER_ADDR"])
def test_harmless_names_do_not(name):
    from trainer.redact import looks_secret
    assert not looks_secret(name)


@pytest.fixture(scope="module")
def ssh_path(tmp_path_factory):
    """A PATH whose `ssh` reaches a private sshd on 127.0.0.1 (tests/loopback_ssh.py, as test_multinode)."""
    why = install_if_missing()
    if why:
        pytest.skip(f"DeepSpeed's pdsh launcher: {why}")
    with loopback_sshd(tmp_path_factory.mktemp("sshd"), new_port()) as bin_dir:
        yield f"{bin_dir}:{os.environ['PATH']}"


def ranks_environment(out: Path, proc: subprocess.Popen) -> dict[str, dict]:
    """{RANK: the secrets in its environment} of the ranks training into `out` (children of sshd, not of the
    launch: found by their command line), while the launch runs."""
    seen: dict[str, dict] = {}
    while proc.poll() is None and len(seen) < 2:
        try:  # the launch and the runner and pdsh under it carry the same --set words, but are no ranks
            launching = {proc.pid, *(child.pid for child in psutil.Process(proc.pid).children(recursive=True))}
        except psutil.Error:
            break
        for process in psutil.process_iter():
            if process.pid in launching:
                continue
            try:
                env = process.environ()
                if "RANK" in env and f"train.output_dir={out}" in process.cmdline():
                    seen[env["RANK"]] = {name: env.get(name) for name in SECRETS}
            except psutil.Error:
                continue
        time.sleep(0.3)
    return seen


@pytest.mark.multirank
def test_over_real_pdsh_every_rank_gets_the_secret_and_the_run_directory_does_not(tmp_path, ssh_path):
    """DeepSpeed's multi-node runner over pdsh and a loopback sshd: the ranks on both "nodes" have the secrets
    from ~/.deepspeed_env (an ssh session inherits nothing: they came through DS_ENV_FILE's private copy); the
    run directory, launch.json and the launch's output hold none of them; the private copy is gone after."""
    home, out = fake_home(tmp_path), tmp_path / "run"
    hosts = tmp_path / "hostfile"
    hosts.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    cmd = [sys.executable, "-m", "trainer", "launch", "tiny_cpu", "--hostfile", str(hosts), "--fabric", "tcp",
           "--master-addr", "127.0.0.1", "--master-port", str(new_port()),
           *sets(last_wins(TINY + ["hardware.gpus_per_node=1", "train.max_steps=20", "train.save_every=0",
                                   "train.eval_every=0", f"train.output_dir={out}"]))]
    proc = popen(cmd, {"HOME": str(home), "PATH": ssh_path, "PYTHONPATH": str(REPO)})
    try:
        seen = ranks_environment(out, proc)
    finally:
        code, output = finish(proc, timeout=900)
    assert code == 0, output[-4000:]
    assert "pdsh -S -f 1024 -w localhost,127.0.0.1" in output
    assert seen == {"0": SECRETS, "1": SECRETS}
    assert not any(v in output for v in SECRETS.values())
    assert_no_secret_under(out)
    record = json.loads((out / "launch.json").read_text())["deepspeed_env"]
    assert not Path(record["path"]).exists() and stat.S_IMODE((out / "deepspeed_env").stat().st_mode) == 0o600


# --- 4. Signals from the first instant ----------------------------------------------------------------------------

SITE = "import os\nwith open(os.environ['START_LOG'], 'a') as f:\n    f.write(open('/proc/self/cmdline').read()" \
       ".replace('\\0', ' ') + '\\n')\n"


def recording_starts(tmp_path: Path) -> dict:
    """An environment in which every Python process that starts writes its command line to START_LOG."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE)
    return {"PYTHONPATH": f"{site}:{REPO}", "START_LOG": str(tmp_path / "starts.log")}


def started(tmp_path: Path) -> list[str]:
    log = tmp_path / "starts.log"
    return log.read_text().splitlines() if log.exists() else []


def local_launch(out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trainer", "launch", "tiny_cpu", "--master-port", str(new_port()), *extra,
            *sets(last_wins(TINY + ["train.max_steps=50", f"train.output_dir={out}"]))]


def popen(cmd: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def catches(pid: int, signum: int) -> bool:
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(mask >> (signum - 1) & 1)


def wait_until(check, proc, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.005)


def finish(proc: subprocess.Popen, timeout: float = 180) -> tuple[int, str]:
    try:
        return proc.wait(timeout=timeout), proc.stdout.read()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("pid_1", [False, True], ids=["process", "pid_1"])
def test_a_sigterm_while_the_launch_imports_starts_no_rank(tmp_path, pid_1):
    """The reported attack: SIGTERM as soon as the launch catches it (it then still imports torch and DeepSpeed
    and resolves the preset), as PID 1 of a container too, where an unhandled signal is dropped."""
    out = tmp_path / "run"
    cmd = local_launch(out)
    proc = popen(["unshare", "--pid", "--fork", "--mount-proc", *cmd] if pid_1 else cmd, recording_starts(tmp_path))
    try:
        if pid_1:
            wait_until(lambda: psutil.Process(proc.pid).children(), proc)
            target = psutil.Process(proc.pid).children()[0].pid
        else:
            target = proc.pid
        wait_until(lambda: catches(target, signal.SIGTERM), proc)
        os.kill(target, signal.SIGTERM)
    finally:
        code, output = finish(proc)
    assert code == 128 + signal.SIGTERM, output[-3000:]
    assert "launch: SIGTERM received before any rank started: starting none" in output
    assert "launch: stopped by SIGTERM before any rank started: nothing was started" in output
    assert [line for line in started(tmp_path) if " train " in line] == []
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["local", "deepspeed", "slurm"])
def test_a_sigterm_at_the_last_moment_before_the_ranks_start_stops_the_launch(tmp_path, launcher):
    hold = tmp_path / "hold"
    hold.mkdir()
    out = tmp_path / "run"
    env = {**recording_starts(tmp_path), "TRAINER_LAUNCH_TEST_HOLD": f"before-ranks:{hold}",
           "PATH": f"{slurm_bin(tmp_path)}:{os.environ['PATH']}"}
    proc = popen(local_launch(out, "--launcher", launcher), env)
    try:
        wait_until((hold / "held").exists, proc)
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(0.5)
        (hold / "release").touch()
    finally:
        code, output = finish(proc)
    assert code == 128 + signal.SIGTERM, output[-3000:]
    assert "launch: stopped by SIGTERM before any rank started: nothing was started" in output
    assert [line for line in started(tmp_path) if "launch" not in line] == []  # no rank, no deepspeed runner
    assert not (tmp_path / "slurm-bin" / "sbatch.calls").exists()


@pytest.mark.multirank
def test_a_sigterm_while_the_ranks_start_reaches_each_of_them(tmp_path):
    """SIGTERM after rank 0 started and before rank 1 did: rank 0 gets it at once, rank 1 the moment it starts
    (not the SIGKILL a rank waiting for a peer that never got the signal would get after --failure-grace-s)."""
    hold = tmp_path / "hold"
    hold.mkdir()
    proc = popen(local_launch(tmp_path / "run", "--launcher", "local", "--failure-grace-s", "120"),
                 {"PYTHONPATH": str(REPO), "TRAINER_LAUNCH_TEST_HOLD": f"between-ranks:{hold}"})
    try:
        wait_until((hold / "held").exists, proc)
        os.kill(proc.pid, signal.SIGTERM)
        time.sleep(0.5)
        sent = time.monotonic()
        (hold / "release").touch()
        code, output = finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 128 + signal.SIGTERM, output[-3000:]
    assert "launch: SIGTERM received, forwarding it to 1 rank(s)" in output
    assert "launch: exit codes by rank: 0: 143, 1: 143" in output
    assert time.monotonic() - sent < 60
