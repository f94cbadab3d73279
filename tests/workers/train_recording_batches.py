"""`train.py` that records what it trains on: one line per micro-batch, {"step", "rank", "rows": [sha1 of each
row's input_ids]}, in <train.output_dir>/batches_rank<R>.jsonl (appended, so a resumed run continues it)."""
import argparse
import hashlib
import json
import sys
from pathlib import Path

from trainer import ranks
from trainer.presets import load_preset
from trainer.train.cli import train, train_arguments
from trainer.train.hooks import Hooks


class RecordBatches(Hooks):
    def __init__(self, out: Path):
        self.out = out

    def on_batch(self, batch, step):
        rows = [hashlib.sha1(row.numpy().tobytes()).hexdigest()[:16] for row in batch["input_ids"]]
        with open(self.out / f"batches_rank{ranks.rank()}.jsonl", "a") as f:
            f.write(json.dumps({"step": step, "rank": ranks.rank(), "rows": rows}) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    train_arguments(parser)
    args = parser.parse_args()
    out = Path(load_preset(args.preset, args.overrides).train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    sys.exit(train(args, hooks=RecordBatches(out)))
