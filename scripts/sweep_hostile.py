"""A hostile sweep of the command line (issue 23, third round): inputs a careless script or an attacker would give,
across every subcommand, each judged good / weak / bad, printed as a table.

    python scripts/sweep_hostile.py [--only WORD] [--json FILE] [--show weak,bad]

- good: refused with exit 2 and a message naming what was wrong (the `says` fragment), or accepted and handled;
- weak: no traceback and nothing harmed, but the message does not name the thing (or a valid input was refused,
  or something questionable was accepted with a warning only);
- bad: a traceback, an exception escaping `main`, a hang, an exit code outside {0, 1, 2, 3, 130}, a refused
  command that changed a file, an injected command that ran, or hostile input accepted silently.

Most cases run in one worker process (tests/workers/fuzz_cli.py: `trainer.__main__.main` per case, stderr and
the files it touched recorded); cases that need their own environment (HOME unset, a C locale, DS_ENV_FILE)
or two processes at once (two commands writing one output) run as subprocesses. Not part of the test suite
(minutes); its cheap findings are regressions in tests/test_cli_fuzz.py, test_paths.py, test_set_items.py.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
ALLOWED_CODES = {0, 1, 2, 3, 130}
MARKER = "PWNED"  # every injection payload touches S/PWNED*


@dataclass
class Case:
    group: str
    argv: list[str]                  # {S}: the sandbox
    expect: str = "refuse"           # refuse (exit 2) | ok (exit 0) | handled (0, 1 or 2)
    says: str = ""                   # a fragment a good refusal names (case-insensitive)
    env: Optional[dict] = None       # run in a subprocess with these changes (None value: unset)
    concurrent: int = 1              # run this many copies at once (subprocesses)
    note: str = ""
    result: dict = field(default_factory=dict)


def preset_cases() -> list[Case]:
    """Odd preset files given to show/lint/export/launch --dry-run/prepare-data --preset."""
    cases = []
    odd = {  # file name in the sandbox: what a good refusal names
        "bomb.yaml": "alias", "pyobj.yaml": "tag", "pyapply.yaml": "tag", "binary.yaml": "",
        "hugeint.yaml": "train.max_steps", "deep.yaml": "deep", "bom.yaml": None, "crlf.yaml": None,
        "tabs.yaml": "", "empty.yaml": "empty", "comment.yaml": "", "null.yaml": "mapping", "intkey.yaml": "",
        "date.yaml": "description", "nul.yaml": "", "utf16.yaml": "", "latin1.yaml": "utf-8",
        "nanlr.yaml": "train.lr", "boolsteps.yaml": "train.max_steps", "floatsteps.yaml": "train.max_steps",
        "template_etc.yaml": "deepspeed_template", "template_up.yaml": "deepspeed_template",
        "outdir_nl.yaml": "output_dir", "seqmap.yaml": "train", "big.yaml": "bytes",
        "dupkey.yaml": "duplicate key", "merge.yaml": "base",
    }
    for name, says in odd.items():
        expect = "ok" if says is None else "refuse"
        for command in (["show"], ["lint"], ["export", "-o", "{S}/out/x.json"]):
            if command[0] != "show" and name not in ("pyobj.yaml", "bomb.yaml", "hugeint.yaml", "bom.yaml",
                                                    "template_etc.yaml", "latin1.yaml", "dupkey.yaml"):
                continue
            cases.append(Case("preset", [command[0], f"{{S}}/presets/{name}", *command[1:]], expect, says or ""))
    for name in ("pyobj.yaml", "bomb.yaml", "hugeint.yaml", "crlf.yaml"):
        expect = "ok" if odd[name] is None else "refuse"
        cases.append(Case("preset", ["launch", f"{{S}}/presets/{name}", "--dry-run"], expect, odd[name] or ""))
        if expect == "refuse":  # a valid one would really prepare the data (minutes)
            cases.append(Case("preset", ["prepare-data", "--preset", f"{{S}}/presets/{name}"], "refuse", odd[name]))
    cases += [
        Case("preset", ["show", "{S}/presets"], says="directory"),
        Case("preset", ["show", "{S}/loop.yaml"], says="loop.yaml"),
        Case("preset", ["show", "{S}/fifo.yaml"], says="FIFO"),
        Case("preset", ["show", "../../../../etc/passwd"], says="passwd"),
        Case("preset", ["show", "tiny_cpu\n"], says="tiny_cpu"),
        Case("preset", ["show", "tiny_cpu.yaml"], "handled"),
        Case("preset", ["show", "TINY_CPU"], says="TINY_CPU"),
        Case("preset", ["show", ""], says="preset"),
        Case("preset", ["show", "{S}/presets/link_to_tiny.yaml"], "ok"),
        Case("preset", ["presets", "extra"], says="unrecognized"),
    ]
    return cases


def set_cases() -> list[Case]:
    items = {  # --set item: fragment of a good refusal (None: accepted)
        "=1": "", "train.lr": "=", ".lr=1": "", "train..lr=1": "", "train.lr==1": "train.lr",
        "train.lr=[1": "train.lr", "train.lr=!!python/object/apply:os.system [touch {S}/PWNED_SET]": "train.lr",
        "train.lr=.nan": "train.lr", "train.lr=&a 1": None, "train.lr=0x10": None, "train.lr=*a": "train.lr",
        "trаin.lr=1e-3": "trаin", "train.max_steps=1_000": None,
        "train.max_steps=9223372036854775808": "train.max_steps", "train.max_steps=3.5": "max_steps",
        "deepspeed.zero_optimization.stage=3.5": "stage", "train.output_dir=/dev/null": None,
        "train.output_dir=": "output_dir", "model={}": "model", "train.lr= ": "train.lr",
        "data.source=/etc/shadow_missing": None, "name=a/b": None, "name=$(touch {S}/PWNED_NAME)": None,
        "logging=null": "logging", "deepspeed=null": None, "train.lr=1e-3 # comment": None,
        "train.lr=1e-3\ntrain.max_steps=1": "train.lr", "hardware.gpus_per_node=0": "gpus_per_node",
        "hardware.nodes=-1": "nodes", "train.global_batch_size=3": "batch", "deepspeed.bf16={enabled: yes}": "bf16",
        "deepspeed.unknown_key=1": "unknown_key", "train.resume=/etc": None,
        "data.seq_len=100000000": "seq_len", "model.num_heads=3": "num_heads",
    }
    cases = []
    for item, says in items.items():
        cases.append(Case("set", ["show", "tiny_cpu", "--set", item], "ok" if says is None else "refuse", says or ""))
    cases.append(Case("set", ["show", "tiny_cpu", "--set", "train.lr=1", "--set", "train.lr=2"], says="both set"))
    cases.append(Case("set", ["show", "tiny_cpu", "--set", "train={lr: 1}"], says=":="))
    cases.append(Case("set", ["show", "tiny_cpu", "--set", "deepspeed.train_batch_size=7"], says="--set"))
    cases.append(Case("set", ["launch", "tiny_cpu", "--dry-run", "--set", "deepspeed.train_batch_size=7"],
                      says="--set deepspeed.train_batch_size=7"))
    return cases


def launch_cases() -> list[Case]:
    dry = ["launch", "tiny_cpu", "--dry-run"]
    hostfiles = {  # sandbox hostfile: fragment
        "hf_bom": "hf_bom line 1", "hf_crlf": None, "hf_ipv6": None, "hf_bracket": "hf_bracket:1",
        "hf_unicode": "hf_unicode:1", "hf_dash": "hf_dash:1", "hf_hugeslots": "slots", "hf_zero_pad": None,
        "hf_empty": "empty", "hf_comments": "no hosts", "hf_many": None, "hf_userat": "hf_userat:1",
        "hf_port": "hf_port:1", "hf_nul": "hf_nul", "hf_case": None, "hf_dir": "directory", "hf_one_remote": None,
    }
    cases = [Case("hostfile", [*dry, "--hostfile", f"{{S}}/{name}", "--set", "hardware.gpus_per_node=1"],
                  "ok" if says is None else "refuse", says or "") for name, says in hostfiles.items()]
    cases.append(Case("hostfile", [*dry, "--hostfile", "{S}/hf_one_remote", "--set", "hardware.gpus_per_node=1"],
                      "ok", "--force_multi", env={}, note="one host: kept, run there (--force_multi)"))
    flags = [  # (flags, fragment or None)
        (["--master-addr", ""], "master-addr"), (["--master-addr", "a b"], "master-addr"),
        (["--master-addr", "-oProxyCommand=touch {S}/PWNED_MA"], "master-addr"),
        (["--master-port", "0"], "master-port"), (["--master-port", "65536"], "master-port"),
        (["--master-port", "22"], None), (["--node-rank", "-1"], "node-rank"), (["--nnodes", "0"], "nnodes"),
        (["--nnodes", "2", "--node-rank", "2"], "node-rank"),
        (["--launcher", "torchrun", "--nnodes", "2"], "node-rank"),
        (["--launcher", "slurm", "--time", "x"], "time"), (["--launcher", "slurm", "--time", "1-00:00:00"], None),
        (["--launcher", "slurm", "--partition", "a\n#SBATCH --uid=0"], "partition"),
        (["--launcher", "slurm", "--account", "$(touch {S}/PWNED_ACC)"], "--account"),
        (["--launcher", "slurm", "--signal-grace-s", "1e9"], "signal-grace"),
        (["--launcher", "torchrun", "--rdzv-backend", "c10d", "--rdzv-id", "a b;touch {S}/PWNED_RDZV",
          "--nnodes", "2", "--master-addr", "h"], None),
        (["--fabric", ","], "fabric"), (["--fabric", "ib,ib"], None), (["--fabric", "/dev/null"], "character device"),
        (["--set", "train.output_dir=/dev/null"], "output_dir"),
        (["--fabric", "{S}/dir/"], "fabric"), (["--fabric", "{S}/dup.env"], "dup.env:3"),
        (["--fabric", "{S}/secret.env"], "secret"), (["--fabric", "{S}/inject.env"], "inject.env:1"),
        (["--failure-grace-s", "1e9"], "failure-grace"), (["--ssh-port", "22"], "ssh-port"),
        (["--set", "train.output_dir={S}/file.txt/run"], "output_dir"),
        (["--set", "train.output_dir={S}/file.txt"], "output_dir"),
        (["--", "--preset", "7b_8xa100"], "--preset"), (["--", "--set", "train.lr=1"], "--set train.lr=1"),
        (["--", "--world-size", "8"], "--world-size"), (["--", "--resume", "auto"], None),
        (["--", "--deepspeed_config", "{S}/file.txt"], "--deepspeed_config"), (["--", "--nope"], "--nope"),
        (["--", "--resume"], "--resume"), (["--", "--local_rank=3"], "--local_rank"),
        (["--", "--rehearse", "--rehearse"], None), (["--resume", "auto", "--", "--resume", "off"], "once"),
        (["--world-size", "3"], "world-size"), (["--launcher", "local", "--hostfile", "{S}/hf_crlf"], "hostfile"),
    ]
    cases += [Case("launch", [*dry, *f], "ok" if says is None else "refuse", says or "") for f, says in flags]
    return cases


def plan_cases() -> list[Case]:
    flags = [
        (["--model", "7b", "--gpu", "a100-80g", "-o", "{S}/out/p.png", "--chart", "{S}/out/p.png"], "same file"),
        (["--model", "7b", "--gpu", "a100-80g", "-o", "{S}/out/p.json", "--chart", "{S}/out/link_p.json"], None),
        (["--model", "7b", "--gpu", "a100-80g", "--chart", "{S}/out/c.PNG"], None),
        (["--model", "7b", "--gpu", "a100-80g", "-o", "/dev/stdout"], None),
        (["--model", "7b", "--gpu", "z80"], "z80"), (["--model", "", "--gpu", "a100-80g"], "model"),
        (["--model", "1e400", "--gpu", "a100-80g"], "1e400"), (["--model", "7b", "--gpu", "a100-80g",
                                                               "--nvme-gb", "1e30"], "nvme-gb"),
        (["{S}/scenario_pyobj.yaml"], "tag"), (["{S}/scenario_list.yaml"], "mapping"),
        (["{S}/scenario_inf.yaml"], "hidden_size"), (["{S}/scenario_nan.yaml"], "cpu_ram_gb"),
        (["--model", "{S}/dir", "--gpu", "a100-80g"], "config.json"),
        (["--model", "{S}/hfbad", "--gpu", "a100-80g"], "config.json"),
        (["--model", "7b", "--gpu", "a100-80g", "--gpus-per-node", "100000"], "gpus-per-node"),
        (["--model", "7b", "--gpu", "a100-80g", "--inference", "--tp", "3"], None),
    ]
    return [Case("plan", ["plan", *f], "handled" if says is None else "refuse", says or "") for f, says in flags]


def doctor_cases() -> list[Case]:
    logs = {"log_empty": "empty", "log_binary": "binary", "log_nul": None, "log_ansi": None, "log_longline": None,
            "log_utf16": None, "log_gz": None, "dir": "directory", "fifo.yaml": "FIFO", "loop.yaml": "loop.yaml",
            "log_latin1": None, "log_crlf_oom": None}
    cases = [Case("doctor", ["doctor", "tiny_cpu", f"{{S}}/{name}"], "handled" if says is None else "refuse",
                  says or "") for name, says in logs.items()]
    cases.append(Case("doctor", ["doctor", "tiny_cpu", "{S}/log_ansi", "--run-dir", "{S}/file.txt"], says="run"))
    cases.append(Case("lint", ["lint", "tiny_cpu", "--world-size", "0"], says="world-size"))
    cases.append(Case("lint", ["lint", "tiny_cpu", "--json", "--world-size", "99999999999"], says="world-size"))
    return cases


def report_cases() -> list[Case]:
    runs = {"run_nan": None, "run_huge": None, "run_notobj": "metrics.jsonl", "run_empty": "", "run_dupsteps": None,
            "run_binary": "metrics.jsonl", "run_loop": "", "run_nometrics": "metrics.jsonl"}
    cases = [Case("report", ["report", f"{{S}}/{name}", "-o", f"{{S}}/out/{name}.html"],
                  "handled" if says is None else "refuse", says or "") for name, says in runs.items()]
    cases += [
        Case("report", ["report", "{S}/run_nan", "-o", "{S}/out/<script>alert(1)</script>.html"], "handled"),
        Case("report", ["report", "{S}/run_nan", "-o", "{S}/run_nan/metrics.jsonl"], says=".png"),
        Case("report", ["report", "{S}/run_nan", "-o", "{S}/out/r.svg"], says=".png"),
        Case("report", ["report", "{S}/run_nan", "{S}/run_nan", "-o", "{S}/out/twice.png"], "handled"),
    ]
    return cases


def data_cases() -> list[Case]:
    pd = ["prepare-data", "--tokenizer", str(REPO / "data" / "tiny" / "tokenizer"), "--num-proc", "1"]
    sources = {"data_bom.jsonl": None, "data_empty.jsonl": "empty", "data_ws.jsonl": "", "data_arrays.jsonl": "line 1",
               "data_textnull.jsonl": "31", "data_textnum.jsonl": "31", "data_crlf.jsonl": None,
               "data_nul.jsonl": "", "latin1.jsonl": "byte", "data_trunc.jsonl": "line 2", "dir": "",
               "data.csv": "", "data_dupkey.jsonl": "text"}
    cases = [Case("data", [*pd, "--source", f"{{S}}/{name}", "--out", f"{{S}}/out/pd_{name}"],
                  "handled" if says is None else "refuse", says or "") for name, says in sources.items()]
    cases += [
        Case("data", ["prepare-data", "--source", "{S}/data_bom.jsonl", "--tokenizer", "{S}/dir", "--out",
                      "{S}/out/pd_tok"], says="tokenizer"),
        Case("data", [*pd, "--source", "{S}/data_bom.jsonl", "--seq-len", "1", "--out", "{S}/out/pd_seq1"],
             says="seq-len"),
        Case("data", [*pd, "--source", "{S}/data_bom.jsonl", "--out", "{S}/file.txt"], says="out"),
        Case("data", [*pd, "--source", "{S}/data_bom.jsonl", "--out", "/dev/full"], says="out"),
        Case("data", [*pd, "--source", "{S}/data_bom.jsonl", "--records-per-shard", "0", "--out", "{S}/out/pd_rps"],
             says="records-per-shard"),
        Case("data", [*pd, "--source", "{S}/data_bom.jsonl", "--task", "sft", "--out", "{S}/out/pd_sft"], says="sft"),
        Case("data", [*pd, "--source", "{S}/data_bom.jsonl", "--out", "{S}/data_bom.jsonl"], says="regular file"),
    ]
    return cases


def infer_cases() -> list[Case]:
    gen, ev = ["generate"], ["evaluate"]
    return [Case("infer", argv, "refuse", says) for argv, says in [
        ([*gen, "--model", "{S}/missing", "--prompt", "x"], "missing"),
        ([*gen, "--model", "{S}/dir", "--prompt", "x"], "config"),
        ([*gen, "--model", "{S}/hfbad", "--prompt", "x"], "config.json"),
        ([*gen, "--model", "{S}/hflist", "--prompt", "x"], "config.json"),
        ([*gen, "--model", "{S}/rundir_list", "--prompt", "x"], "rundir_list"),
        ([*gen, "--model", "{S}/dir", "--prompts", "{S}/data_empty.jsonl"], ""),
        ([*gen, "--model", "{S}/dir", "--prompt", "x", "--top-p", "1.5"], "top-p"),
        ([*gen, "--model", "{S}/dir", "--prompt", "x", "--num-beams", "0"], "num-beams"),
        ([*gen, "--model", "{S}/dir", "--prompt", "x", "--max-new-tokens", "1e30"], "max-new-tokens"),
        ([*gen, "--model", "{S}/dir", "--prompt", "x", "--max-new-tokens", "1e9"], "max-new-tokens"),
        ([*gen, "--model", "{S}/dir", "--prompt", "x", "-o", "{S}/dir"], "directory"),
        ([*ev, "--model", "{S}/dir", "--data", "{S}/latin1.jsonl"], ""),
        ([*ev, "--model", "{S}/dir", "--eval-sequences", "0"], "eval-sequences"),
        ([*ev, "--model", "{S}/dir", "--batch-size", "-3"], "batch-size"),
    ]]


def misc_cases() -> list[Case]:
    return [
        Case("preflight", ["preflight", "--sizes", ""], says="sizes"),
        Case("preflight", ["preflight", "--sizes", "1K,,2K"], says="sizes"),
        Case("preflight", ["preflight", "--sizes", "-1K"], says="sizes"),
        Case("preflight", ["preflight", "--json", "{S}/dir"], says="directory"),
        Case("preflight", ["preflight", "--iters", "0"], says="iters"),
        Case("autotune", ["autotune", "tiny_cpu", "--dry-run", "--dir", "{S}/file.txt/x"], says="dir"),
        Case("autotune", ["autotune", "7b_8xa100", "--dry-run", "--dir", "{S}/out/at"], "handled",
             note="dry run on a machine without CUDA: a note, exit 0"),
        Case("autotune", ["autotune", "tiny_cpu", "--from-results", "{S}/dir", "-o", "{S}/out/at.yaml"],
             says="ds_config_optimal.json"),
        Case("autotune", ["autotune", "7b_8xa100", "--profile-steps", "5", "3", "--dry-run", "--dir", "{S}/out/at2"],
             says="profile-steps"),
        Case("autotune", ["autotune", "tiny_cpu", "-o", "{S}/out/at.txt", "--dry-run"], says=".yaml"),
        Case("train", ["train", "--preset", "{S}/presets/pyobj.yaml"], says="tag"),
        Case("train", ["train", "--preset", "tiny_cpu", "--world-size", "-2"], says="world-size"),
        Case("train", ["train", "--preset", "tiny_cpu", "--set", "train.lr=1", "--set", "train.lr=1"], says="both set"),
        Case("cli", ["--local_rank=abc", "show", "tiny_cpu"], says="local_rank"),
        Case("cli", ["nosuchcommand"], says="invalid choice"),
        Case("cli", ["show", "tiny_cpu", "--", "x"], says="--"),
        Case("cli", ["show", "--set"], says="--set"),
    ]


def env_cases() -> list[Case]:
    no_home = {"HOME": None}
    return [
        Case("env", ["show", "tiny_cpu"], "ok", env=no_home),
        Case("env", ["launch", "tiny_cpu", "--dry-run", "--hostfile", "{S}/hf_one_remote", "--set",
                     "hardware.gpus_per_node=1"], "ok", env=no_home),
        Case("env", ["show", "tiny_cpu"], "ok", env={"HOME": "/nonexistent"}),
        Case("env", ["show", "{S}/presets/ünï.yaml"], "ok", env={"LANG": "C", "LC_ALL": "C"}),
        Case("env", ["show", "tiny_cpu", "--set", "description=é✓"], "ok", env={"PYTHONIOENCODING": "ascii"}),
        Case("env", ["export", "tiny_cpu", "-o", "{S}/out/t.json"], "ok", env={"TMPDIR": "{S}/missing"}),
        Case("env", ["launch", "tiny_cpu", "--dry-run", "--hostfile", "{S}/hf_one_remote", "--set",
                     "hardware.gpus_per_node=1"], "refuse", "deepspeed_env:2", env={"HOME": "{S}/home_dup"}),
        Case("env", ["launch", "tiny_cpu", "--dry-run", "--hostfile", "{S}/hf_one_remote", "--set",
                     "hardware.gpus_per_node=1"], "handled", env={"DS_ENV_FILE": "/dev/null"}),
        Case("env", ["show", "tiny_cpu"], "ok", env={"WORLD_SIZE": "abc", "RANK": "-1"}),
        Case("env", ["lint", "tiny_cpu"], "ok", env={"COLUMNS": "0"}),
        Case("env", ["show", "--help"], "ok", env={"COLUMNS": "-5"}),
        Case("env", ["show", "tiny_cpu", "--set", "deepspeed.wandb.api_key=env:NOPE_UNSET"], "refuse", "NOPE_UNSET",
             env={"NOPE_UNSET": None}),
        Case("concurrent", ["export", "tiny_cpu", "-o", "{S}/out/same.json"], "ok", concurrent=3),
        Case("concurrent", ["prepare-data", "--source", "{S}/data_crlf.jsonl", "--tokenizer",
                            str(REPO / "data" / "tiny" / "tokenizer"), "--num-proc", "1", "--out", "{S}/out/pd_same"],
             "handled", concurrent=2),
        Case("concurrent", ["plan", "--model", "7b", "--gpu", "a100-80g", "-o", "{S}/out/same_plan.json"], "handled",
             concurrent=2),
    ]


# --- the four newest features (sequence parallelism, MoE/AutoEP, DPO, the 128k preset): round four ---------------

MOE = ["--set", "model.family=mixtral", "--set", "model.num_experts=4", "--set", "model.num_experts_per_tok=2"]
SHOW_SP = ["show", "tiny_cpu", "--set"]


def sequence_parallel_cases() -> list[Case]:
    """deepspeed.sequence_parallel_size, model.tiled_mlp / tiled_logits, sequence_parallel.*, plan's flags."""
    items = {  # --set item on tiny_cpu (2 ranks, 4 heads, 2 kv heads): fragment of a good refusal (None: accepted)
        "deepspeed.sequence_parallel_size=0": "sequence_parallel_size",
        "deepspeed.sequence_parallel_size=-1": "sequence_parallel_size",
        "deepspeed.sequence_parallel_size=3": "sequence_parallel_size",
        "deepspeed.sequence_parallel_size=1e9": "sequence_parallel_size",
        "deepspeed.sequence_parallel_size=two": "sequence_parallel_size",
        "deepspeed.sequence_parallel_size=true": "sequence_parallel_size",
        "deepspeed.sequence_parallel_size=2.0": "sequence_parallel_size",
        "deepspeed.sequence_parallel_size=.nan": "sequence_parallel_size",
        "deepspeed.sequence_parallel_size=[2]": "sequence_parallel_size",
        "deepspeed.sequence_parallel_size=null": None,  # null removes a DeepSpeed key: its default, 1
        "deepspeed.sequence_parallel_size=2": None,
        "deepspeed.sequence_parallel_size=auto": "sequence_parallel_size",
        "model.tiled_mlp=-1": "tiled_mlp", "model.tiled_mlp=1e12": "tiled_mlp", "model.tiled_mlp=yes": "tiled_mlp",
        "model.tiled_mlp=2.5": "tiled_mlp", "model.tiled_mlp=four": "tiled_mlp", "model.tiled_mlp=null": "tiled_mlp",
        "model.tiled_logits=-3": "tiled_logits", "model.tiled_logits=1e12": "tiled_logits",
        "model.tiled_logits=true": "tiled_logits", "model.tiled_logits=.inf": "tiled_logits",
        "model.tiled_logits=autoo": "tiled_logits", "model.tiled_logits=auto": "or null",
        "sequence_parallel.nope=1": "nope", "sequence_parallel=5": "sequence_parallel",
        "sequence_parallel.gradient_scale=maybe": "gradient_scale",
    }
    cases = [Case("seqpar", [*SHOW_SP, item], "ok" if says is None else "refuse", says or "")
             for item, says in items.items()]
    combos = [  # several --set items together
        (["deepspeed.sequence_parallel_size=2", "model.num_heads=3", "model.num_kv_heads=3", "model.hidden_size=192"],
         "num_heads"),
        (["deepspeed.sequence_parallel_size=2", "data.seq_len=255"], "seq_len"),
        (["deepspeed.sequence_parallel_size=2", "data.task=preference", "data.source=data/tiny/preference.jsonl"],
         None),
        (["deepspeed.sequence_parallel_size=2", "model.tiled_logits=4", "model.tie_word_embeddings=true"], None),
        (["model.tiled_logits=4", "model.tie_word_embeddings=true"], None),
        (["deepspeed.sequence_parallel_size=2", "model.attn_implementation=eager"], "attn_implementation"),
        (["deepspeed.sequence_parallel_size=2", "train.micro_batch_size=1", "train.global_batch_size=1"], None),
        (["deepspeed.sequence_parallel_size=2", "deepspeed.tensor_parallel={autotp_size: 2}"], "autotp_size"),
    ]
    for items_, says in combos:
        argv = ["show", "tiny_cpu"] + [x for item in items_ for x in ("--set", item)]
        cases.append(Case("seqpar", argv, "handled" if says is None else "refuse", says or ""))
    cases.append(Case("seqpar", ["launch", "tiny_cpu", "--dry-run", "--set", "deepspeed.sequence_parallel_size=4"],
                      says="sequence_parallel_size"))
    cases.append(Case("seqpar", ["lint", "tiny_cpu", "--set", "deepspeed.sequence_parallel_size=2",
                                 "--world-size", "3"],
                      says="sequence_parallel_size"))
    plan = ["plan", "--model", "8b", "--gpu", "h100-80g", "--gpus-per-node", "8"]
    flags = {  # plan flags: fragment
        ("--sequence-parallel", "0"): "sequence-parallel", ("--sequence-parallel", "-2"): "sequence-parallel",
        ("--sequence-parallel", "3"): "sequence-parallel", ("--sequence-parallel", "16"): "sequence-parallel",
        ("--sequence-parallel", "1e9"): "sequence-parallel", ("--sequence-parallel", "two"): "sequence-parallel",
        ("--sequence-parallel", "5", "--seq-len", "131072"): "sequence-parallel",
        ("--seq-len", "0"): "seq-len", ("--seq-len", "1"): None, ("--seq-len", "1e12"): "seq-len",
        ("--seq-len", "-4096"): "seq-len", ("--seq-len", "nan"): "seq-len", ("--seq-len", "4096.5"): "seq-len",
        ("--seq-len", "99999999999999999999999"): "seq-len",
        ("--seq-len", "131072", "--sequence-parallel", "8", "--inference"): None,
    }
    cases += [Case("seqpar", [*plan, *f], "handled" if says is None else "refuse", says or "")
              for f, says in flags.items()]
    return cases


def moe_cases() -> list[Case]:
    """deepspeed.expert_parallel, MoE model keys, LoRA on experts, plan --expert-parallel / --model config.json."""
    ep = "deepspeed.expert_parallel="
    items = {
        ep + "{enabled: true, autoep_size: 3}": "autoep_size",
        ep + "{enabled: true, autoep_size: 0}": "autoep_size",
        ep + "{enabled: true, autoep_size: -2}": "autoep_size",
        ep + "{enabled: true, autoep_size: 8}": "autoep_size",
        ep + "{enabled: true, autoep_size: two}": "autoep_size",
        ep + "{enabled: true, autoep_size: 2.0}": "autoep_size",
        ep + "{enabled: true, autoep_size: true}": "autoep_size",
        ep + "{enabled: yes please, autoep_size: 2}": "enabled",
        ep + "{enabled: true, autoep_sise: 2}": "autoep_sise",
        ep + "{enabled: true, autoep_size: 2, use_grouped_mm: 'no'}": "use_grouped_mm",
        ep + "{enabled: true, autoep_size: 2, comm_num_sm: '12'}": "comm_num_sm",
        ep + "{autoep_size: 2}": "enabled",
        ep + "[2]": "expert_parallel", ep + "2": "expert_parallel",
        ep + "{enabled: true, autoep_size: 2}": None,
        "model.num_experts=0": "num_experts", "model.num_experts=-4": "num_experts",
        "model.num_experts=1e9": None,  # weak: accepted; lint has no memory check on CPU ranks (any model size)
        "model.num_experts_per_tok=0": "num_experts_per_tok",
        "model.num_experts_per_tok=5": "num_experts_per_tok", "model.router_aux_loss_coef=-1": "router_aux_loss_coef",
        "model.router_aux_loss_coef=.nan": "router_aux_loss_coef",
        "model.router_aux_loss_coef=.inf": "router_aux_loss_coef",
        "model.router_aux_loss_coef=lots": "router_aux_loss_coef",
        "model.output_router_logits=maybe": "output_router_logits",
        "model.zero3_leaf_modules=NoSuchBlock": "zero3_leaf_modules",
        "model.zero3_leaf_modules=[NoSuchBlock]": "NoSuchBlock",
        "model.zero3_leaf_modules=[1, 2]": "zero3_leaf_modules",
        "model.lora.target_parameters=experts.gate_up_proj": "target_parameters",
        "model.lora.target_parameters=[1]": "target_parameters",
        "model.tiled_mlp=4": "tiled_mlp",  # an MoE's fused experts: nothing would be tiled
    }
    def base(item: str) -> list[str]:  # MOE without the key the item sets (a key given twice is its own error)
        key = item.split("=")[0]
        return [x for i in range(0, len(MOE), 2) if not MOE[i + 1].startswith(key + "=") for x in MOE[i:i + 2]]

    cases = [Case("moe", ["show", "tiny_cpu", *base(item), "--set", item], "ok" if says is None else "refuse",
                  says or "") for item, says in items.items()]
    dense = {  # on the dense tiny_cpu
        ep + "{enabled: true, autoep_size: 2}": "expert",
        "model.router_aux_loss_coef=0.01": "router_aux_loss_coef",
        "model.zero3_leaf_modules=[MixtralSparseMoeBlock]": "zero3_leaf_modules",
        "model.lora.target_parameters=[experts.gate_up_proj]": None,  # LoRA off: its keys are kept, as target_modules
    }
    cases += [Case("moe", ["show", "tiny_cpu", "--set", item], "ok" if says is None else "refuse", says or "")
              for item, says in dense.items()]
    cases += [
        Case("moe", ["show", "tiny_cpu", "--set", "model.name_or_path={S}/moe_tiny", "--set", "model.lora.enabled=true",
                     "--set", "model.lora.target_parameters=[experts.nope_proj]", "--set", "model.lora.dropout=0"],
             "handled", note="weak: named at model build (moe.lora_target_problems), before any step, not at resolve"),
        Case("moe", ["show", "tiny_cpu", *MOE, "--set", ep + "{enabled: true, autoep_size: 2}", "--set",
                     "deepspeed.zero_optimization.stage=0"], "handled"),
        Case("moe", ["launch", "tiny_cpu", "--dry-run", *MOE, "--set", ep + "{enabled: true, autoep_size: 4}"],
             says="autoep_size"),
        Case("moe", ["lint", "mixtral_8x7b_8xa100", "--world-size", "6"], says="autoep_size"),
        Case("moe", ["show", "qwen3_30b_a3b_8xh100", "--set", ep + "{enabled: true, autoep_size: 5}"],
             says="autoep_size"),
        Case("moe", ["show", "mixtral_8x7b_8xa100", "--set", "model.num_experts=6"], says="num_experts"),
        Case("moe", ["show", "7b_8xa100", "--set", "model.num_experts=8"], says="num_experts"),
        Case("moe", ["show", "7b_8xa100", "--set", "model.router_aux_loss_coef=0.01"], says="router_aux_loss_coef"),
    ]
    plan = ["plan", "--gpu", "a100-80g", "--gpus-per-node", "8"]
    flags = {
        ("--model", "7b", "--expert-parallel", "8"): "expert-parallel",
        ("--model", "mixtral-8x7b", "--expert-parallel", "3"): "expert-parallel",
        ("--model", "mixtral-8x7b", "--expert-parallel", "0"): "expert-parallel",
        ("--model", "mixtral-8x7b", "--expert-parallel", "-8"): "expert-parallel",
        ("--model", "mixtral-8x7b", "--expert-parallel", "16"): "expert-parallel",
        ("--model", "mixtral-8x7b", "--expert-parallel", "1e9"): "expert-parallel",
        ("--model", "mixtral-8x7b", "--expert-parallel", "8"): None,
        ("--model", "mixtral-8x7", ): "mixtral-8x7",
        ("--model", "{S}/moe_dense/config.json", "--expert-parallel", "2"): "expert-parallel",
        ("--model", "{S}/moe_badjson/config.json"): "config.json",
        ("--model", "{S}/moe_list/config.json"): "config.json",
        ("--model", "{S}/dir/config.json"): "config.json",
        ("--model", "{S}/moe_dirjson/config.json"): "directory",
        ("--model", "{S}/fifo.yaml"): "FIFO",
        ("--model", "{S}/moe_zero_experts/config.json"): "experts",
        ("--model", "{S}/moe_strexperts/config.json"): "experts",
        ("--model", "{S}/moe_topk_gt/config.json"): "experts",
        ("--model", "{S}/moe_nohidden/config.json"): "hidden_size",
        ("--model", "{S}/moe_nan/config.json"): "NaN",
        ("--model", str(REPO / "presets/models/qwen3_30b_a3b/config.json"), "--expert-parallel", "7"):
            "expert-parallel",
        ("--model", str(REPO / "presets/models/qwen3_30b_a3b/config.json"), "--expert-parallel", "8"): None,
        ("--model", "mixtral-8x7b", "--task", "dpo-lora", "--expert-parallel", "8"): "--task dpo-lora",
        ("--model", "mixtral-8x7b", "--task", "lora", "--expert-parallel", "2"): "--task lora",
        ("--model", "mixtral-8x7b", "--sequence-parallel", "2", "--expert-parallel", "2"): "--sequence-parallel 2",
    }
    cases += [Case("moe", [*plan, *f], "handled" if says is None else "refuse", says or "")
              for f, says in flags.items()]
    return cases


def preference_cases() -> list[Case]:
    """data.task=preference, the preference section, preference JSONL records, evaluate/plan flags for DPO."""
    pref = ["show", "tiny_cpu", "--set", "data.task=preference", "--set", "data.source=data/tiny/preference.jsonl"]
    items = {
        "preference.beta=0": "beta", "preference.beta=-0.1": "beta", "preference.beta=.nan": "beta",
        "preference.beta=.inf": "beta", "preference.beta=high": "beta", "preference.beta=true": "beta",
        "preference.beta=[0.1]": "beta", "preference.beta=1e308": "beta",
        "preference.label_smoothing=-0.1": "label_smoothing", "preference.label_smoothing=0.5": "label_smoothing",
        "preference.label_smoothing=1": "label_smoothing", "preference.label_smoothing=.nan": "label_smoothing",
        "preference.label_smoothing=0.1": None,
        "preference.loss=hinge": "loss", "preference.loss=SIGMOID": "loss", "preference.loss=": "loss",
        "preference.loss=ipo": None,
        "preference.reference=engin": "reference", "preference.reference=Adapter": "reference",
        "preference.reference=/etc/passwd": "reference", "preference.reference=": "reference",
        "preference.reference=null": "reference", "preference.reference=adapter": "adapter",
        "preference.reference_offload=true": "reference_offload",
        "preference.reference_offload=maybe": "reference_offload",
        "preference.nope=1": "nope", "preference=1": "preference", "preference.betta=0.2": "betta",
    }
    cases = [Case("dpo", [*pref, "--set", item], "ok" if says is None else "refuse", says or "")
             for item, says in items.items()]
    cases += [
        Case("dpo", [*pref, "--set", "preference.reference=engine", "--set", "preference.reference_offload=true",
                     "--set", "deepspeed.zero_optimization.stage=3"], "ok"),
        Case("dpo", [*pref, "--set", "preference.loss=ipo", "--set", "preference.label_smoothing=0.1"],
             says="label_smoothing"),
        Case("dpo", [*pref, "--set", "preference.reference=adapter"], says="lora"),
        Case("dpo", ["show", "tiny_cpu", "--set", "preference.beta=0.5"], says="preference"),
        Case("dpo", ["show", "tiny_cpu", "--set", "data.task=dpo"], says="data.task"),
        Case("dpo", [*pref, "--set", "data.rejected_field=chosen"], says="data.chosen_field"),
        Case("dpo", [*pref, "--set", "data.prompt_field=rejected"], says="data.prompt_field"),
        Case("dpo", ["show", "7b_dpo_8xa100", "--set", "preference.reference=precomputd"], says="reference"),
        Case("dpo", ["show", "7b_dpo_lora_1x4090", "--set", "model.lora.enabled=false"], says="adapter"),
        Case("dpo", ["lint", "7b_dpo_8xa100", "--set", "preference.beta=-1"], says="beta"),
        Case("dpo", ["launch", "7b_dpo_8xa100", "--dry-run", "--set", "preference.label_smoothing=2"],
             says="label_smoothing"),
    ]
    pd = ["prepare-data", "--tokenizer", str(REPO / "data" / "tiny" / "tokenizer"), "--num-proc", "1", "--task",
          "preference", "--seq-len", "128"]
    sources = {  # sandbox file: fragment
        "pref_norejected.jsonl": "rejected", "pref_same.jsonl": "", "pref_numfield.jsonl": "chosen",
        "pref_nested.jsonl": "chosen", "pref_nullprompt.jsonl": "prompt", "pref_huge_prompt.jsonl": None,
        "pref_empty.jsonl": "empty", "pref_bom.jsonl": None, "pref_latin1.jsonl": "byte",
        "pref_dupkey.jsonl": "chosen", "pref_msgs_role.jsonl": "role", "pref_msgs_notlist.jsonl": None,
        "pref_msgs_nocontent.jsonl": "content", "pref_msgs_lastuser.jsonl": "", "pref_array.jsonl": "line 1",
        "pref_msgs_str.jsonl": "messages", "pref_msgs_empty.jsonl": None,
        "pref_emptystr.jsonl": None,  # an empty response is its EOS: one token, a valid pair
        "pref_trunc.jsonl": "line 2", "pref_pretrain.jsonl": "chosen",
        "pref_extra.jsonl": None,
    }
    cases += [Case("dpo", [*pd, "--source", f"{{S}}/{name}", "--out", f"{{S}}/out/pd_{name}"],
                   "handled" if says is None else "refuse", says or "") for name, says in sources.items()]
    ev, pairs = ["evaluate", "--model", "{S}/hfmodel"], str(REPO / "data" / "tiny" / "preference.jsonl")
    cases += [Case("dpo", argv, "refuse", says) for argv, says in [
        ([*ev, "--data", pairs, "--task", "preference", "--reference", "{S}/missing"], "--reference"),
        ([*ev, "--data", pairs, "--task", "preference", "--reference", "{S}/hfbad"], ""),
        ([*ev, "--data", pairs, "--task", "preference", "--reference", "{S}/file.txt"], "--reference {S}/file.txt"),
        ([*ev, "--data", pairs, "--task", "preference", "--reference", ""], "--reference"),
        ([*ev, "--data", pairs, "--task", "preference", "--reference", "{S}/dir"], "--reference"),
        ([*ev, "--data", str(REPO / "data" / "tiny" / "pretrain.jsonl"), "--reference", "{S}/dir"], "reference"),
        (["evaluate", "--model", "{S}/hfbad", "--data", "{S}/pref_norejected.jsonl", "--task", "preference"], ""),
        ([*ev, "--task", "preference"], "data"),
        ([*ev, "--reference", "{S}/dir"], "--data"),
    ]]
    plan = ["plan", "--model", "7b", "--gpu", "a100-80g", "--gpus-per-node", "8"]
    flags = {
        ("--task", "dpo", "--reference", "nonsense"): "reference", ("--task", "dpo", "--reference", ""): "reference",
        ("--task", "dpo", "--reference", "adapter"): "adapter",
        ("--task", "full", "--reference", "engine"): "reference",
        ("--task", "DPO"): None, ("--task", "dpo-lora", "--reference", "precomputed"): None,
        ("--task", "dpo_lora"): "task", ("--task", "ppo"): "task", ("--task", ""): "task",
        ("--task", "dpo", "--inference"): "inference",
        ("--task", "dpo", "--expert-parallel", "2"): "expert-parallel",
        ("--task", "dpo", "--sequence-parallel", "2"): "--sequence-parallel 2: the DPO loss",
        ("--task", "dpo", "--seq-len", "131072"): None,  # fits nowhere: sequence parallelism is not planned for DPO
    }
    cases += [Case("dpo", [*plan, *f], "handled" if says is None else "refuse", says or "")
              for f, says in flags.items()]
    return cases


def long_context_cases() -> list[Case]:
    """The 8b_128k_8xh100 preset and the bare command line: `python -m trainer`, every --help."""
    cases = [Case("cli128k", [], "handled"),
             Case("cli128k", ["--help"], "ok")]
    for command in ("show", "lint", "export", "launch", "plan", "doctor", "report", "prepare-data", "generate",
                    "evaluate", "preflight", "autotune", "presets", "train"):
        cases.append(Case("cli128k", [command, "--help"], "ok"))
    big = "8b_128k_8xh100"
    cases += [
        Case("cli128k", ["show", big], "ok"), Case("cli128k", ["lint", big], "handled"),
        Case("cli128k", ["launch", big, "--dry-run"], "ok"),
        Case("cli128k", ["show", big, "--set", "data.seq_len=131073"], says="seq_len"),
        Case("cli128k", ["show", big, "--set", "deepspeed.sequence_parallel_size=16"], says="sequence_parallel_size"),
        Case("cli128k", ["show", big, "--set", "deepspeed.sequence_parallel_size=3"], says="sequence_parallel_size"),
        Case("cli128k", ["show", big, "--set", "model.tiled_mlp=0", "--set", "model.tiled_logits=0"], "handled"),
        Case("cli128k", ["show", big, "--set", "model.max_position_embeddings=4096"], says="seq_len"),
        Case("cli128k", ["lint", big, "--world-size", "4"], "handled"),
        Case("cli128k", ["lint", big, "--world-size", "12"], says="sequence_parallel_size"),
        Case("cli128k", ["export", big, "-o", "{S}/out/128k.json", "--set", "deepspeed.sequence_parallel_size=0"],
             says="sequence_parallel_size"),
    ]
    return cases


def feature_sandbox(s: Path) -> None:
    """Files the four feature groups read: model configs for plan --model, preference JSONL records."""
    good_moe = {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 32000,
                "num_local_experts": 8, "num_experts_per_tok": 2}
    configs = {
        "moe_dense": {**{k: v for k, v in good_moe.items() if "expert" not in k}, "model_type": "llama"},
        "moe_zero_experts": {**good_moe, "num_local_experts": 0},
        "moe_strexperts": {**good_moe, "num_local_experts": "eight"},
        "moe_topk_gt": {**good_moe, "num_experts_per_tok": 9},
        "moe_nohidden": {k: v for k, v in good_moe.items() if k != "hidden_size"},
    }
    for name, config in configs.items():
        (s / name).mkdir()
        (s / name / "config.json").write_text(json.dumps(config))
    (s / "moe_nan").mkdir()
    (s / "moe_nan" / "config.json").write_text(json.dumps(good_moe).replace("4096", "NaN", 1))
    (s / "moe_badjson").mkdir()
    (s / "moe_badjson" / "config.json").write_text('{"model_type": "mixtral",')
    (s / "moe_list").mkdir()
    (s / "moe_list" / "config.json").write_text("[]")
    (s / "moe_dirjson" / "config.json").mkdir(parents=True)
    (s / "moe_tiny").mkdir()
    (s / "moe_tiny" / "config.json").write_text(json.dumps({**good_moe, "hidden_size": 64, "num_hidden_layers": 1,
                                                           "num_attention_heads": 4, "num_key_value_heads": 2,
                                                           "intermediate_size": 64, "vocab_size": 1024}))
    (s / "hfmodel").mkdir()  # a plain HF model's config and tokenizer: evaluate gets past --model to its other flags
    (s / "hfmodel" / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1024, "max_position_embeddings": 256}))
    for tokenizer_file in (REPO / "data" / "tiny" / "tokenizer").iterdir():
        shutil.copy(tokenizer_file, s / "hfmodel" / tokenizer_file.name)
    pair = {"prompt": "Q: hi\nA:", "chosen": " hello", "rejected": " bye"}
    user = [{"role": "user", "content": "q"}]
    chat = "".join(json.dumps({"messages": [{"role": "user", "content": f"hi {i}"}], "chosen": "hello",
                               "rejected": "bye"}) + "\n" for i in range(30))
    rows = "".join(json.dumps({**pair, "prompt": f"Q: {i}\nA:"}) + "\n" for i in range(30))
    texts = {
        "pref_norejected.jsonl": rows + json.dumps({"prompt": "x", "chosen": "y"}) + "\n",
        "pref_same.jsonl": "".join(json.dumps({"prompt": f"p{i}", "chosen": " a", "rejected": " a"}) + "\n"
                                   for i in range(30)),
        "pref_numfield.jsonl": rows + json.dumps({**pair, "chosen": 5}) + "\n",
        "pref_nested.jsonl": rows + json.dumps({**pair, "chosen": {"text": [1, {"x": None}]}}) + "\n",
        "pref_nullprompt.jsonl": rows + json.dumps({**pair, "prompt": None}) + "\n",
        "pref_huge_prompt.jsonl": rows + json.dumps({**pair, "prompt": "word " * 200000}) + "\n",
        "pref_empty.jsonl": "", "pref_bom.jsonl": "\ufeff" + rows,
        "pref_dupkey.jsonl": '{"prompt": "a", "chosen": " b", "chosen": " c", "rejected": " d"}\n' * 30,
        "pref_msgs_role.jsonl": chat + json.dumps({"messages": user, "chosen": [{"role": "wizard", "content": "x"}],
                                                   "rejected": [{"role": "assistant", "content": "y"}]}) + "\n",
        "pref_msgs_notlist.jsonl": chat + json.dumps({"messages": user, "chosen": {"role": "assistant", "content": "x"},
                                                      "rejected": [{"role": "assistant", "content": "y"}]}) + "\n",
        "pref_msgs_nocontent.jsonl": chat + json.dumps({"messages": user, "chosen": [{"role": "assistant"}],
                                                        "rejected": [{"role": "assistant", "content": "y"}]}) + "\n",
        "pref_msgs_lastuser.jsonl": chat + json.dumps({"messages": user, "chosen": [{"role": "user", "content": "x"}],
                                                       "rejected": [{"role": "user", "content": "y"}]}) + "\n",
        "pref_msgs_str.jsonl": chat + json.dumps({"messages": "hello", "chosen": "a", "rejected": "b"}) + "\n",
        "pref_msgs_empty.jsonl": chat + json.dumps({"messages": [], "chosen": "a", "rejected": "b"}) + "\n",
        "pref_array.jsonl": "[1, 2]\n", "pref_trunc.jsonl": rows.splitlines()[0] + '\n{"prompt": "cut',
        "pref_emptystr.jsonl": rows + json.dumps({**pair, "chosen": ""}) + "\n",
        "pref_pretrain.jsonl": "".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(30)),
        "pref_extra.jsonl": "".join(json.dumps({**pair, "score": i, "meta": {"a": [1]}}) + "\n" for i in range(30)),
    }
    for name, text in texts.items():
        (s / name).write_text(text, encoding="utf-8")
    (s / "pref_latin1.jsonl").write_bytes(rows.encode() + b'{"prompt": "caf\xe9", "chosen": "a", "rejected": "b"}\n')


def all_cases() -> list[Case]:
    return (preset_cases() + set_cases() + launch_cases() + plan_cases() + doctor_cases() + report_cases()
            + data_cases() + infer_cases() + misc_cases() + env_cases() + sequence_parallel_cases() + moe_cases()
            + preference_cases() + long_context_cases())


# --- the sandbox ----------------------------------------------------------------------------------------------

def build_sandbox(s: Path) -> None:
    tiny = (REPO / "presets" / "tiny_cpu.yaml").read_text()
    presets = s / "presets"
    presets.mkdir(parents=True)
    (s / "out").mkdir()
    (s / "dir").mkdir()
    (s / "file.txt").write_text("not a config\n")
    os.mkfifo(s / "fifo.yaml")
    os.symlink(s / "loop.yaml", s / "loop.yaml")
    texts = {
        "bomb.yaml": "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
            f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)},"
            f"*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)},*{chr(97 + i)}]\n" for i in range(8)),
        "pyobj.yaml": tiny + f"extra: !!python/object/apply:os.system ['touch {s}/PWNED_YAML']\n",
        "pyapply.yaml": "!!python/object/new:os.system ['true']\n",
        "binary.yaml": tiny.replace('description: "', 'description: !!binary "aGk=" #'),
        "hugeint.yaml": tiny.replace("max_steps: 200", "max_steps: " + "9" * 400),
        "deep.yaml": "a: " + "[" * 5000 + "]" * 5000 + "\n",
        "bom.yaml": "\ufeff" + tiny, "crlf.yaml": tiny.replace("\n", "\r\n"),
        "tabs.yaml": tiny.replace("  micro_batch_size", "\tmicro_batch_size"), "empty.yaml": "",
        "comment.yaml": "# nothing\n", "null.yaml": "null\n", "intkey.yaml": tiny + "1: x\n",
        "date.yaml": tiny.replace('description: "~3M Llama on 2 CPU ranks, ZeRO-2 fp32: the embedded default that '
                                  'proves the loop end to end"', "description: 2024-01-01"),
        "merge.yaml": tiny.replace("train:\n", "base: &base {lr: 0.003}\ntrain:\n  <<: *base\n")
                          .replace("  lr: 3.0e-3\n", ""),
        "nanlr.yaml": tiny.replace("lr: 3.0e-3", "lr: .nan"),
        "boolsteps.yaml": tiny.replace("max_steps: 200", "max_steps: yes"),
        "floatsteps.yaml": tiny.replace("max_steps: 200", "max_steps: 2.5"),
        "template_etc.yaml": tiny.replace("deepspeed_template: zero2.json", "deepspeed_template: /etc/passwd"),
        "template_up.yaml": tiny.replace("deepspeed_template: zero2.json", "deepspeed_template: ../../../etc/x.json"),
        "outdir_nl.yaml": tiny.replace("train:\n", 'train:\n  output_dir: "runs/a\\nb"\n', 1),
        "seqmap.yaml": tiny.replace("train:\n", "train:\n  - 1\n", 1).split("\n  micro_batch_size")[0] + "\n",
        "dupkey.yaml": tiny + "hardware: {gpu: cpu}\n",
        "ünï.yaml": tiny,
    }
    for name, text in texts.items():
        (presets / name).write_text(text, encoding="utf-8")
    (presets / "nul.yaml").write_bytes(tiny.encode() + b"\x00\n")
    (presets / "utf16.yaml").write_bytes(tiny.encode("utf-16"))
    (presets / "latin1.yaml").write_bytes(tiny.encode("utf-8").replace(b"~3M", b"caf\xe9"))
    (presets / "big.yaml").write_bytes(b"# " + b"x" * (5 << 20) + b"\n")
    os.symlink(REPO / "presets" / "tiny_cpu.yaml", presets / "link_to_tiny.yaml")
    hostfiles = {
        "hf_bom": "\ufefflocalhost slots=1\n", "hf_crlf": "localhost slots=1\r\n", "hf_ipv6": "::1 slots=1\n",
        "hf_bracket": "[::1] slots=1\n", "hf_unicode": "wörker slots=1\n", "hf_dash": "-oProxyCommand=x slots=1\n",
        "hf_hugeslots": "localhost slots=99999999999999999999\n", "hf_zero_pad": "localhost slots=01\n",
        "hf_empty": "", "hf_comments": "# a\n\n# b\n", "hf_many": "".join(f"n{i} slots=1\n" for i in range(2000)),
        "hf_userat": "root@localhost slots=1\n", "hf_port": "localhost:22 slots=1\n",
        "hf_nul": "localhost slots=1\x00\n", "hf_case": "Node1 slots=1\nnode1 slots=1\n",
        "hf_one_remote": "worker-7 slots=1\n",
    }
    for name, text in hostfiles.items():
        (s / name).write_text(text, encoding="utf-8")
    (s / "hf_dir").mkdir()
    (s / "dup.env").write_text("NCCL_A=1\n# why\nNCCL_A=2\n")
    (s / "secret.env").write_text("HF_TOKEN=abc\n")
    (s / "inject.env").write_text(f"NCCL_X=$(touch {s}/PWNED_ENV)\n")
    (s / "home_dup").mkdir()
    (s / "home_dup" / ".deepspeed_env").write_text("NCCL_B=1\nNCCL_B=2\n")
    (s / "scenario_pyobj.yaml").write_text("model: !!python/object/apply:os.system ['true']\n")
    (s / "scenario_list.yaml").write_text("- model: 7b\n")
    (s / "scenario_inf.yaml").write_text("model: 7000000000\nhidden_size: .inf\nnum_layers: 32\ngpu: a100-80g\n")
    (s / "scenario_nan.yaml").write_text("model: 7b\ngpu: a100-80g\ncpu_ram_gb: .nan\n")
    (s / "hfbad").mkdir()
    (s / "hfbad" / "config.json").write_text("{not json")
    (s / "hflist").mkdir()
    (s / "hflist" / "config.json").write_text("[1, 2]")
    (s / "rundir_list").mkdir()
    (s / "rundir_list" / "config.resolved.yaml").write_text("- 1\n- 2\n")
    os.symlink(s / "out" / "p.json", s / "out" / "link_p.json")
    logs = {"log_empty": b"", "log_binary": os.urandom(4096), "log_nul": b"RuntimeError: CUDA out of memory\x00\x00\n",
            "log_ansi": b"\x1b[31mRuntimeError: CUDA out of memory\x1b[0m\n", "log_longline": b"x" * (3 << 20),
            "log_utf16": "RuntimeError: CUDA out of memory\n".encode("utf-16"),
            "log_latin1": "Fehler: Speicher ersch\xf6pft\n".encode("latin-1"),
            "log_crlf_oom": b"torch.OutOfMemoryError: CUDA out of memory.\r\n"}
    for name, data in logs.items():
        (s / name).write_bytes(data)
    import gzip
    (s / "log_gz").write_bytes(gzip.compress(b"torch.OutOfMemoryError: CUDA out of memory.\n"))
    metrics = {
        "run_nan": '{"step": 1, "loss": NaN}\n{"step": 2, "loss": 1.0}\n',
        "run_huge": '{"step": 1, "loss": 1e308}\n{"step": 99999999999999999999, "loss": 1e-320}\n',
        "run_notobj": "[1, 2]\n\"x\"\n", "run_empty": "",
        "run_dupsteps": '{"step": 1, "loss": 2}\n{"step": 1, "loss": 3}\n',
    }
    for name, text in metrics.items():
        (s / name).mkdir()
        (s / name / "metrics.jsonl").write_text(text)
    (s / "run_binary").mkdir()
    (s / "run_binary" / "metrics.jsonl").write_bytes(os.urandom(2048))
    (s / "run_nometrics").mkdir()
    os.symlink(s / "run_loop", s / "run_loop")
    rows = [json.dumps({"text": f"row {i} hello"}) + "\n" for i in range(30)]
    data = {"data_bom.jsonl": "\ufeff" + "".join(rows), "data_empty.jsonl": "", "data_ws.jsonl": "  \n\n\t\n",
            "data_arrays.jsonl": "[1, 2]\n", "data_textnull.jsonl": "".join(rows) + '{"text": null}\n',
            "data_textnum.jsonl": "".join(rows) + '{"text": 5}\n',
            "data_crlf.jsonl": "\r\n".join(r.strip() for r in rows) + "\r\n",
            "data_nul.jsonl": '{"text": "a\x00b"}\n' * 30, "data_trunc.jsonl": rows[0] + '{"text": "cut',
            "data.csv": "text\nhello\n", "data_dupkey.jsonl": '{"text": "a", "text": "b"}\n' * 30}
    for name, text in data.items():
        (s / name).write_text(text, encoding="utf-8")
    (s / "latin1.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    feature_sandbox(s)


# --- running and judging --------------------------------------------------------------------------------------

def fill(value: str, sandbox: Path) -> str:
    return value.replace("{S}", str(sandbox))


def run_in_worker(cases: list[Case], sandbox: Path) -> None:
    spec, report = sandbox.parent / "cases.json", sandbox.parent / "report.json"
    spec.write_text(json.dumps([{"argv": [fill(a, sandbox) for a in c.argv]} for c in cases]))
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "workers" / "fuzz_cli.py"), str(spec), str(report),
                           str(sandbox)], cwd=REPO, env=base_env(sandbox), capture_output=True, text=True,
                          errors="replace")
    results = json.loads(report.read_text()) if report.exists() else []
    if len(results) != len(cases):
        sys.exit(f"the worker stopped after {len(results)} of {len(cases)} cases:\n{proc.stderr[-3000:]}")
    for case, result in zip(cases, results):
        case.result = result


def base_env(sandbox: Path) -> dict:
    env = {**os.environ, "WANDB_MODE": "disabled", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DS_ENV_FILE"):
        env.pop(key, None)
    return env


def run_alone(case: Case, sandbox: Path) -> None:
    """In subprocesses: its own environment, or several copies at once."""
    sys.path.insert(0, str(REPO / "tests" / "workers"))
    from fuzz_cli import tree
    env = base_env(sandbox)
    for key, value in (case.env or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = fill(value, sandbox)
    before = tree(sandbox)
    argv = [sys.executable, "-m", "trainer", *[fill(a, sandbox) for a in case.argv]]
    procs = [subprocess.Popen(argv, cwd=sandbox / "cwd", env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(case.concurrent)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        case.result = {"code": None, "hung": True, "escaped": None, "traceback": False, "stderr": "", "changed": []}
        return
    after = tree(sandbox)
    codes = [p.returncode for p in procs]
    stderr = "\n".join(err.decode("utf-8", "replace") for _, err in outs)
    stdout = "\n".join(out.decode("utf-8", "replace") for out, _ in outs)
    leftovers = [k for k in after if k not in before and Path(k).name.endswith(".tmp")]  # a writer's temporaries
    case.result = {"code": max(codes, key=lambda c: (c not in (0,), c)), "codes": codes, "hung": False, "escaped": None,
                   "traceback": "Traceback (most recent call last)" in stderr, "stderr": stderr[-1500:],
                   "stdout": stdout[-3000:],
                   "changed": sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k)),
                   "leftovers": leftovers}


def judge(case: Case, sandbox: Path) -> tuple[str, str]:
    r = case.result
    code, err = r.get("code"), r.get("stderr", "")
    injected = sorted(p.name for p in sandbox.glob(f"{MARKER}*"))
    if injected:
        return "bad", f"injected command ran: {injected}"
    if r.get("hung"):
        return "bad", "hung"
    if r.get("escaped") or r.get("traceback"):
        return "bad", f"traceback/escape: {(r.get('escaped') or err.strip().splitlines()[-1:])}"
    if code not in ALLOWED_CODES:
        return "bad", f"exit code {code}"
    if code in (2, 130) and case.concurrent == 1 and r.get("changed"):
        return "bad", f"refused but changed {r['changed'][:3]}"
    if r.get("leftovers"):
        return "bad", f"temporary files left: {r['leftovers'][:3]}"
    last = last_error(err)
    says = fill(case.says, sandbox).lower()
    if case.expect == "refuse":
        if code == 0:
            return "bad", "accepted silently"
        if code != 2:
            return "weak", f"exit {code}: {last}"
        return ("good", last) if says in err.lower() else ("weak", f"does not name {case.says!r}: {last}")
    if case.expect == "ok":
        if code != 0:
            return "weak", f"refused a valid input (exit {code}): {last}"
        if says and says not in (err.lower() + str(r.get("stdout", "")).lower()):
            return "weak", f"ok, but no {case.says!r}"
        return "good", "ok"
    return "good", f"exit {code}: {last}" if code else "ok"


def last_error(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line.strip() and "[WARNING]" not in line]
    errors = [line for line in lines if "error" in line.lower()]
    return ((errors or lines or [""])[0])[:160]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="only cases whose group or command line contains this")
    parser.add_argument("--json", help="write every case and its outcome here")
    parser.add_argument("--show", default="good,weak,bad", help="which outcomes to print (default all)")
    args = parser.parse_args()
    cases = [c for c in all_cases() if not args.only or args.only in c.group or args.only in " ".join(c.argv)]
    root = Path(tempfile.mkdtemp(prefix="sweep-hostile-"))
    sandbox = root / "s"
    try:
        build_sandbox(sandbox)
        (sandbox / "cwd").mkdir()
        alone = [c for c in cases if c.env is not None or c.concurrent > 1]
        run_in_worker([c for c in cases if c not in alone], sandbox)
        for case in alone:
            run_alone(case, sandbox)
        counts = {"good": 0, "weak": 0, "bad": 0}
        rows = []
        for number, case in enumerate(cases, 1):
            outcome, why = judge(case, sandbox)
            counts[outcome] += 1
            line = " ".join(case.argv).replace("\n", "\\n")[:90]
            env = f" [env {case.env}]" if case.env else f" [x{case.concurrent}]" if case.concurrent > 1 else ""
            rows.append({"n": number, "group": case.group, "argv": case.argv, "env": case.env, "outcome": outcome,
                         "why": why, "code": case.result.get("code")})
            if outcome in args.show.split(","):
                print(f"{number:3d} {outcome:4s} {case.group:10s} {line}{env}\n      -> {case.result.get('code')}: "
                      f"{why}")
        print(f"\n{len(cases)} cases: {counts['good']} good, {counts['weak']} weak, {counts['bad']} bad")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1, ensure_ascii=False))
        return 1 if counts["bad"] else 0
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
