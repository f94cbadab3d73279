"""Run several trainings one after another inside one DeepSpeed launch (one process group).

Launching costs ~20 s per job on 2 cores (imports, rendezvous); running the configs of a test module
back to back in one job keeps the suite fast. Usage (under `deepspeed --num_gpus 2`):
    python tests/workers/run_many.py SPEC.json
SPEC: {"runs": [{"preset": "tiny_cpu", "overrides": ["k=v", ...], "rehearse": false, "expect_error": false}, ...],
       "report": "path.json"}; the report records, for each run, the UserError it ended with (runs marked
       expect_error) and which wandb modules were imported after it.
A run {"worker": "module_in_tests/workers", "spec": {...}} calls that module's `run(spec)` instead of a training
(checks that drive engines directly share this launch instead of paying for one of their own).
"""
import argparse
import importlib
import json
import os
import sys

from trainer.errors import UserError
from trainer.distributed import end_distributed
from trainer.train.run import run_training


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("spec")
    args, _ = parser.parse_known_args()  # the launcher adds --local_rank
    spec = json.load(open(args.spec))
    report = []
    for number, run in enumerate(spec["runs"], 1):
        error = None
        if os.environ.get("RANK", "0") == "0":  # the test session shows it (tests/processes.py NOTABLE)
            print(f"run_many: run {number}/{len(spec['runs'])}: {run.get('name') or run['preset']}", flush=True)
        if run.get("worker"):
            importlib.import_module(run["worker"]).run(run["spec"])
            report.append({"name": run.get("name"), "error": None, "wandb_modules": []})
            continue
        try:
            run_training(run["preset"], run["overrides"], rehearse=run.get("rehearse", False))
        except UserError as err:
            if not run.get("expect_error"):
                raise
            error = str(err)
        report.append({"name": run.get("name"), "error": error,
                       "wandb_modules": sorted(m for m in sys.modules if m.startswith("wandb"))})
    if spec.get("report"):
        import torch.distributed as dist
        if dist.get_rank() == 0:
            json.dump(report, open(spec["report"], "w"), indent=1)
    end_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
