"""Metrics on rank 0: a JSONL file in the run directory, an optional wandb run, a progress bar.

`metrics.jsonl` has one JSON object per logged step: step, loss, lr, grad_norm, tokens_per_s,
step_time_s, tflops_per_gpu, mfu, peak_mem_gb (+ loss_scale under fp16); eval lines carry
eval_loss and eval_ppl. Tools may rely on these names.

MFU counts model FLOPs only (no recomputation): FLOPs per token = 6·N + 12·L·h·s (PaLM appendix B),
N = all parameters, L layers, h hidden size, s sequence length; the peak is the GPU table's
dense 16-bit figure (trainer.hardware) times the number of GPUs.
"""
from __future__ import annotations

import json
import logging
import os
import resource
import sys
from pathlib import Path
from typing import Optional

import torch

from .. import hardware
from ..config import Config
from ..redact import redact


log = logging.getLogger(__name__)

def flops_per_token(num_params: int, num_layers: int, hidden_size: int, seq_len: int) -> float:
    return 6.0 * num_params + 12.0 * num_layers * hidden_size * seq_len


def peak_memory_gb() -> float:
    """CUDA max allocated on GPU; the process's peak RSS on CPU ranks."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # ru_maxrss is KiB on Linux


class MetricsLogger:
    """Rank 0 writes; other ranks hold a logger that does nothing (so call sites need no rank checks)."""

    def __init__(self, config: Config, run_dir: Path, rank: int, num_params: int, world_size: int,
                 config_dict: dict):
        self.enabled = rank == 0
        self.config = config
        peak_tflops = hardware.gpu(config.hardware.gpu).peak_tflops
        self.peak_flops = peak_tflops * 1e12 * world_size if peak_tflops else None
        self.flops_per_token = flops_per_token(num_params, config.model.num_layers, config.model.hidden_size,
                                               config.data.seq_len)
        self.world_size = world_size
        self.file = open(run_dir / "metrics.jsonl", "a") if self.enabled else None
        self.wandb_run = self._start_wandb(run_dir, config_dict) if self.enabled else None
        self.bar = None
        self.sample_rows: list[list] = []  # wandb tables are immutable: each eval logs the rows so far

    def _start_wandb(self, run_dir: Path, config_dict: dict):
        logging_cfg = self.config.logging
        if logging_cfg.wandb_mode == "disabled":
            return None  # wandb is never imported in this mode
        import wandb
        return wandb.init(project=logging_cfg.wandb_project, entity=logging_cfg.wandb_entity,
                          name=logging_cfg.run_name or self.config.name, tags=list(logging_cfg.tags),
                          mode=logging_cfg.wandb_mode, dir=str(run_dir), config=redact(config_dict))

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
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])
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
        if self.wandb_run is not None:
            import wandb
            self.sample_rows += [[step, s["prompt"], s["completion"]] for s in samples]
            table = wandb.Table(columns=["step", "prompt", "completion"], data=list(self.sample_rows))
            self.wandb_run.log({"samples": table}, step=step)
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
        if self.wandb_run is not None:
            self.wandb_run.finish()


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def print0(*args, rank: Optional[int] = None) -> None:
    """print on rank 0 only (rank from the launcher's RANK when not given)."""
    if (rank if rank is not None else int(os.environ.get("RANK", 0))) == 0:
        print(*args, flush=True)
