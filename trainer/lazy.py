"""A module imported on its first use instead of where it is named: for libraries only some commands need.

`datasets` (with pandas, pyarrow's compute, dill, multiprocess, fsspec) costs about 0.8 s of import per process on
this project's CPUs, and a training from prepared shards never calls it: the data modules that read raw records
name it with `datasets = lazy_module("datasets")`, so a training's ranks reach their first step without it while
`prepare-data` and a first run that prepares its data import it the moment they read a record.

Nothing is put in sys.modules until the real import happens, so `"datasets" in sys.modules` still tells whether it
was imported.
"""
from __future__ import annotations

import importlib
import types


class _LazyModule(types.ModuleType):
    """Stands for module `name`; the first attribute read imports it, every read is the real module's."""

    def __getattr__(self, attribute: str):
        return getattr(importlib.import_module(self.__name__), attribute)

    def __dir__(self):
        return dir(importlib.import_module(self.__name__))


def lazy_module(name: str) -> types.ModuleType:
    """`name` imported when one of its attributes is first read (import errors surface then)."""
    return _LazyModule(name)
