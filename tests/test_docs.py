"""The docs cannot rot (issue 29): every command in README.md and docs/*.md is checked against the real code.

Each line of a ```bash / ```sh / ```console block (continuations joined, `FOO=1` prefixes, `.venv/bin/`, `exec` and
`$ ` prompts dropped, `&&` chains split) that starts `python -m trainer`, `python train.py`, `deepspeed` or `torchrun`
is checked at three depths:

- parsed, always: the launcher's words by the launcher's own parser (DeepSpeed's runner, torchrun's), the trainer's
  by the real subcommand parser (`trainer.__main__.build_parser`);
- resolved, always, for training lines: the preset and every `--set` through the path a rank takes
  (`load_preset` -> `resolve`) at the launched world size, without starting a rank;
- run, unless marked: the command itself in a subprocess on this CPU machine, in a scratch directory that sees the
  repository's files (outputs land there). A command that cannot run here says so where the reader sees it, as a
  comment line `# not run here: REASON` above it in its block (it marks every command after it in that block) or
  at the end of its own line. Launcher lines (deepspeed, torchrun, train.py) are never run here: they need the
  marker.

A failure names the file and line. Also checked: links into docs/ and between pages (files and anchors), the
README's size and its test command (= .ci/run's), every number table of docs/performance.md names the script that
produced it and its date, and every command's --help has a purpose, an example and a docs/ page that exists.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from trainer.__main__ import build_parser, main, subcommands
from trainer.commands import COMMANDS
from trainer.paths import PathKind
from trainer.plan.estimate import gb
from trainer.presets import load_preset
from trainer.provenance import VOLATILE
from trainer.resolve import resolve

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINKED = [*PAGES, REPO / "scripts" / "README.md"]  # pages whose links and script lines are checked too
README_LIMIT_BYTES = 15_000
SHELL = ("bash", "sh", "console", "shell")
MARK = re.compile(r"#\s*not run here:\s*(\S.*)")
# shell variables the docs use in per-node lines, with a value of the right kind for the parsers
VARIABLES = {"NODE_RANK": "0", "HEAD": "head", "SLURM_NNODES": "2", "SLURM_NODEID": "0"}


@dataclass
class Line:
    page: Path
    number: int          # 1-based line in the page where the command starts
    words: list[str]     # the command, prefixes dropped
    not_run: str = ""    # the marker's reason; empty: the test runs it
    env: dict = field(default_factory=dict)  # `NAME=value` prefixes: the command runs with them

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.number}"


@dataclass
class Trainer:
    """What a doc line asks the trainer to do."""
    argv: list[str]                  # `python -m trainer` words: COMMAND ARGS
    launcher: str = ""               # deepspeed | torchrun | "" (python)
    world_size: int | None = None    # ranks the launcher starts, when it says
    extra: dict = field(default_factory=dict)


# ---- reading the pages ---------------------------------------------------------------------------------------

def shell_blocks(page: Path):
    """(first line number, [(line number, text)]) of each shell block of a markdown page."""
    block, start, lang = None, 0, ""
    for number, text in enumerate(page.read_text().splitlines(), 1):
        fence = re.match(r"\s*```(\w*)", text)
        if fence and block is None:
            block, start, lang = [], number, fence.group(1)
        elif fence:
            if lang in SHELL:
                yield start, block
            block = None
        elif block is not None:
            block.append((number, text))


def logical_lines(block):
    """Backslash continuations joined: (line number of the first piece, text)."""
    pending, first = "", 0
    for number, text in block:
        if not pending:
            first = number
        if text.rstrip().endswith("\\"):
            pending += text.rstrip()[:-1] + " "
            continue
        yield first, pending + text
        pending = ""


def command_lines(page: Path) -> list[Line]:
    found = []
    for _, block in shell_blocks(page):
        marked = ""
        for number, text in logical_lines(block):
            stripped = text.strip()
            if stripped.startswith("#"):
                mark = MARK.match(stripped)
                marked = mark.group(1) if mark else marked
                continue
            trailing = MARK.search(text)
            words = split_words(text, f"{page.relative_to(REPO)}:{number}")
            for command in split_chain(words):
                env = dict(word.split("=", 1) for word in command[:len(command) - len(drop_prefixes(command))]
                           if "=" in word)
                command = drop_prefixes(command)
                if is_checked(command):
                    found.append(Line(page, number, command, trailing.group(1) if trailing else marked, env))
    return found


def split_words(text: str, where: str) -> list[str]:
    text = re.sub(r"^\s*\$ ", "", text)  # a console prompt
    try:
        words = shlex.split(text, comments=True)
    except ValueError as err:
        raise AssertionError(f"{where}: not a shell line ({err}): {text}")
    return [substitute(word, where) for word in words]


def substitute(word: str, where: str) -> str:
    def value(match):
        name = match.group(1) or match.group(2)
        assert name in VARIABLES, f"{where}: ${name}: give it a sample value in VARIABLES of tests/test_docs.py"
        return VARIABLES[name]
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, word)


def split_chain(words: list[str]) -> list[list[str]]:
    chain, current = [], []
    for word in words:
        if word in ("&&", "||", ";", "|"):
            chain.append(current)
            current = []
        else:
            current.append(word)
    return [*chain, current]


def drop_prefixes(words: list[str]) -> list[str]:
    """`FOO=1 exec .venv/bin/python ...` -> `python ...`."""
    while words and (re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]) or words[0] in ("exec", "env")):
        words = words[1:]
    if words:
        words = [re.sub(r"^(\./)?\.venv/bin/", "", words[0]), *words[1:]]
    return words


def is_checked(words: list[str]) -> bool:
    if not words:
        return False
    if words[0] in ("deepspeed", "torchrun"):
        return True
    return words[0] in ("python", "python3") and (words[1:3] == ["-m", "trainer"] or words[1:2] == ["train.py"])


ALL = [line for page in PAGES for line in command_lines(page)]


# ---- what a line asks for --------------------------------------------------------------------------------------

def trainer_call(line: Line) -> Trainer:
    """The trainer words of a line, the launcher's own words parsed by the launcher's own parser."""
    head = line.words[0]
    if head in ("python", "python3"):
        rest = line.words[3:] if line.words[1] == "-m" else ["train", *line.words[2:]]
        return Trainer(rest)
    if head == "deepspeed":
        from deepspeed.launcher.runner import parse_args
        parsed = parse_args(line.words[1:])
        script, args = parsed.user_script, list(parsed.user_args)
        # with a hostfile the world is the hostfile's slots: the preset's own world size stands for it
        world = parsed.num_gpus if parsed.num_gpus > 0 and "--hostfile" not in line.words else None
        return Trainer(called(line, script, args, parsed.module), "deepspeed", world)
    from torch.distributed.run import get_args_parser
    parsed = get_args_parser().parse_args(line.words[1:])
    per_node = int(parsed.nproc_per_node) if str(parsed.nproc_per_node).isdigit() else None
    nodes = int(parsed.nnodes) if str(parsed.nnodes).isdigit() else None
    world = per_node * nodes if per_node and nodes else None
    return Trainer(called(line, parsed.training_script, list(parsed.training_script_args), parsed.module),
                   "torchrun", world)


def called(line: Line, script: str, args: list[str], module: bool) -> list[str]:
    if module:
        assert script == "trainer", f"{line.where}: launches module {script}, not trainer"
        return args
    assert script == "train.py", f"{line.where}: launches {script}; the docs launch train.py or --module trainer"
    return ["train", *args]


def parse(line: Line, call: Trainer, stand_ins: Path | None = None):
    """The real parser of the command, as `python -m trainer` builds it; a refusal names the doc line. With
    `stand_ins` (a line not run here, parsed from that directory), an input path that is not there (the user's
    hostfile, a finished run) is made there, empty, of the kind its flag wants, so the parser checks everything
    else."""
    command = next((word for word in call.argv if word in COMMANDS), None)
    assert command, f"{line.where}: no trainer command in {' '.join(line.words)}"
    parser, _ = build_parser(only=command)
    if stand_ins is not None:
        for action in subcommands(parser)[command]._actions:
            if isinstance(action.type, PathKind) and action.type.role == "input":
                action.type = standing_in(action.type, stand_ins)
    cut = call.argv.index("--") if "--" in call.argv else len(call.argv)
    try:
        return parser.parse_args(call.argv[:cut])
    except SystemExit as stop:
        if stop.code == 0 and {"-h", "--help"} & set(call.argv):  # `COMMAND --help`: argparse printed the help
            return argparse.Namespace(command=command)
        raise AssertionError(f"{line.where}: the {command} parser refuses: {' '.join(line.words)}") from None


def standing_in(kind: PathKind, root: Path):
    def check(text: str) -> str:
        path = Path(text).expanduser()
        path = path if path.is_absolute() else root / path
        if not path.exists() and root.resolve() in path.resolve().parents:  # never outside the scratch directory
            if kind.want == "directory":
                path.mkdir(parents=True)
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.touch()
        return kind(str(path))
    return check


# ---- the checks ------------------------------------------------------------------------------------------------

def test_the_docs_hold_commands():
    assert len(ALL) >= 40, [line.where for line in ALL]
    assert {line.page.name for line in ALL} >= {"README.md", "training.md", "multi-node.md", "plan-doctor-lint.md"}


@pytest.mark.parametrize("line", ALL, ids=[line.where for line in ALL])
def test_every_command_parses(line, tmp_path):
    call = trainer_call(line)
    args = parse(line, call, tmp_path if line.not_run else None)
    if args.command == "train" and not call.launcher and not line.not_run:
        pytest.fail(f"{line.where}: a training line; mark it `# not run here: ...`")
    if args.command == "train":
        resolve_train_line(line, args, call.world_size)


def resolve_train_line(line: Line, args, launched: int | None):
    """The preset and its --set items as a rank resolves them. A rehearsal resolves the preset as written (its
    shrinking needs the ranks)."""
    world = None if args.rehearse else (args.world_size or launched)
    try:
        resolve(load_preset(args.preset, args.overrides), world)
    except Exception as err:  # UserError, or a bug the docs just found: either way, name the line
        raise AssertionError(f"{line.where}: {' '.join(line.words)}\n  does not resolve at world size {world}: "
                             f"{err}") from None


def training_settings(line: Line, stand_ins: Path):
    """(run directory, what it trains) of a line that trains -- `train` or `launch` -- else None. What it trains is
    the config without the keys that say where or how this invocation runs (a resume, a shorter allocation)."""
    call = trainer_call(line)
    args = parse(line, call, stand_ins)
    if args.command not in ("train", "launch") or {"-h", "--help"} & set(call.argv):
        return None
    preset = getattr(args, "preset_name", None) or args.preset
    config = dataclasses.asdict(load_preset(preset, args.overrides))
    run_dir = Path(config["train"]["output_dir"])
    if args.rehearse and not any(item.startswith("train.output_dir=") for item in args.overrides):
        run_dir = run_dir.parent / f"rehearse_{config['name']}"  # train/rehearse.py's own directory
    for path in VOLATILE:
        if len(path) == 2:  # ("provenance",) is no config key
            config[path[0]].pop(path[1], None)
    return str(run_dir), config


def test_every_example_that_trains_writes_its_own_run_directory(tmp_path):
    """Issue 37: a second example with other settings in the first one's run directory would start fresh there
    (setting the first run aside): each example that trains names its own train.output_dir, and only a resume of
    the same settings (`--resume auto`) shares one."""
    first: dict[str, tuple[Line, dict]] = {}
    clashes = []
    for line in ALL:
        found = training_settings(line, tmp_path)
        if found is None:
            continue
        run_dir, settings = found
        earlier = first.setdefault(run_dir, (line, settings))
        if earlier[1] != settings:
            changed = sorted(f"{section}.{key}" for section in settings if isinstance(settings[section], dict)
                             for key in settings[section] if settings[section][key] != earlier[1][section].get(key))
            clashes.append(f"{line.where} trains other settings ({', '.join(changed) or 'the preset'}) into "
                           f"{run_dir}, the run directory of {earlier[0].where}: add --set train.output_dir=runs/NAME")
    assert not clashes, "\n".join(clashes)


RUNNABLE = [line for line in ALL if not line.not_run]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    """A directory that sees the repository's files through links: a doc command's relative inputs resolve, and
    what it writes (`-o ds_config.json`) lands here, not in the checkout."""
    root = tmp_path_factory.mktemp("docs_cwd")
    for entry in REPO.iterdir():
        if not entry.name.startswith("."):
            (root / entry.name).symlink_to(entry)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("line", RUNNABLE, ids=[line.where for line in RUNNABLE])
def test_every_unmarked_command_runs_here(line, scratch):
    call = trainer_call(line)
    assert not call.launcher and call.argv[:1] != ["train"], \
        f"{line.where}: launcher lines are not run here; mark it `# not run here: REASON`"
    env = {**os.environ, **line.env, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-m", "trainer", *call.argv], cwd=scratch, env=env, capture_output=True,
                            text=True, timeout=300)
    findings = call.argv[0] in ("lint", "doctor") and result.returncode == 1  # 1: the command found something
    assert result.returncode == 0 or findings, (
        f"{line.where}: `{' '.join(line.words)}` exited {result.returncode} here (if it cannot run on a CPU "
        f"machine, mark it `# not run here: REASON`):\n{result.stderr[-2000:]}")


def test_markers_say_why():
    vague = [line.where for line in ALL if line.not_run and len(line.not_run.split()) < 2]
    assert not vague, f"`# not run here:` needs a reason a reader can act on: {vague}"


def script_lines():
    """(where, script, words) of every `python scripts/NAME.py ...` line in a shell block."""
    for page in LINKED:
        for _, block in shell_blocks(page):
            for number, text in logical_lines(block):
                if text.strip().startswith("#"):
                    continue
                where = f"{page.relative_to(REPO)}:{number}"
                for words in split_chain(split_words(text, where)):
                    words = drop_prefixes(words)
                    if words[:1] in (["python"], ["python3"]) and words[1:2] and words[1].startswith("scripts/"):
                        yield where, words[1], words[2:]


SCRIPTS = list(script_lines())


@pytest.mark.parametrize("where,script,words", SCRIPTS, ids=[s[0] for s in SCRIPTS])
def test_every_script_line_names_a_script_and_flags_it_has(where, script, words):
    """Benchmark and check scripts: the script exists and its --help lists every flag the line gives."""
    assert (REPO / script).is_file(), f"{where}: no {script}"
    usage = script_help(script)
    unknown = [w.split("=")[0] for w in words if w.startswith("--") and w.split("=")[0] not in usage]
    assert not unknown, f"{where}: {script} has no {unknown}"


_HELP: dict[str, str] = {}


def script_help(script: str) -> str:
    if script not in _HELP:
        result = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True, text=True,
                                timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert result.returncode == 0, f"{script} --help: {result.stderr[-1000:]}"
        _HELP[script] = result.stdout
    return _HELP[script]


# ---- --help is the first doc -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_help_has_purpose_example_and_page(name):
    parser, _ = build_parser(only=name)
    text = subcommands(parser)[name].format_help()
    command = COMMANDS[name]
    assert command.purpose.rstrip(".").lower() in text.lower() and "\n" not in command.purpose
    assert f"example:\n  {command.example}\n" in text
    page = re.search(r"read: (docs/[\w.-]+\.md)(#[\w-]+)?", text)
    assert page, text[-500:]
    assert (REPO / page.group(1)).is_file(), f"{name} --help names {page.group(1)}, which does not exist"
    if page.group(2):
        assert page.group(2)[1:] in anchors(REPO / page.group(1)), f"{name} --help: no {page.group(0)}"


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_help_example_parses(name):
    words = drop_prefixes(shlex.split(COMMANDS[name].example))
    line = Line(REPO / "trainer" / "commands.py", 1, words, "an example in --help")
    call = trainer_call(line)
    args = parse(line, call)
    assert args.command == name
    if name == "train":
        resolve_train_line(line, args, call.world_size)


def test_trainer_alone_lists_every_command_on_one_line():
    result = subprocess.run([sys.executable, "-m", "trainer"], cwd=REPO, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line.startswith("  ")}
    assert list(rows) == list(COMMANDS)
    assert all(COMMANDS[name].purpose in row for name, row in rows.items())


# ---- links, size, numbers ----------------------------------------------------------------------------------------

def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    found = set()
    in_code = False
    for text in page.read_text().splitlines():
        if text.lstrip().startswith("```"):
            in_code = not in_code
        heading = re.match(r"#{1,6} (.*)", text)
        if heading and not in_code:
            found.add(re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-"))
    return found


def links(page: Path):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if not re.match(r"[a-z]+:", target):
            yield target


@pytest.mark.parametrize("page", LINKED, ids=[str(p.relative_to(REPO)) for p in LINKED])
def test_every_link_points_at_a_file_and_anchor_that_exist(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: {broken}"


def test_the_readme_links_every_docs_page():
    readme = (REPO / "README.md").read_text()
    missing = [p.name for p in PAGES[1:] if f"docs/{p.name}" not in readme]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_the_readme_is_short():
    size = (REPO / "README.md").stat().st_size
    assert size <= README_LIMIT_BYTES, f"README.md is {size} bytes; move detail into docs/ (limit {README_LIMIT_BYTES})"


def test_ci_runs_the_readme_test_command():
    readme = (REPO / "README.md").read_text()
    command = re.search(r"Run the whole test suite:\s*```bash\n(.*?)\n```", readme, re.S).group(1).strip()
    ci = [x for x in (REPO / ".ci" / "run").read_text().splitlines() if x and not x.startswith(("#", "set ", "cd "))]
    assert ci == [command], f".ci/run runs {ci}, the README says {command!r}"


def test_the_readme_main_command_is_tiny_cpu_launch_line():
    """The README's first command trains what tiny_cpu's header says it is launched with (the line the planner and
    the doctor build: tests/test_presets.py)."""
    readme = (REPO / "README.md").read_text()
    train = next(line for line in ALL if line.page.name == "README.md" and line.words[0] == "deepspeed")
    header = (REPO / "presets" / "tiny_cpu.yaml").read_text()
    launch = re.search(r"^# Launch: (.*)$", header, re.M).group(1)
    assert " ".join(train.words) == launch, f"{train.where}: {' '.join(train.words)} vs tiny_cpu's {launch}"
    assert readme.index(" ".join(train.words)) < readme.index("Run the whole test suite")


@pytest.mark.parametrize("page", PAGES[1:], ids=[p.name for p in PAGES[1:]])
def test_every_page_starts_with_its_task_and_a_command(page):
    """A title, the task in one paragraph, then a shell block: the reader knows at once whether the page is theirs."""
    lines = page.read_text().splitlines()
    assert lines[0].startswith("# "), f"{page.name}: starts with a title"
    fence = next(i for i, x in enumerate(lines) if x.startswith("```"))
    task = [x for x in lines[1:fence] if x.strip()]
    assert task and not any(x.startswith(("#", "|", "-")) for x in task), f"{page.name}: the task, then a command"
    assert "" not in [x.strip() for x in lines[2:fence - 1]], f"{page.name}: the task is one paragraph"
    assert lines[fence][3:].strip() in SHELL, f"{page.name}: the first block is a command"


def tables(text: str):
    """(line number, the table's lines, the paragraph before it) of each markdown table."""
    lines = text.splitlines()
    number = 0
    while number < len(lines):
        if lines[number].startswith("|"):
            start = number
            while number < len(lines) and lines[number].startswith("|"):
                number += 1
            before = start - 1
            while before >= 0 and not lines[before].strip():
                before -= 1
            paragraph_start = before
            while paragraph_start > 0 and lines[paragraph_start - 1].strip():
                paragraph_start -= 1
            yield start + 1, lines[start:number], "\n".join(lines[paragraph_start:before + 1])
        number += 1


def test_every_benchmark_number_names_its_script_and_date():
    page = REPO / "docs" / "performance.md"
    unnamed = []
    for number, table, before in tables(page.read_text()):
        text = before + "\n".join(table)
        scripts = re.findall(r"scripts/(\w+\.py)", text)
        if not scripts or not re.search(r"20\d\d-\d\d-\d\d", text):
            unnamed.append(f"docs/performance.md:{number}")
        for script in scripts:
            assert (REPO / "scripts" / script).is_file(), f"docs/performance.md:{number}: no scripts/{script}"
    assert not unnamed, f"tables without the script that measured them and the date, in the table or just above: " \
                        f"{unnamed}"
    benchmarks = {p.name for p in (REPO / "scripts").glob("*.py")
                  if p.name.startswith(("bench", "measure_", "plan_long", "gpu_check.py", "sweep_"))}
    missing = [name for name in sorted(benchmarks) if f"scripts/{name}" not in page.read_text()]
    assert not missing, f"benchmark scripts docs/performance.md does not describe: {missing}"


# --- memory numbers the prose quotes from a command ------------------------------------------------------------
# "X of Y GB per GPU" in a page's prose is a number `plan` or `lint` prints: the paragraph names the command, in
# backticks before the number (`python -m trainer plan ARGS` or `plan ARGS`, `lint PRESET`), and the test runs it
# in-process and compares, so a planner change that moves the number fails here instead of leaving the page behind.
QUOTED_GB = re.compile(r"(\d+\.\d) of (\d+\.\d) GB per GPU")
QUOTED_COMMAND = re.compile(r"`(?:python -m trainer )?(plan|lint) ([^`]+)`")


def prose_paragraphs(page: Path) -> list[tuple[int, str]]:
    """(first line, text) of each paragraph outside code blocks, its lines joined with spaces."""
    out, lines, start, fenced = [], [], 0, False
    for number, line in enumerate(page.read_text().splitlines() + [""], 1):
        if line.startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        if line.strip():
            start = start or number
            lines.append(line.strip())
        elif lines:
            out.append((start, " ".join(lines)))
            lines, start = [], 0
    return out


QUOTES = [(page, number, text[:match.start()], match.groups()) for page in PAGES
          for number, text in prose_paragraphs(page) for match in QUOTED_GB.finditer(text)]


def test_pages_quote_memory_numbers():
    assert len(QUOTES) >= 2  # the mechanism below has something to check


@pytest.mark.parametrize("page, number, before, quoted", QUOTES,
                         ids=[f"{q[0].name}:{q[1]}:{q[3][0]}" for q in QUOTES])
def test_every_memory_number_a_page_quotes_is_what_its_command_prints(page, number, before, quoted, capsys):
    commands = QUOTED_COMMAND.findall(before)
    assert commands, (f"{page.name}:{number}: '{quoted[0]} of {quoted[1]} GB per GPU' names no `plan ...` or "
                      f"`lint PRESET` command before it in its paragraph")
    command, args = commands[-1]
    words = [w for w in shlex.split(args) if w != "--json"]
    if command == "plan":
        assert main(["plan", *words, "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        printed = (gb(plan["choice"]["gpu_bytes"]["total"]), gb(plan["gpu_budget_bytes"]))
    else:
        assert main(["lint", *words]) == 0
        found = re.search(r"planner: ([\d.]+) GB per GPU of ([\d.]+) usable", capsys.readouterr().out)
        printed = found.groups()
    assert printed == quoted, f"{page.name}:{number}: `{command} {args}` prints {printed[0]} of {printed[1]} GB"
