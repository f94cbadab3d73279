"""Metrics on rank 0: a JSONL file in the run directory, optional wandb and TensorBoard trackers (trackers.py), a
progress bar.

`metrics.jsonl` has one JSON object per logged step: step, loss, lr, grad_norm, tokens_per_s,
step_time_s, tflops_per_gpu, mfu, peak_mem_gb (+ loss_scale under fp16); eval lines carry
eval_loss and eval_ppl; MoE models add router_aux_loss, expert_share_max_over_mean and expert_share_min_over_mean
(trainer/train/router.py). Tools may rely on these names.

A resume from the checkpoint of step S rewinds it first: lines past S (steps the crash lost; the resumed run trains
them again) move to `metrics.rewound.jsonl`, each with `rewound_by` naming that resume, metrics.jsonl is rewritten
whole (temp file + rename), and one event line marks the resume:
    {"step": S, "event": "resume", "checkpoint": "<tag>", "world_size": W}
So metrics.jsonl holds each step's lines once, as the run's surviving history saw them. A fresh start in a directory
that already holds a run finds none: the whole previous run, metrics.jsonl too, is set aside first
(trainer/run_dir.py); should lines be there all the same, they move the same way, with no event. A line that is no metrics line
(the torn last line of a killed write, bad UTF-8, not a JSON object) moves too, as
    {"unparsable": <its text>, "unparsable_base64": <its bytes, where they are not UTF-8>, "line": N, "problem": ...}
and the resume says so: it never stops a run. The file is read by trainer.metrics_file, line by line.

MFU counts model FLOPs only (no recomputation): FLOPs per token = 6·N + 12·L·h·s (PaLM appendix B),
N = the parameters a token passes through (all of them; MoE: its top-k experts, not the idle ones), L layers,
h hidden size, s sequence length; the peak is the GPU table's dense 16-bit figure (trainer.hardware) times the
number of GPUs.
"""
from __future__ import annotations

import base64
import json
import logging
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from .. import hardware, ranks
from ..config import Config
from ..files import atomic_writer, regular_file
from ..metrics_file import METRICS_FILE, REWOUND_FILE, Line, forward
from ..redact import redact
from . import trackers


log = logging.getLogger(__name__)

def flops_per_token(num_params: int, num_layers: int, hidden_size: int, seq_len: int) -> float:
    return 6.0 * num_params + 12.0 * num_layers * hidden_size * seq_len


def peak_memory_gb() -> float:
    """CUDA max allocated on GPU; the process's peak RSS on CPU ranks."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # ru_maxrss is KiB on Linux


@dataclass
class Resumed:
    """The checkpoint a run resumed from, as the metrics need it."""
    step: int
    tag: str                          # the checkpoint directory's name (step_00000100)
    wandb_run_id: Optional[str]       # recorded in that checkpoint's trainer state


@dataclass
class Rewound:
    """What a rewind moved to metrics.rewound.jsonl: every line, and of them the ones that were no metrics lines."""
    moved: int = 0
    not_metrics: int = 0
    named: list[str] = field(default_factory=list)   # the first MAX_NAMED of those, as "line N: problem"


MAX_NAMED = 5


def rewind_metrics(run_dir: Path, step: int, tag: Optional[str], world_size: int) -> Rewound:
    """Rank 0, before a resumed run logs: lines past `step` move to metrics.rewound.jsonl, metrics.jsonl is rewritten
    atomically with the resume event appended (`tag` None: a fresh start, step 0, no event). A line that is no
    metrics line (torn by a kill or a full disk, bad UTF-8, not a JSON object) moves too, its bytes kept. The file is
    streamed: its size does not matter."""
    path = run_dir / METRICS_FILE
    rewound_by = {"checkpoint": tag, "step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    result = Rewound()
    lines = forward(regular_file(path, "metrics file")) if path.exists() else iter(())
    with _Aside(run_dir / REWOUND_FILE) as aside, atomic_writer(str(path), flag="train.output_dir") as kept:
        for line in lines:
            if line.row is not None and line.step <= step:
                kept.write(line.raw + b"\n")
                continue
            aside.write({**line.row, "rewound_by": rewound_by} if line.row is not None
                        else {**aside_record(line), "rewound_by": rewound_by})
            result.moved += 1
            if line.problem:
                result.not_metrics += 1
                if len(result.named) < MAX_NAMED:
                    result.named.append(f"line {line.number}: {line.problem}")
        if tag:
            kept.write(json.dumps({"step": step, "event": "resume", "checkpoint": tag,
                                   "world_size": world_size}).encode() + b"\n")
        aside.sync()  # the moved lines are on disk before the rewritten file replaces the one that held them
    return result


def aside_record(line: Line) -> dict:
    """A line that is no metrics line as a JSON object that keeps its bytes: as text, and in base64 where they are
    not UTF-8 (so nothing is lost); a line too long to read keeps its first bytes and its size."""
    record = {"unparsable": line.raw.decode("utf-8", "replace"), "line": line.number, "problem": line.problem}
    if record["unparsable"].encode() != line.raw:
        record["unparsable_base64"] = base64.b64encode(line.raw).decode("ascii")
    if line.size > len(line.raw):
        record["size"] = line.size
    return record


class _Aside:
    """metrics.rewound.jsonl, appended to; opened at the first line moved (a rewind that moves nothing leaves no
    file)."""

    def __init__(self, path: Path):
        self.path = path
        self.handle = None

    def __enter__(self) -> "_Aside":
        return self

    def write(self, record: dict) -> None:
        if self.handle is None:
            self.handle = open(self.path, "a")
        self.handle.write(json.dumps(record) + "\n")

    def sync(self) -> None:
        if self.handle is not None:
            self.handle.flush()
            os.fsync(self.handle.fileno())

    def __exit__(self, *exc) -> None:
        if self.handle is not None:
            self.handle.close()


def has_history(run_dir: Path) -> bool:
    path = run_dir / METRICS_FILE
    return path.exists() and (not path.is_file() or path.stat().st_size > 0)  # not a file: the rewind names it


class MetricsLogger:
    """Rank 0 writes; other ranks hold a logger that does nothing (so call sites need no rank checks)."""

    def __init__(self, config: Config, run_dir: Path, rank: int, num_params: int, world_size: int,
                 config_dict: dict, resumed: Optional[Resumed] = None):
        self.enabled = rank == 0
        self.config = config
        peak_tflops = hardware.gpu(config.hardware.gpu).peak_tflops
        self.peak_flops = peak_tflops * 1e12 * world_size if peak_tflops else None
        self.flops_per_token = flops_per_token(num_params, config.model.num_layers, config.model.hidden_size,
                                               config.data.seq_len)
        self.world_size = world_size
        self.trackers: list = []
        self.wandb: Optional[trackers.WandbTracker] = None
        self.file = None
        if self.enabled:
            rewound_to = self._rewind(run_dir, resumed, world_size)
            self.file = open(run_dir / METRICS_FILE, "a")
            self.wandb = self._start_wandb(run_dir, config_dict, resumed)
            self.trackers = [t for t in (self.wandb, self._start_tensorboard(run_dir, rewound_to)) if t is not None]
        self.bar = None
        self.sample_rows: list[list] = []  # wandb tables are immutable: each eval logs the rows so far

    @staticmethod
    def _rewind(run_dir: Path, resumed: Optional[Resumed], world_size: int) -> Optional[int]:
        """The step the run's history is rewound to: the checkpoint's, 0 for a fresh start in a used directory, None
        for a fresh directory."""
        if resumed is not None:
            rewound = rewind_metrics(run_dir, resumed.step, resumed.tag, world_size)
            _tell_not_metrics(run_dir, rewound)
            if rewound.moved > rewound.not_metrics:
                print(f"metrics: {rewound.moved - rewound.not_metrics} line(s) past step {resumed.step} (lost with "
                      f"the crash, trained again now) moved to {run_dir / REWOUND_FILE}", flush=True)
            return resumed.step
        if has_history(run_dir):
            rewound = rewind_metrics(run_dir, 0, None, world_size)
            _tell_not_metrics(run_dir, rewound)
            print(f"metrics: a fresh start in a used run directory: its earlier {rewound.moved} line(s) moved to "
                  f"{run_dir / REWOUND_FILE}", flush=True)
            return 0
        return None

    def _start_wandb(self, run_dir: Path, config_dict: dict, resumed: Optional[Resumed]):
        logging_cfg = self.config.logging
        if logging_cfg.wandb_mode == "disabled":
            return None  # wandb is never imported in this mode
        # a resume continues the wandb run its checkpoint logged to (older checkpoints: the run directory's); a fresh
        # start, even in a used directory, is a new run
        run_id = (resumed.wandb_run_id or trackers.read_run_id(run_dir)) if resumed else None
        return trackers.WandbTracker(logging_cfg, run_dir, redact(config_dict), self.tags(), run_id,
                                     resumed.step if resumed and run_id else None, self.config.name)

    def _start_tensorboard(self, run_dir: Path, rewound_to: Optional[int]):
        if not self.config.logging.tensorboard:
            return None  # tensorboard is never imported in this mode
        return trackers.TensorBoardTracker(run_dir, rewound_to)

    def tags(self) -> list[str]:
        """logging.tags plus the preset, the task and the hardware (e.g. preset:tiny_cpu, task:pretrain, hw:2xcpu)."""
        hw = self.config.hardware
        made = [f"preset:{self.config.name}", f"task:{self.config.data.task}",
                f"hw:{hw.nodes * hw.gpus_per_node}x{hw.gpu}"]
        return list(dict.fromkeys([*self.config.logging.tags, *made]))

    @property
    def wandb_run_id(self) -> Optional[str]:
        return self.wandb.run_id if self.wandb is not None else None

    def checkpointed(self, step: int) -> None:
        """A complete checkpoint of `step` exists (the offline wandb tracker hands rows to wandb up to it)."""
        if self.wandb is not None:
            self.wandb.checkpointed(step)

    def log_model(self, export_dir: Path, step: int) -> None:
        """logging.wandb_log_model: the HF export as a wandb model artifact."""
        if self.wandb is not None and self.config.logging.wandb_log_model:
            self.wandb.log_model(export_dir, step)

    def start_progress(self, start_step: int, max_steps: int) -> None:
        if self.enabled and self.config.logging.progress_bar and sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=max_steps, initial=start_step, desc="train", dynamic_ncols=True)

    def throughput(self, tokens: int, seconds: float, steps: int) -> dict:
        tokens_per_s = tokens / seconds if seconds > 0 else 0.0
        row = {"tokens_per_s": tokens_per_s, "step_time_s": seconds / max(steps, 1),
               "tflops_per_gpu": tokens_per_s * self.flops_per_token / self.world_size / 1e12}
        if self.peak_flops:
            row["mfu"] = tokens_per_s * self.flops_per_token / self.peak_flops
        return row

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        row = {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in row.items()}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        values = {k: v for k, v in row.items() if k != "step"}
        for tracker in self.trackers:
            tracker.log(values, row["step"])
        message = " ".join(f"{k}={_fmt(v)}" for k, v in row.items())
        if self.bar is not None:
            self.bar.write(message)
        else:
            print(message, flush=True)

    def log_samples(self, step: int, samples: list[dict]) -> None:
        """Sample generations: one metrics.jsonl line {"step", "samples": [{"prompt", "completion"}]}, and a wandb
        table (columns step, prompt, completion) that grows over the run."""
        if not self.enabled:
            return
        self.file.write(json.dumps({"step": step, "samples": samples}) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.sample_rows += [[step, s["prompt"], s["completion"]] for s in samples]
            table = self.wandb.wandb.Table(columns=["step", "prompt", "completion"], data=list(self.sample_rows))
            self.wandb.log({"samples": table}, step)
        for s in samples:
            print(f"sample step={step} {s['prompt']!r} -> {s['completion']!r}", flush=True)

    def advance(self, steps: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(steps)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.file is not None:
            self.file.close()
        for tracker in self.trackers:
            tracker.close()


def _tell_not_metrics(run_dir: Path, rewound: Rewound) -> None:
    if rewound.not_metrics:
        more = rewound.not_metrics - len(rewound.named)
        print(f"metrics: {rewound.not_metrics} line(s) of {run_dir / METRICS_FILE} were not metrics lines, moved to "
              f"{run_dir / REWOUND_FILE} with their bytes: " + "; ".join(rewound.named)
              + (f"; and {more} more" if more else ""), flush=True)


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def print0(*args, rank: Optional[int] = None) -> None:
    """print on rank 0 only (rank from the launcher's RANK when not given)."""
    if (rank if rank is not None else ranks.launched_rank()) == 0:
        print(*args, flush=True)
