"""The tree tells the story, and no arrow runs back up: the package's import graph (imports inside functions
included) has no cycle, between modules or between subpackages, and no module outgrows a read."""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "trainer"
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every trainer module `path` imports, at the top or inside a function."""
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "trainer"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "trainer":
                continue
            for alias in node.names:  # `from . import ranks` imports a module; `from .x import f` imports x
                candidate = f"{base}.{alias.name}"
                found.add(candidate if candidate in MODULES else base)
    return found - {module_name(path)}


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


@functools.cache
def graph() -> dict[str, set[str]]:
    """The package's import graph, parsed by the first test that reads it (at module level every test worker paid
    ~2 s of CPU for it while collecting, whether or not it ran this file)."""
    return {name: imports_of(path) for name, path in MODULES.items()}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of a directed graph as a path, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def unit(module: str) -> str:
    """A subpackage counts as one unit (trainer.plan.*), a module of the shared core as its own."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_no_import_cycle_between_modules():
    assert cycle(graph()) is None, " -> ".join(cycle(graph()))


def test_no_import_cycle_between_subpackages():
    units: dict[str, set[str]] = {}
    for module, deps in graph().items():
        units.setdefault(unit(module), set()).update(unit(d) for d in deps if unit(d) != unit(module))
    assert cycle(units) is None, " -> ".join(cycle(units))


def test_the_graph_sees_lazy_imports():
    """A function-level import counts (run.py imports the data pipeline inside `build`)."""
    assert "trainer.data" in graph()["trainer.train.run"]


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_over_600_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE)} has {lines} lines: split it by job"


DEEPSPEED_KEY_READ = re.compile(r'(\b(ds|deepspeed|ds_config)(\[|\.get\()|\]\[)"(zero_optimization|bf16|fp16|'
                                r'tensor_parallel|optimizer|scheduler|aio|train_batch_size|'
                                r'train_micro_batch_size_per_gpu|gradient_accumulation_steps|activation_checkpointing)"')


def test_only_the_ds_package_reads_deepspeed_keys():
    """One package owns DeepSpeed's keys: no module outside trainer/ds/ indexes a DeepSpeed config by hand."""
    offenders = [f"{p.relative_to(PACKAGE)}:{n}" for p in PACKAGE.rglob("*.py") if p.parent.name != "ds"
                 for n, line in enumerate(p.read_text().splitlines(), 1) if DEEPSPEED_KEY_READ.search(line)]
    assert not offenders, offenders
    assert DEEPSPEED_KEY_READ.search('z = cfg.deepspeed["zero_optimization"]')  # the pattern does catch one
