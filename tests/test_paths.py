"""Every path flag of every command is checked for what it is before the command does anything, with the right
reason (issue: hardening round 2).

The tests enumerate argparse's actions, so a path flag added tomorrow with a trainer.paths kind is covered without
being listed here; each gets the bad paths of its role (input file, input directory, output file, output
directory), and every refusal must be exit 2, name the flag, say what the path really is, and write nothing.
"""
from __future__ import annotations

import argparse
import os

import pytest

from trainer import paths
from trainer.__main__ import build_parser, main, subcommands


def path_flags():
    parser, _ = build_parser()
    return [(name, action) for name, sub in subcommands(parser).items() for action in sub._actions
            if isinstance(action.type, paths.PathKind)]


FLAGS = path_flags()
IDS = [f"{name} {action.option_strings[0] if action.option_strings else action.dest}" for name, action in FLAGS]


@pytest.fixture
def places(tmp_path):
    """A regular file, a directory, a FIFO, a path below a file, a missing path and one in a missing directory."""
    (tmp_path / "file.txt").write_text("x\n")
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    return {"file": tmp_path / "file.txt", "dir": tmp_path / "dir", "fifo": tmp_path / "fifo",
            "below_file": tmp_path / "file.txt" / "x.png", "missing": tmp_path / "missing.png",
            "missing_parent": tmp_path / "no" / "such" / "x.png", "device": "/dev/full", "empty": ""}


BAD = {  # role/want -> {place: words the error must hold}
    ("input", "file"): {"missing": "does not exist", "dir": "is a directory", "fifo": "is a FIFO",
                        "device": "is a character device", "below_file": "below a regular file", "empty": "empty"},
    ("input", "directory"): {"missing": "does not exist", "file": "is a regular file", "fifo": "is a FIFO",
                             "below_file": "below a regular file", "empty": "empty"},
    ("output", "file"): {"dir": "is a directory", "fifo": "is a FIFO", "device": "is a character device",
                         "below_file": "below a regular file", "missing_parent": "does not exist", "empty": "empty"},
    ("output", "directory"): {"file": "is a regular file", "fifo": "is a FIFO", "device": "is a character device",
                              "below_file": "below a regular file", "empty": "empty"},
}


def parse(command: str, action: argparse.Action, value: str) -> tuple[int, str]:
    parser, _ = build_parser()
    if action.option_strings:
        words = [action.option_strings[0], str(value)]
    else:  # a positional: the ones before it get placeholders
        positionals = [a.dest for a in subcommands(parser)[command]._actions if not a.option_strings]
        words = ["tiny_cpu"] * positionals.index(action.dest) + [str(value)]
    try:
        parser.parse_args([command, *words])
        return 0, ""
    except SystemExit as stop:
        return stop.code, ""


def test_the_path_kinds_are_in_use():
    roles = {(action.type.role, action.type.want) for _, action in FLAGS}
    assert roles == set(BAD) and len(FLAGS) >= 14


@pytest.mark.parametrize("command,action", FLAGS, ids=IDS)
def test_every_path_flag_names_what_a_bad_path_is(capsys, places, tmp_path, command, action):
    kind = action.type
    before = sorted(p.name for p in tmp_path.rglob("*"))
    for place, words in BAD[(kind.role, kind.want)].items():
        value = places[place]
        if kind.suffixes and place in ("dir", "fifo", "device"):
            continue  # refused for its name first; the name check is tested below
        if kind.suffixes and place != "empty":
            value = value.with_suffix(kind.suffixes[0])
        code, _ = parse(command, action, value)
        err = capsys.readouterr().err
        name = action.option_strings[0] if action.option_strings else action.dest
        assert code == 2, (name, place, err)
        assert f"argument {name}" in err or any(f"argument {o}" in err for o in action.option_strings) \
            or f"argument {action.dest}" in err, err
        assert words in err, (name, place, err)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing created by a refusal


@pytest.mark.parametrize("command,action", FLAGS, ids=IDS)
def test_every_path_flag_takes_a_good_path(capsys, places, tmp_path, command, action):
    kind = action.type
    good = {("input", "file"): places["file"], ("input", "directory"): places["dir"],
            ("output", "file"): tmp_path / f"new{kind.suffixes[0] if kind.suffixes else '.out'}",
            ("output", "directory"): tmp_path / "new_dir"}[(kind.role, kind.want)]
    assert kind(str(good)) == str(good)


def test_an_output_name_with_the_wrong_suffix_is_refused(capsys):
    assert main(["plan", "--model", "7b", "--gpu", "a100-80g", "--chart", "plan.svg"]) == 2
    assert "must end in .png" in capsys.readouterr().err


def test_two_outputs_of_one_command_may_not_be_one_file(capsys, tmp_path):
    target = tmp_path / "plan.png"
    assert main(["plan", "--model", "7b", "--gpu", "a100-80g", "-o", str(target), "--chart", str(target)]) == 2
    err = capsys.readouterr().err
    assert "are the same file" in err and "-o" in err and "--chart" in err
    os.symlink(target, tmp_path / "link.png")  # another spelling of the same file
    target.write_text("{}")
    assert main(["plan", "--model", "7b", "--gpu", "a100-80g", "-o", str(target),
                 "--chart", str(tmp_path / "link.png")]) == 2
    assert "are the same file" in capsys.readouterr().err
    assert target.read_text() == "{}"


@pytest.mark.parametrize("name", ["p.yaml", "presets"])
@pytest.mark.parametrize("kind,says", [("dir", "is a directory"), ("fifo", "is a FIFO"), ("missing", "does not exist")])
def test_a_preset_path_says_what_is_there(capsys, tmp_path, kind, says, name):
    path = tmp_path / name
    if kind == "dir":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    assert main(["show", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}" in err and says in err and "Traceback" not in err, err


def test_a_file_deepspeed_also_reads_may_not_start_with_a_byte_order_mark(capsys, tmp_path):
    """We would drop the mark; DeepSpeed's runner would read it as part of the first host name."""
    hosts = tmp_path / "hosts"
    hosts.write_text("\ufefflocalhost slots=2\n", encoding="utf-8")
    assert main(["launch", "tiny_cpu", "--hostfile", str(hosts), "--dry-run"]) == 2
    assert f"hostfile {hosts} line 1: starts with a byte-order mark" in capsys.readouterr().err


def test_one_preparation_at_a_time_writes_an_output_directory(tmp_path):
    """A second prepare-data into the directory another is writing is refused (it would rename the other's
    temporary files away); the lock is the directory's own, so a refused run leaves nothing behind."""
    import fcntl
    from trainer.data.prepare import writing_alone
    from trainer.data.records import DataError
    out = tmp_path / "prepared"
    with writing_alone(out):
        with pytest.raises(DataError, match="another preparation is writing it now"):
            with writing_alone(out):
                pass
        fd = os.open(out, os.O_RDONLY)
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(fd)
    with pytest.raises(RuntimeError):
        with writing_alone(tmp_path / "refused"):
            raise RuntimeError("a check failed before anything was written")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepared"]


@pytest.mark.slow  # 3-9 s in the quick tier's list of tests slower than 2 s (issue 36's 120 s budget)
def test_a_jsonl_record_with_a_key_twice_is_named(capsys, tmp_path):
    from trainer.presets import REPO_ROOT
    rows = "".join(f'{{"text": "row {i}"}}\n' for i in range(20))
    source = tmp_path / "dup.jsonl"
    source.write_text(rows + '{"text": "a \\": b", "meta": {"k": 1, "k": 2}}\n')
    out = tmp_path / "out"
    assert main(["prepare-data", "--source", str(source), "--tokenizer", str(REPO_ROOT / "data/tiny/tokenizer"),
                 "--num-proc", "1", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "line 21" in err and "duplicate key 'k'" in err and "Traceback" not in err, err
    assert not out.exists()


def obstacle(rng, root, index: int) -> tuple[str, str]:
    """A path that is there but cannot be looked at, and what the refusal must say: a loop of drawn length, a name
    too long, a path below a file (Path.exists() is False for each: they used to be reported as missing)."""
    kind = rng.choice(["loop", "long", "below"])
    if kind == "loop":
        links = [root / f"loop{index}_{i}" for i in range(rng.randint(1, 3))]
        for i, link in enumerate(links):
            link.symlink_to(links[(i + 1) % len(links)].name)
        return str(links[0]), "Too many levels of symbolic links"
    if kind == "long":
        return str(root / ("n" * rng.randint(256, 400))), "a name too long"
    (root / f"plain{index}").write_text("x\n")
    return str(root / f"plain{index}" / "data.jsonl"), "below a regular file"


SURFACES = {  # paths that are config values or untyped positionals, not PathKind flags
    "data.source": lambda p: ["show", "tiny_cpu", "--set", f"data.source={p}"],
    "prepare --source": lambda p: ["prepare-data", "--task", "pretrain", "--source", p, "--tokenizer",
                                   "data/tiny/tokenizer", "--out", p + "_out"],
    "report RUN": lambda p: ["report", p, "-o", os.path.join(os.path.dirname(p), "report.png")],
    "plan SCENARIO": lambda p: ["plan", p],
    "model.tokenizer": lambda p: ["show", "tiny_cpu", "--set", f"model.tokenizer={p}"],
    "prepare --tokenizer": lambda p: ["prepare-data", "--task", "pretrain", "--source", "data/tiny/pretrain.jsonl",
                                      "--tokenizer", p, "--out", p + "_out"],
}


def test_a_path_that_is_there_but_unreadable_is_named_as_such_where_a_config_or_positional_gives_it(capsys,
                                                                                                      tmp_path):
    import random
    rng = random.Random(38)
    for index in range(10):
        surface = rng.choice(sorted(SURFACES))
        path, says = obstacle(rng, tmp_path, index)
        code = main(SURFACES[surface](path))
        err = capsys.readouterr().err
        assert code == 2 and "Traceback" not in err, (surface, path, err)
        assert says in err and "does not exist" not in err and "no such file" not in err, (surface, says, err)
    assert not list(tmp_path.rglob("*.png")) and not list(tmp_path.glob("*_out"))


def test_a_tokenizer_given_as_one_of_its_files_names_the_directory_to_give(capsys):
    """model.tokenizer / --tokenizer pointed at a file of a tokenizer (tokenizer.json, the config): named, with its
    directory, by show and by prepare-data (which used to pass it to the hub as a repo id)."""
    import random
    rng = random.Random(39)
    folder = "data/tiny/tokenizer"
    for _ in range(3):
        file = f"{folder}/{rng.choice(sorted(os.listdir(folder)))}"
        for argv in (["show", "tiny_cpu", "--set", f"model.tokenizer={file}"],
                     ["prepare-data", "--task", "pretrain", "--source", "data/tiny/pretrain.jsonl", "--tokenizer", file,
                      "--out", "/nonexistent-parent/never"]):
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            assert f"{file!r} is a file; give the directory that holds it ({folder!r})" in err and "Repo id" not in err, err
