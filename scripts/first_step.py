"""Time to the first optimizer step, split by phase: `scripts/bench.py --first-step` (see scripts/README.md).

The worker (`bench.py --worker first_step`) runs `trainer.train.run.run_training` unchanged, like the `trainer`
contender, and keeps a clock on rank 0:
- imports: every module executed by the import system (a finder first on sys.meta_path times each outermost
  import, `import x` and importlib.import_module alike, finding and executing), wherever it happens;
- phases: the functions the trainer calls for them, wrapped for this process (process group:
  trainer.train.run.start_distributed; data open: trainer.data.load_tokenizer and build_datasets; model build:
  trainer.model.build_model; DeepSpeed initialize: deepspeed.initialize), each without the imports inside it;
- first step: from the first micro-batch handed to the loop (Hooks.on_batch) to the end of optimizer step 1
  (Hooks.after_step);
- other: the rest (config resolution and its checks, run directory, metrics, anything between the phases);
- python start-up: from the process's start (its start time in /proc, via psutil) to the worker's main();
- launcher: from the driver starting `deepspeed` to this rank's process start (the deepspeed runner and
  launch.py import DeepSpeed and torch themselves before they start the ranks).
"""
from __future__ import annotations

import functools
import importlib.abc
import sys
import time

PHASES = ("python start-up", "imports", "process group", "data open", "model build", "DeepSpeed initialize",
          "other", "first step")


class ImportClock(importlib.abc.MetaPathFinder):
    """Seconds spent importing, outermost imports only (an import inside another is part of it)."""

    def __init__(self):
        self.seconds = 0.0
        self._depth = 0
        self._finding = False

    def install(self) -> "ImportClock":
        sys.meta_path.insert(0, self)
        return self

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(self, name, path=None, target=None):
        if self._finding:
            return None
        self._finding = True
        started = time.perf_counter()
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
            else:
                spec = None
        finally:
            self._finding = False
            if self._depth == 0:
                self.seconds += time.perf_counter() - started
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _TimedLoader(spec.loader, self)
        return spec

    def timed(self, function, argument):
        started = time.perf_counter()
        self._depth += 1
        try:
            return function(argument)
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.seconds += time.perf_counter() - started


class _TimedLoader(importlib.abc.Loader):
    """The real loader, timed: an extension module does its work in create_module, a Python one in exec_module."""

    def __init__(self, loader, clock: ImportClock):
        self._loader, self._clock = loader, clock

    def create_module(self, spec):
        return self._clock.timed(self._loader.create_module, spec)

    def exec_module(self, module):
        # the module keeps its real loader (pickling, reloads and importlib.resources look at it)
        if getattr(module, "__spec__", None) is not None:
            module.__spec__.loader = self._loader
        module.__loader__ = self._loader
        self._clock.timed(self._loader.exec_module, module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class StartupClock:
    """Wall time of each phase on this rank, less the imports that ran inside it."""

    def __init__(self, imports: ImportClock):
        self.imports = imports
        self.phase_s = {name: 0.0 for name in PHASES}
        self.main_at = time.time()
        self.first_batch_at = None
        self.first_step_at = None

    def wrap(self, owner, attribute: str, phase: str) -> None:
        original = getattr(owner, attribute)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            started, imports_before = time.perf_counter(), self.imports.seconds
            try:
                return original(*args, **kwargs)
            finally:
                self.phase_s[phase] += (time.perf_counter() - started) - (self.imports.seconds - imports_before)
        setattr(owner, attribute, timed)

    def first_batch(self) -> None:
        if self.first_batch_at is None:
            self.first_batch_at = time.perf_counter()

    def first_step(self) -> None:
        if self.first_step_at is None:
            self.first_step_at = time.perf_counter()
            self.imports_at_first_step = self.imports.seconds
            self.wall_at_first_step = time.time()

    def report(self, launched_at: float | None) -> dict:
        """Seconds per phase, from this process's start to the end of step 1 (launcher: before that start)."""
        import psutil
        process_start = psutil.Process().create_time()
        total = self.wall_at_first_step - process_start
        phases = dict(self.phase_s)
        phases["python start-up"] = self.main_at - process_start
        phases["imports"] = self.imports_at_first_step
        phases["first step"] = self.first_step_at - self.first_batch_at
        phases["other"] = total - sum(v for k, v in phases.items() if k != "other")
        return {"phases": phases, "total_s": total,
                "launcher_s": process_start - launched_at if launched_at else None}


def first_step_worker(spec: dict, main_at: float) -> dict:
    """run_training under the clock; this rank's split of the time before the end of its first optimizer step.
    `main_at`: when the worker's main() began (time.time())."""
    imports = ImportClock().install()
    clock = StartupClock(imports)
    clock.main_at = main_at
    import deepspeed

    import trainer.data
    import trainer.model
    from trainer.presets import with_overrides
    from trainer.train import run
    from trainer.train.hooks import Hooks
    clock.wrap(run, "start_distributed", "process group")
    clock.wrap(trainer.data, "load_tokenizer", "data open")
    clock.wrap(trainer.data, "build_datasets", "data open")
    clock.wrap(trainer.model, "build_model", "model build")
    clock.wrap(deepspeed, "initialize", "DeepSpeed initialize")

    class FirstStep(Hooks):
        def on_batch(self, batch, step):
            clock.first_batch()

        def after_step(self, engine, step):
            clock.first_step()

    overrides = with_overrides(spec["overrides"], [f"train.output_dir={spec['run_dir']}"])
    exit_code = run.run_training(spec["preset"], overrides, world_size=spec["world_size"], hooks=FirstStep())
    imports.remove()
    if exit_code:
        raise RuntimeError(f"run_training returned {exit_code}")
    return clock.report(spec.get("launched_at"))


def print_first_step(results: list[dict], preset: str, ranks: int) -> None:
    """The fastest run's split (by total) and every run's total."""
    best = min(results, key=lambda r: r["total_s"])
    totals = ", ".join(f"{r['total_s']:.2f}" for r in results)
    print(f"\ntime to the first optimizer step: preset {preset}, {ranks} rank(s), rank 0, fastest of {len(results)} "
          f"runs (totals: {totals} s)")
    print("| phase | seconds | share |")
    print("|---|---|---|")
    for name in PHASES:
        seconds = best["phases"][name]
        print(f"| {name} | {seconds:.2f} | {seconds / best['total_s']:.0%} |")
    print(f"| **process start -> end of step 1** | **{best['total_s']:.2f}** | 100% |")
    if best.get("launcher_s") is not None:
        print(f"| (before it: `deepspeed` launcher -> rank process start) | {best['launcher_s']:.2f} | |")
