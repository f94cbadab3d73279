"""DeepSpeed's engine API called on a model DeepSpeed never wrapped.

`'PeftModelForCausalLM' object has no attribute 'save_checkpoint'`: `save_checkpoint` is a method of DeepSpeedEngine
(the installed DeepSpeed's own source says which names are), and the object is a plain model. The code took its
DeepSpeed path - the HF Trainer and accelerate decide that from their state, which ACCELERATE_USE_DEEPSPEED=true or a
--deepspeed argument turns on - while the model was never passed through deepspeed.initialize: the run was not
launched under DeepSpeed, or DeepSpeed was switched on where it should not be. The engine's method names are read
from DeepSpeed's source with `ast` (no import: the doctor stays a light command); torch's Module methods are left out,
since a plain model has those too.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import re
from pathlib import Path
from typing import Optional

from ..findings import Diagnosis, Found, Proposal

NO_ATTRIBUTE = re.compile(r"'(?P<obj>\w+)' object has no attribute '(?P<attr>\w+)'")
SWITCHES = ("ACCELERATE_USE_DEEPSPEED",)


@functools.lru_cache(maxsize=None)
def _methods(package: str, relative: str, cls: str) -> frozenset[str]:
    """The public names `cls` defines in `package`'s file `relative` (methods and class attributes), read from the
    installed source; empty when the package is not installed here."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return frozenset()
    body = next((node.body for node in tree.body if isinstance(node, ast.ClassDef) and node.name == cls), [])
    names = {node.name for node in body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names |= {target.id for node in body if isinstance(node, (ast.Assign, ast.AnnAssign))  # forward: Callable = ...
              for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
              if isinstance(target, ast.Name)}
    return frozenset(name for name in names if not name.startswith("_"))


def engine_methods() -> frozenset[str]:
    """What DeepSpeedEngine has and a torch Module does not."""
    return _methods("deepspeed", "runtime/engine.py", "DeepSpeedEngine") - _methods("torch", "nn/modules/module.py",
                                                                                     "Module")


def find(log) -> Optional[int]:
    index = log.last(NO_ATTRIBUTE)
    if index is None:
        return None
    m = NO_ATTRIBUTE.search(log.line(index))
    return index if "DeepSpeed" not in m.group("obj") and m.group("attr") in engine_methods() else None


def diagnose(f: Found) -> Diagnosis:
    m = NO_ATTRIBUTE.search(f.log.line(f.index))
    obj, attr = m.group("obj"), m.group("attr")
    d = Diagnosis("engine_api", f"'{attr}' is a method of DeepSpeed's engine, called on a {obj} that DeepSpeed never "
                                f"wrapped: the code took its DeepSpeed path, the model did not go through "
                                f"deepspeed.initialize", f.line)
    exported = [name for name in SWITCHES if name in f.facts.exported]
    if exported:
        d.proposal = Proposal(f"unset {exported[0]} (the log exports {exported[0]}={f.facts.exported[exported[0]]}) "
                              f"unless the run is launched with a DeepSpeed config", [],
                              f"{exported[0]} tells accelerate and the HF Trainer to take DeepSpeed's path; without a "
                              f"DeepSpeed launch the model stays a plain {obj}")
    else:
        d.proposal = Proposal(
            "either launch under DeepSpeed (accelerate launch with a DeepSpeed config, or the deepspeed launcher with "
            "--deepspeed), or, for a run without DeepSpeed, remove what switches its path on: ACCELERATE_USE_DEEPSPEED"
            "=true in the environment (`env | grep -i deepspeed`), a --deepspeed argument", [],
            f"accelerate and the HF Trainer choose the DeepSpeed path from their state (ACCELERATE_USE_DEEPSPEED, the "
            f"--deepspeed argument); the {obj} never went through deepspeed.initialize, so it has no '{attr}'")
    return d
