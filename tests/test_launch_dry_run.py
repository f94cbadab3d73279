"""`launch --dry-run` is the real launch minus its side effect (issue 23): every input the real launch refuses, the
dry run refuses with the same words, and neither writes anything. The real path runs here in process with its
first side effect (recording launch.json, starting the launcher or the ranks) replaced by an exception, so a
case that slipped through validation shows as "started", never as a job. Also: the words after `--` cannot
change the config the launcher checked, a one-host hostfile is kept, and `.env`-style files refuse a name set
twice (file:line of both)."""
from __future__ import annotations

import pytest

from trainer.__main__ import main
from trainer.errors import UserError
from trainer.launch import cli, runner, supervisor
from trainer.launch.dsenv import parse_user_env
from trainer.launch.fabric import parse_env


class Started(Exception):
    """The real launch got past every check to its first side effect."""


@pytest.fixture
def no_side_effects(monkeypatch):
    def started(*args, **kwargs):
        raise Started()
    monkeypatch.setattr(runner, "start_redacted", started)
    monkeypatch.setattr(runner, "record_launch", started)
    monkeypatch.setattr(cli, "record_launch", started)
    monkeypatch.setattr(supervisor, "launch", started)


def outcome(capsys, argv: list[str]) -> tuple[object, str]:
    try:
        code = main(["launch", *argv])
    except Started:
        code = "started"
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err[err.find("error: "):] if "error: " in err else ""


REFUSED = {  # flags after `launch tiny_cpu`: what the error names
    "output dir below a file": (["--set", "train.output_dir={tmp}/file/run"], "train.output_dir"),
    "torchrun node without a rank": (["--launcher", "torchrun", "--nnodes", "2"], "--node-rank"),
    "local node rank past the nodes": (["--nnodes", "2", "--node-rank", "2"], "--node-rank=2"),
    "passthrough preset": (["--", "--preset", "7b_8xa100"], "--preset 7b_8xa100 changes the config"),
    "passthrough set": (["--", "--set", "train.lr=1"], "--set train.lr=1 changes the config"),
    "passthrough world size": (["--", "--world-size", "8"], "--world-size 8 changes the config"),
    "passthrough autotuner config": (["--", "--deepspeed_config", "x.json"], "--deepspeed_config x.json is set by"),
    "passthrough unknown": (["--", "--epochs", "3"], "--epochs 3 after `--`: train takes no such"),
    "passthrough given twice": (["--resume", "auto", "--", "--resume", "off"], "--resume off is given before"),
    "ssh port without hosts": (["--ssh-port", "2222"], "--ssh-port does nothing without --launcher deepspeed with --hostfile"),
    "fabric name twice": (["--fabric", "{tmp}/dup.env"], "dup.env:3: NCCL_A is set again (first at"),
    "batch from a --set": (["--set", "deepspeed.train_batch_size=7"], "(from the --set items --set deepspeed.train"),
    "slurm empty time limit": (["--launcher", "slurm", "--time", ""], "--time '': not a Slurm time"),
    "node rank the deepspeed launcher ignores": (["--launcher", "deepspeed", "--node-rank", "1"],
                                                 "--node-rank does nothing without"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_the_dry_run_refuses_what_the_real_launch_refuses(name, tmp_path, capsys, no_side_effects):
    (tmp_path / "file").write_text("x")
    (tmp_path / "dup.env").write_text("NCCL_A=1\n# why\nNCCL_A=2\n")
    flags, says = REFUSED[name]
    argv = ["tiny_cpu", *[f.replace("{tmp}", str(tmp_path)) for f in flags]]
    cut = argv.index("--") if "--" in argv else len(argv)
    dry = outcome(capsys, argv[:cut] + ["--dry-run"] + argv[cut:])
    real = outcome(capsys, argv)
    assert dry == real, f"dry run {dry} but real launch {real}"
    assert dry[0] == 2 and says.replace("{tmp}", str(tmp_path)) in dry[1], dry
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dup.env", "file"]


def test_a_valid_launch_passes_both_and_only_the_real_one_starts(tmp_path, capsys, no_side_effects):
    argv = ["tiny_cpu", "--set", f"train.output_dir={tmp_path / 'run'}", "--", "--resume", "auto", "--rehearse"]
    assert outcome(capsys, argv[:3] + ["--dry-run"] + argv[3:])[0] == 0
    assert outcome(capsys, argv)[0] == "started"
    assert not (tmp_path / "run").exists()


def test_a_one_host_hostfile_is_kept_and_run_on_that_host(tmp_path, capsys):
    """DeepSpeed's runner runs a single active host on the launching machine, whatever the hostfile names,
    unless --force_multi: the launch passes the hostfile and --force_multi, and exports over pdsh as for two."""
    hosts = tmp_path / "hosts"
    hosts.write_text("worker-7 slots=1\n")
    assert main(["launch", "tiny_cpu", "--hostfile", str(hosts), "--set", "hardware.gpus_per_node=1",
                 "--ssh-port", "2222", "--dry-run"]) == 0
    line = capsys.readouterr().out.split("launch: the command:\n")[1].splitlines()[0]
    assert f"deepspeed --hostfile {hosts} --num_nodes 1 --force_multi --num_gpus 1 --ssh_port 2222 " in line


@pytest.mark.parametrize("reader,name", [(parse_env, "fabric profile"), (parse_user_env, "DeepSpeed environment file")])
def test_an_env_file_that_sets_a_name_twice_names_both_lines(reader, name):
    with pytest.raises(UserError) as err:
        reader("NCCL_A=1\nNCCL_B=2\n\n# again\nNCCL_A=3\nNCCL_B=2\n", "site.env")
    text = str(err.value)
    assert name in text
    assert "site.env:5: NCCL_A is set again (first at site.env:1)" in text
    assert "site.env:6: NCCL_B is set again (first at site.env:2)" in text  # the same value too: one line each
