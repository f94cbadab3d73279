"""`python -m trainer launch PRESET`: the command each launcher gets (--dry-run), the hostfile read as DeepSpeed
reads it and refused where it cannot work, the launch world size checked against the preset, fabric profiles,
and the Slurm script (issue 11). Nothing here starts a rank."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from distributed import new_port, run_cli
from trainer.errors import UserError
from trainer.launch.dsenv import deepspeed_env
from trainer.launch.fabric import load_fabric, parse_env, shipped_profiles
from trainer.launch.hostfile import parse_hostfile

DS_RUNNER = pytest.importorskip("deepspeed.launcher.runner")
ONE_SLOT = ["--set", "hardware.gpus_per_node=1"]


def hostfile(tmp_path, text: str, name: str = "hostfile") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def dry_run(*args: str) -> subprocess.CompletedProcess:
    cut = args.index("--") if "--" in args else len(args)  # what follows `--` goes to the ranks
    return run_cli("launch", *args[:cut], "--dry-run", *args[cut:])


def command_line(proc) -> str:
    """The printed command: the line after `launch: the command:`."""
    lines = proc.stdout.splitlines()
    return lines[lines.index("launch: the command:") + 1]


# --- hostfile ----------------------------------------------------------------------------------------------

ACCEPTED = ["worker-0 slots=8\nworker-1 slots=8\n", "# comment\n\n  w0 slots=4  \nw1\tslots=4\n",
            "w0 slots=2 # trailing comment\n"]


@pytest.mark.parametrize("text", ACCEPTED)
def test_hostfiles_deepspeed_accepts_read_the_same(text):
    ours = parse_hostfile(text)
    theirs = DS_RUNNER._parse_hostfile(text.splitlines(keepends=True))
    assert dict(ours.hosts) == dict(theirs) and [h for h, _ in ours.hosts] == list(theirs)


@pytest.mark.parametrize("text", ["w0\n", "w0 slots=\n", "w0 slots = 4\n", "slots=4\n", "w0 slots=4\nw0 slots=4\n",
                                  "# only a comment\n"])
def test_hostfiles_deepspeed_refuses_are_refused(text):
    with pytest.raises(ValueError):
        DS_RUNNER._parse_hostfile(text.splitlines(keepends=True))
    with pytest.raises(UserError):
        parse_hostfile(text)


def test_hostfile_problems_are_named_with_file_and_line_all_at_once(tmp_path):
    path = hostfile(tmp_path, "# nodes\nlocalhost slots=1\n127.0.0.1 slots=1 gpus=2\nlocalhost slots=2\nnode3\n"
                              "node4 slots=0\n")
    proc = dry_run("tiny_cpu", "--hostfile", path)
    assert proc.returncode == 2
    err = proc.stderr
    assert f"{path}:3: 'gpus=2' after `slots=1`: DeepSpeed would ignore it and read 1 slots" in err
    assert f"{path}:4: localhost is listed twice (first on line 2)" in err
    assert f"{path}:5: 'node3' is not `HOST slots=N`" in err
    assert f"{path}:6: node4 has slots=0" in err


def test_slots_that_disagree_with_the_preset_are_refused(tmp_path):
    path = hostfile(tmp_path, "a slots=2\nb slots=4\n")
    proc = dry_run("tiny_cpu", "--hostfile", path)
    assert proc.returncode == 2
    assert "b slots=4 but the preset has hardware.gpus_per_node=2: give every host slots=2" in proc.stderr


def test_a_missing_hostfile_is_named(tmp_path):
    proc = dry_run("tiny_cpu", "--hostfile", str(tmp_path / "nope"))
    assert proc.returncode == 2 and f"hostfile '{tmp_path / 'nope'}' does not exist" in proc.stderr


# --- the world size the launch makes, resolved before anything starts ----------------------------------------

@pytest.mark.slow  # 3-9 s in the quick tier's list of tests slower than 2 s (issue 36's 120 s budget)
def test_a_world_size_the_batch_triad_cannot_use_is_refused(tmp_path):
    path = hostfile(tmp_path, "a slots=2\nb slots=2\n")  # 4 ranks; 24 is no multiple of micro 4 x 4 ranks
    proc = dry_run("tiny_cpu", "--hostfile", path, "--set", "deepspeed.train_batch_size=24",
                   "--set", "train.micro_batch_size=4", "--set", "train.grad_accum=auto")
    assert proc.returncode == 2, proc.stdout
    assert "global_batch_size 24 is not a multiple of micro_batch_size 4 x data-parallel size 4" in proc.stderr
    assert f"resolved for the launch: 2 node(s) x 2 rank(s) = world size 4, from the hostfile {path}" in proc.stderr
    same_on_one_node = dry_run("tiny_cpu", "--set", "deepspeed.train_batch_size=24", "--set",
                               "train.micro_batch_size=4", "--set", "train.grad_accum=auto")
    assert same_on_one_node.returncode == 0, same_on_one_node.stderr  # 24 = 4 x 3 x 2 ranks: fine on one node


ZERO3 = ["--set", "deepspeed.zero_optimization.stage=3"]


@pytest.mark.slow
def test_hpz_that_spans_nodes_or_does_not_divide_the_world_is_refused(tmp_path):
    path = hostfile(tmp_path, "a slots=2\nb slots=2\n")
    spans = dry_run("tiny_cpu", "--hostfile", path, *ZERO3, "--set",
                    "deepspeed.zero_optimization.zero_hpz_partition_size=4")
    assert spans.returncode == 2
    assert "zero_hpz_partition_size=4 does not divide the 2 rank(s) per node: its groups would span nodes; set it " \
           "to 2" in spans.stderr
    three = hostfile(tmp_path, "a slots=2\nb slots=2\nc slots=2\n", "three")
    world = dry_run("tiny_cpu", "--hostfile", three, *ZERO3, "--set",
                    "deepspeed.zero_optimization.zero_hpz_partition_size=4", "--set", "deepspeed.train_batch_size=24",
                    "--set", "train.grad_accum=auto", "--set", "train.micro_batch_size=4")
    assert world.returncode == 2 and "zero_hpz_partition_size=4 must divide the world size 6" in world.stderr
    fits = dry_run("tiny_cpu", "--hostfile", path, *ZERO3, "--set",
                   "deepspeed.zero_optimization.zero_hpz_partition_size=2")
    assert fits.returncode == 0, fits.stderr


@pytest.mark.slow  # 3-9 s in the quick tier's list of tests slower than 2 s (issue 36's 120 s budget)
def test_autotp_across_nodes_is_refused(tmp_path):
    path = hostfile(tmp_path, "a slots=2\nb slots=2\n")
    proc = dry_run("tiny_cpu", "--hostfile", path, "--set", "deepspeed.zero_optimization.stage=1",
                   "--set", "deepspeed.tensor_parallel={autotp_size: 4}", "--set", "model.num_heads=8",
                   "--set", "model.num_kv_heads=8")
    assert proc.returncode == 2
    assert "autotp_size=4 does not divide the 2 rank(s) per node: tensor-parallel all-reduces would cross" \
        in proc.stderr


def test_quantized_gradients_across_cpu_nodes_are_refused_before_the_first_step(tmp_path):
    """Measured: on CPU ranks across nodes ZeRO-3's all_to_all_quant_reduce dies at step 1 ("This op had not been
    implemented on CPU backend"); the launch says so before anything starts."""
    proc = dry_run("tiny_cpu", "--nnodes", "2", "--node-rank", "0", *ZERO3,
                   "--set", "deepspeed.zero_optimization.zero_hpz_partition_size=2",
                   "--set", "deepspeed.zero_optimization.zero_quantized_gradients=true")
    assert proc.returncode == 2 and "zero_quantized_gradients across nodes needs GPUs" in proc.stderr


def test_a_world_size_flag_that_contradicts_the_hostfile_is_refused(tmp_path):
    path = hostfile(tmp_path, "a slots=1\nb slots=1\n")
    proc = dry_run("tiny_cpu", "--hostfile", path, *ONE_SLOT, "--world-size", "4")
    assert proc.returncode == 2 and "--world-size 4 but the launch starts 2 node(s) x 1 rank(s) = 2" in proc.stderr


def test_a_multi_node_preset_without_a_hostfile_says_how_to_give_the_nodes():
    proc = dry_run("tiny_cpu", "--set", "hardware.nodes=2")
    assert proc.returncode == 2 and "hardware.nodes=2 nodes: give --hostfile FILE" in proc.stderr


# --- the command each launcher gets --------------------------------------------------------------------------

def test_single_node_deepspeed_dry_run_prints_the_command_and_writes_nothing(tmp_path):
    out = tmp_path / "run"
    proc = dry_run("tiny_cpu", "--set", f"train.output_dir={out}", "--", "--resume", "auto")
    assert proc.returncode == 0, proc.stderr
    assert command_line(proc) == (f"deepspeed --num_gpus 2 train.py --preset tiny_cpu --world-size 2 "
                                  f"--set train.output_dir={out} --resume auto")
    assert not out.exists()


@pytest.mark.slow
def test_positional_and_flag_preset_are_one_preset():
    assert command_line(dry_run("--preset", "tiny_cpu")) == command_line(dry_run("tiny_cpu"))
    both = dry_run("tiny_cpu", "--preset", "7b_8xa100")
    assert both.returncode == 2 and "two presets" in both.stderr


def test_cpu_offload_binds_cores_to_ranks():
    proc = dry_run("tiny_cpu", "--set", "deepspeed.zero_optimization.offload_optimizer={device: cpu}")
    assert "--bind_cores_to_rank" in command_line(proc).split()


@pytest.mark.slow
def test_hostfile_dry_run_names_the_hostfile_the_fabric_and_the_deepspeed_env(tmp_path):
    path = hostfile(tmp_path, "localhost slots=1\n127.0.0.1 slots=1\n")
    out = tmp_path / "run"
    proc = dry_run("tiny_cpu", "--hostfile", path, "--fabric", "tcp", "--master-port", "30250", *ONE_SLOT,
                   "--set", f"train.output_dir={out}")
    assert proc.returncode == 0, proc.stderr
    line = command_line(proc)
    assert line.startswith("NCCL_IB_DISABLE=1 NCCL_SOCKET_IFNAME='^lo,docker0' NCCL_SOCKET_NTHREADS=4 "
                           f"NCCL_NSOCKS_PERTHREAD=4 DS_ENV_FILE={out}/deepspeed_env deepspeed --hostfile {path} "
                           f"--num_nodes 2 --num_gpus 1 --master_port 30250 train.py --preset tiny_cpu --world-size 2")
    assert f"{out}/deepspeed_env (DS_ENV_FILE, read by DeepSpeed's runner for every node) would hold:\n" \
           "NCCL_IB_DISABLE=1\nNCCL_SOCKET_IFNAME=^lo,docker0\n" in proc.stdout
    assert not out.exists()  # a dry run writes nothing


@pytest.mark.slow
def test_torchrun_static_and_dynamic_rendezvous():
    static = command_line(dry_run("tiny_cpu", "--launcher", "torchrun", "--nnodes", "2", "--nproc-per-node", "1",
                                  "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "30251"))
    assert static == ("torchrun --nproc_per_node 1 --nnodes 2 --node_rank 1 --master_addr 10.0.0.1 --master_port "
                      "30251 train.py --preset tiny_cpu --world-size 2")
    dynamic = command_line(dry_run("tiny_cpu", "--launcher", "torchrun", "--nnodes", "2", "--rdzv-backend", "c10d",
                                   "--rdzv-id", "job7", "--master-addr", "head"))
    assert ("torchrun --nproc_per_node 2 --nnodes 2 --rdzv_backend c10d --rdzv_endpoint head:29500 --rdzv_id job7 "
            "train.py --preset tiny_cpu --world-size 4") == dynamic


def test_node_local_launcher_dry_run():
    line = command_line(dry_run("tiny_cpu", "--nnodes", "2", "--node-rank", "1", "--master-addr", "head"))
    assert " -m trainer launch --launcher local --nproc-per-node 2 --nnodes 2 --node-rank 1 --master-addr head " \
           "--preset tiny_cpu --world-size 4" in line


# --- fabric profiles ---------------------------------------------------------------------------------------------

def test_every_shipped_profile_parses_and_explains_each_variable():
    assert {"ib", "roce", "tcp", "nvlink-ib", "debug"} <= set(shipped_profiles())
    for name in shipped_profiles():
        fabric = load_fabric(name)
        assert fabric.env, name
        lines = open(fabric.sources[0]).read().splitlines()
        for number, line in enumerate(lines):
            if line and not line.startswith("#"):  # a variable: a comment line right above it (or its group's)
                above = next(lines[i] for i in range(number - 1, -1, -1)
                             if not lines[i].startswith(("NCCL_", "TORCH_")))
                assert above.startswith("#"), f"{name}: {line} has no comment saying why"
    assert dict(load_fabric("roce").env)["NCCL_IB_GID_INDEX"] == "3"
    assert dict(load_fabric("debug").env)["NCCL_DEBUG"] == "INFO"


def test_profiles_combine_later_wins_and_a_bad_line_is_named(tmp_path):
    combined = dict(load_fabric("ib,tcp").env)
    assert combined["NCCL_IB_DISABLE"] == "1" and combined["NCCL_IB_HCA"] == "mlx5"
    mine = tmp_path / "mine.env"
    mine.write_text("# ok\nNCCL_IB_HCA=mlx5_0\nnot a line\nNCCL_SOCKET_IFNAME=$IFACE\n")
    with pytest.raises(UserError) as err:
        load_fabric(str(mine))
    assert f"{mine}:3: 'not a line' is not NAME=value" in str(err.value)
    assert f"{mine}:4: the value of NCCL_SOCKET_IFNAME: it holds $, which the node's shell reads as code" \
        in str(err.value)
    assert parse_env("A=1\n", "x") == {"A": "1"}


def test_the_users_deepspeed_env_is_merged_not_clobbered(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / ".deepspeed_env").write_text("NCCL_IB_HCA=mlx5_2\nMY_VAR=1\n")
    env = deepspeed_env(load_fabric("ib"))
    text = env.text()
    assert "NCCL_IB_HCA=mlx5_2\n" in text and "MY_VAR=1\n" in text and "NCCL_IB_DISABLE=0\n" in text
    assert list(env.notes) == [f"{tmp_path}/home/.deepspeed_env sets NCCL_IB_HCA=mlx5_2 over the fabric profile's mlx5"]
    assert (tmp_path / "home" / ".deepspeed_env").read_text() == "NCCL_IB_HCA=mlx5_2\nMY_VAR=1\n"


def test_a_flag_of_another_launcher_is_refused_not_ignored():
    proc = dry_run("tiny_cpu", "--time", "01:00:00", "--rdzv-id", "x")
    assert proc.returncode == 2
    assert "--rdzv-id does nothing without --launcher torchrun with --rdzv-backend" in proc.stderr
    assert "--time does nothing without --launcher slurm" in proc.stderr


def test_unknown_fabric_is_named():
    proc = dry_run("tiny_cpu", "--fabric", "infiniband")
    assert proc.returncode == 2 and "--fabric 'infiniband': not a shipped profile (debug, ib" in proc.stderr


# --- Slurm --------------------------------------------------------------------------------------------------

def test_slurm_script_from_the_preset(tmp_path):
    out = tmp_path / "run"
    proc = dry_run("tiny_cpu", "--launcher", "slurm", "--set", "hardware.nodes=2", "--set",
                   f"train.output_dir={out}", "--fabric", "tcp", "--time", "02:00:00", "--signal-grace-s", "240",
                   "--partition", "gpu", "--", "--resume", "auto")
    assert proc.returncode == 0, proc.stderr
    script = proc.stdout.split("would hold:\n", 1)[1].split("\nlaunch: the command:", 1)[0]
    for line in ["#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --time=02:00:00",
                 "#SBATCH --signal=TERM@240", "#SBATCH --partition=gpu", f"#SBATCH --output={out}/slurm-%j.out",
                 "export NCCL_IB_DISABLE=1", 'HOSTS=$(scontrol show hostnames "$SLURM_JOB_NODELIST")',
                 'export MASTER_ADDR=$(echo "$HOSTS" | head -n 1)']:
        assert line in script.splitlines(), line
    assert "--gpus-per-node" not in script  # CPU ranks
    srun = next(line for line in script.splitlines() if line.startswith("srun "))
    assert "--ntasks-per-node=1" in srun and "--launcher local --nproc-per-node 2 --nnodes 2 --node-rank " \
           '"$SLURM_NODEID" --master-addr "$MASTER_ADDR" --master-port 29500 --preset tiny_cpu --world-size 4' in srun
    assert srun.endswith("--resume auto'")
    assert command_line(proc) == f"sbatch {out}/job.sbatch"
    script_file = tmp_path / "job.sbatch"
    script_file.write_text(script)
    syntax = subprocess.run(["bash", "-n", str(script_file)], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    assert not out.exists()


@pytest.mark.slow  # 3-9 s in the quick tier's list of tests slower than 2 s (issue 36's 120 s budget)
def test_slurm_gpu_preset_asks_for_gpus_and_refuses_a_bad_time():
    proc = dry_run("70b_32xa100", "--launcher", "slurm")
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --nodes=4" in proc.stdout and "#SBATCH --gpus-per-node=8" in proc.stdout
    bad = dry_run("tiny_cpu", "--launcher", "slurm", "--time", "2 hours", "--signal-grace-s", "5")
    assert bad.returncode == 2 and "--time '2 hours': not a Slurm time" in bad.stderr
    assert "--signal-grace-s 5: under 30 s leaves no time to save a checkpoint" in bad.stderr


@pytest.mark.slow  # six launch dry runs
def test_preemptible_launchers_resume_by_default_and_the_users_choice_wins():
    """Issue 37: a requeued Slurm job (or a rescheduled node-local launcher) continues its run; --resume off, a
    --resume after `--` or a --set train.resume is kept as given."""
    slurm = dry_run("70b_32xa100", "--launcher", "slurm", "--time", "2-00:00:00", "--partition", "gpu")
    assert slurm.returncode == 0, slurm.stderr
    srun = next(line for line in slurm.stdout.splitlines() if line.startswith("srun "))
    assert srun.endswith("--resume auto'") and "resumes by default (--resume auto" in slurm.stderr
    local = dry_run("tiny_cpu", "--nnodes", "2", "--node-rank", "1", "--master-addr", "head")
    assert command_line(local).endswith("--world-size 4 --resume auto")
    chosen = {("--resume", "off"): "--resume off", ("--set", "train.resume=null", "--", "--resume", "off"):
              "--resume off", ("--set", "train.resume=/ckpt/step_00000010"): "--set train.resume=/ckpt/step_00000010"}
    for words, kept in chosen.items():
        line = command_line(dry_run("tiny_cpu", "--launcher", "local", *words))
        assert "--resume auto" not in line and kept in line, (words, line)
    plain = dry_run("tiny_cpu")  # deepspeed on one node: nothing restarts it, a rerun starts fresh as before
    assert "--resume" not in command_line(plain) and "resumes by default" not in plain.stderr


@pytest.mark.skipif(shutil.which("sbatch") is not None, reason="Slurm is installed here")
def test_slurm_without_sbatch_is_named(tmp_path):
    proc = run_cli("launch", "tiny_cpu", "--launcher", "slurm", "--set", f"train.output_dir={tmp_path / 'r'}")
    assert proc.returncode == 2 and "sbatch is not on PATH" in proc.stderr


@pytest.mark.slow
def test_launch_json_is_written_before_the_ranks_start(tmp_path):
    """With a launcher that exits at once (deepspeed's runner: no sshd on that port), launch.json is already
    there, whole, naming the command, the hostfile and the fabric."""
    path = hostfile(tmp_path, "127.0.0.1 slots=1\n127.0.0.2 slots=1\n")
    out = tmp_path / "run"
    proc = run_cli("launch", "tiny_cpu", "--hostfile", path, "--fabric", "tcp", "--ssh-port", str(new_port()),
                   *ONE_SLOT, "--set", f"train.output_dir={out}")
    assert proc.returncode != 0
    record = json.loads((out / "launch.json").read_text())
    assert record["launcher"] == "deepspeed" and record["world_size"] == 2
    assert record["hostfile"]["hosts"] == [{"host": "127.0.0.1", "slots": 1}, {"host": "127.0.0.2", "slots": 1}]
    assert record["fabric"]["env"]["NCCL_IB_DISABLE"] == "1"
    assert record["command"].split(" deepspeed ")[1].startswith(f"--hostfile {path} --num_nodes 2")
    assert (out / "deepspeed_env").read_text() == record["deepspeed_env"]["text"]
    assert "was not reachable via ssh" in proc.stdout + proc.stderr
