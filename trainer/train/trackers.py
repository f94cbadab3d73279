"""Experiment trackers beside metrics.jsonl: wandb (logging.wandb_mode) and TensorBoard (logging.tensorboard).

Neither library is imported unless its tracker is on. Both keep one history per run directory across resumes, and a
resumed run's re-trained steps replace the ones the crash lost instead of being logged a second time:

- wandb, online: the run id lives in `<run>/wandb_run_id` and in every checkpoint's trainer state; a resume from step S
  calls `wandb.init(resume_from="<id>?_step=S")`, wandb's rewind: the server drops the history past S (archived, not
  deleted) and the run continues at S+1.
- wandb, offline: wandb-core records the same rewind point in the offline run's run record (`branch_point`) but cannot
  apply it without a server; `wandb sync` applies it when it uploads that directory (sync the run's offline
  directories oldest first). So that the offline files themselves never hold a step twice, an offline run hands rows
  to wandb only once a checkpoint at or past their step is saved: rows after the last checkpoint of an invocation
  that dies are lost from wandb exactly as the resume rewinds them (metrics.jsonl keeps them, see metrics.py). The
  price: an offline run's local history lags by up to train.save_every steps. A resume from an older checkpoint than
  the newest (an explicit --resume) does leave steps twice in the offline files; the recorded rewind point resolves
  them at sync.
- wandb-core buffers its offline file and flushes it every x_transaction_log_flush_interval seconds (wandb's default
  15 s; OFFLINE_FLUSH_S here); a SIGKILL loses what it had not flushed. Rows of the last seconds before the kill can
  so be missing from the offline history (never doubled); metrics.jsonl, flushed at every line, has them. Online runs
  upload asynchronously and can lose their last seconds the same way.
- TensorBoard: a resumed writer starts with `purge_step=S+1`; TensorBoard's readers drop the earlier events at or past
  that step (its own mechanism for restarted jobs). Events are flushed at every logged row.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Optional

from ..files import write_text_atomic


RUN_ID_FILE = "wandb_run_id"
OFFLINE_FLUSH_S = 2.0  # how often wandb-core writes an offline run's file (its default, 15 s, loses more at a kill)
TENSORBOARD_DIR = "tensorboard"


def read_run_id(run_dir: Path) -> Optional[str]:
    """The wandb run id recorded in the run directory, or None (a malformed file is ignored with a warning)."""
    path = run_dir / RUN_ID_FILE
    if not path.is_file():
        return None
    text = path.read_text().strip()
    if re.fullmatch(r"[A-Za-z0-9_-]{1,64}", text):
        return text
    print(f"warning: {path} does not hold a wandb run id ({text[:40]!r}); this run gets a new one", flush=True)
    return None


class WandbTracker:
    """One wandb run per run directory. `resumed_step` (the checkpoint's step) rewinds `run_id`'s history to it."""

    def __init__(self, logging_cfg, run_dir: Path, config: dict, tags: list[str], run_id: Optional[str],
                 resumed_step: Optional[int], default_name: str):
        import wandb
        self.wandb = wandb
        self.offline = logging_cfg.wandb_mode == "offline"
        self.pending: list[tuple[int, dict]] = []  # offline: rows no checkpoint covers yet
        self.last_step: Optional[int] = None  # online: the step of the row wandb holds open
        common = dict(project=logging_cfg.wandb_project, entity=logging_cfg.wandb_entity,
                      name=logging_cfg.run_name or default_name, tags=tags, mode=logging_cfg.wandb_mode,
                      dir=str(run_dir), config=config)
        if self.offline:
            common["settings"] = wandb.Settings(x_transaction_log_flush_interval=OFFLINE_FLUSH_S)
        if run_id and resumed_step is not None:
            self.run = self._rewound(run_id, resumed_step, common)
        else:
            self.run = wandb.init(id=run_id, **common)  # None: wandb picks a new id
        write_text_atomic(str(run_dir / RUN_ID_FILE), self.run.id + "\n", flag="train.output_dir")

    def _rewound(self, run_id: str, step: int, common: dict):
        try:
            return self.wandb.init(resume_from=f"{run_id}?_step={step}", **common)
        except self.wandb.errors.Error as err:  # online: the server has no such run (e.g. an offline run never synced)
            print(f"warning: wandb could not rewind run {run_id} to step {step} ({err}); continuing it with "
                  f"resume='allow': steps past {step} it already holds may show twice", flush=True)
            return self.wandb.init(id=run_id, resume="allow", **common)

    @property
    def run_id(self) -> str:
        return self.run.id

    def log(self, values: dict, step: int) -> None:
        if self.offline:
            self.pending.append((step, values))
        else:
            self.run.log(values, step=step)
            self.last_step = step

    def checkpointed(self, step: int) -> None:
        """A checkpoint of `step` is complete: rows up to it can no longer be rewound. wandb keeps a step's row open
        until a later step is logged, and a kill loses an open row: each step's row is committed here."""
        ready: dict[int, dict] = {}
        for s, values in self.pending:
            if s <= step:
                ready.setdefault(s, {}).update(values)  # the train, eval and samples rows of one step: one wandb row
        self.pending = [(s, values) for s, values in self.pending if s > step]
        for s, values in ready.items():
            self.run.log(values, step=s, commit=True)
        if not self.offline and self.last_step == step:
            self.run.log({}, step=step, commit=True)

    def log_model(self, export_dir: Path, step: int) -> None:
        """The HF export as a wandb artifact of type 'model' (logging.wandb_log_model)."""
        artifact = self.wandb.Artifact(f"model-{self.run.id}", type="model", metadata={"step": step})
        artifact.add_dir(str(export_dir))
        self.run.log_artifact(artifact, aliases=["latest", f"step_{step}"])

    def close(self) -> None:
        if self.pending:
            print(f"wandb: {len(self.pending)} offline row(s) from step {self.pending[0][0]} on come after the last "
                  f"checkpoint and were not handed to wandb (a resume redoes those steps); metrics.jsonl has them",
                  flush=True)
        self.run.finish()


class TensorBoardTracker:
    """The numeric values of each metrics row as TensorBoard scalars under `<run>/tensorboard/`, same names."""

    def __init__(self, run_dir: Path, resumed_step: Optional[int]):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
        self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR),
                                    purge_step=None if resumed_step is None else resumed_step + 1)

    def log(self, values: dict, step: int) -> None:
        scalars = {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, global_step=step)
        if scalars:
            self.writer.flush()  # a killed run keeps what it logged, so the resume's purge has something to replace

    def close(self) -> None:
        self.writer.close()
