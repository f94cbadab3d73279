"""A model type the running transformers does not know: `KeyError: 'qwen2'` raised by transformers' auto-config
mapping, or "model type `X` but Transformers does not recognize this architecture". Each architecture arrives in
a transformers release; the installed transformers (where the doctor runs: the project's pin) says whether a
release knows it, read from its own source (CONFIG_MAPPING_NAMES in `models/auto/`) without
importing it. A log that states a transformers version which should know the type means the script ran in
another environment than the one the user checked.
"""
from __future__ import annotations

import functools
import re
from importlib import metadata
from typing import Optional

from ..findings import Diagnosis, Found, Proposal
from ..logtext import Log
from ..raised import final_exception

UNKNOWN_ARCH = re.compile(r"model type [`'\"](?P<type>[\w-]+)[`'\"] but Transformers does not recognize this "
                          r"architecture", re.IGNORECASE)
AUTO_CONFIG = re.compile(r"transformers[\\/]models[\\/]auto[\\/](?:configuration|modeling|tokenization)_auto\.py")
KEY = re.compile(r"^['\"]?(?P<type>[\w-]+)['\"]?$")
MAPPING_MODULES = ("configuration_auto.py", "auto_mappings.py")
MAPPING_ENTRY = re.compile(r"^\s*\(\s*\"(?P<type>[\w-]+)\",\s*\"\w+Config\"\s*\)", re.MULTILINE)


def find(log: Log) -> Optional[int]:
    raised = final_exception(log)
    if raised is not None and raised.type.endswith("KeyError") and KEY.match(raised.message.strip()) and \
            any(AUTO_CONFIG.search(frame.file) for frame in raised.frames):
        return raised.index
    return log.first(UNKNOWN_ARCH)


def model_type(f: Found) -> str:
    m = UNKNOWN_ARCH.search(f.log.joined(f.index))
    if m:
        return m.group("type")
    return KEY.match(final_exception(f.log).message.strip()).group("type")


@functools.lru_cache(maxsize=1)
def installed_types() -> tuple[str, frozenset]:
    """(the installed transformers' version, the model types its auto-config mapping knows); ('', {}) without it."""
    try:
        version = metadata.version("transformers")
        distribution = metadata.distribution("transformers")
    except metadata.PackageNotFoundError:
        return "", frozenset()
    types = set()
    for module in MAPPING_MODULES:  # the mapping moved to auto_mappings.py in transformers 5
        try:
            source = distribution.locate_file(f"transformers/models/auto/{module}").read_text(errors="replace")
        except OSError:
            continue
        types.update(m.group("type") for m in MAPPING_ENTRY.finditer(source))
    return version, frozenset(types)


def diagnose(f: Found) -> Diagnosis:
    kind = model_type(f)
    here, known = installed_types()
    theirs = f.versions.get("transformers")
    d = Diagnosis("unknown_architecture", f"the running transformers does not know the model type '{kind}'", f.line)
    which = "python -c 'import transformers; print(transformers.__version__, transformers.__file__)'"
    if kind in known:
        d.proposal = Proposal(
            f"upgrade transformers where the script runs (`pip install -U transformers`: '{kind}' is known to "
            f"transformers {here}, the release this project pins)", [],
            f"each architecture arrives in a transformers release; the one that raised predates '{kind}'"
            + (f". The log states transformers {theirs}: if that release already has '{kind}', the script ran "
               f"another environment's transformers - `{which}` with the interpreter that runs it" if theirs else
               f"; `{which}` with the interpreter that runs the script shows which one it imports"))
    else:
        d.proposal = Proposal(
            f"load '{kind}' with its own code (`trust_remote_code=True`, after reading it) or a transformers release "
            f"that has it", [],
            f"'{kind}' is not among the {len(known)} model types of transformers {here or '(not installed here)'}: "
            f"a model published with its own modelling code, or one newer than that release")
    return d
