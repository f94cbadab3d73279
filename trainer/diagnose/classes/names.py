"""A name that one package takes from another, and the other's installed release does not have:
`ImportError: cannot import name 'N' from 'P'`, `AttributeError: module 'P' has no attribute 'N'`,
`ModuleNotFoundError: No module named 'P.sub'` while P itself is there. Packages add, move and remove names from
release to release, so the two releases in that environment do not go together; which way round is read from:

- the importer: the package whose frame made the import (the traceback's innermost frame outside P), when shown;
- the installed P where the doctor runs (the project's pins): whether its source defines N, read without importing
  it - when it does, the run's P predates N; when it does not, N was removed or renamed by then;
- the versions the log prints for P, compared with the installed one (a newer P than ours says nothing either way).

The first proposal upgrades what the evidence points at; the other direction is named as the alternative.
"""
from __future__ import annotations

import functools
import re
from importlib import metadata
from pathlib import Path
from typing import Optional

from ..findings import Diagnosis, Found, Proposal
from ..logtext import Log
from ..raised import final_exception

MISSING_NAME = re.compile(
    r"cannot import name '(?P<name>[\w.]+)'(?: from '(?P<module>[\w.]+)'?)?"  # a paste may cut (or retell without) it
    r"|module '(?P<module2>[\w.]+)' has no attribute '(?P<name2>\w+)'"
    r"|No module named '(?P<module3>[A-Za-z_]\w*)\.(?P<name3>[\w.]+)'")
BUILTIN_ROOTS = {"__main__", "builtins", "os", "sys", "typing", "collections", "numpy.core"}


def parts(match: re.Match) -> tuple[str, str, bool]:
    """(module, name, whether the name is a submodule): 'P.sub' and 'N' as the message states them."""
    if match.group("name"):
        return match.group("module") or "", match.group("name"), False
    if match.group("name2"):
        return match.group("module2"), match.group("name2"), False
    return match.group("module3"), match.group("name3"), True


def find(log: Log) -> Optional[int]:
    """The final exception, when it is such a message about a module of an installed-style package (named by the
    message, else by the import statement the log quotes)."""
    raised = final_exception(log)
    if raised is not None and raised.headline:
        found = MISSING_NAME.search(raised.headline)
        return raised.index if found and _package_named(log, found) else None
    index = log.first(MISSING_NAME)
    if index is None:
        return None
    return index if _package_named(log, MISSING_NAME.search(log.line(index))) else None


def _package_named(log: Log, match: re.Match) -> bool:
    module, name, _ = parts(match)
    module = module or (_quoted_import(log, name) or ("", None))[0]
    return bool(module) and module.split(".")[0] not in BUILTIN_ROOTS


def _quoted_import(log: Log, name: str) -> Optional[tuple[str, int]]:
    """(module, line) of the import statement the log quotes for `name` (`from M import a, name`), if any."""
    index = log.first(re.compile(IMPORT_STATEMENT.format(name=re.escape(name))))
    if index is None:
        return None
    return re.search(IMPORT_STATEMENT.format(name=re.escape(name)), log.line(index)).group("module"), index


def distribution_of(package: str) -> Optional[metadata.Distribution]:
    """The installed distribution that provides the top-level package (torch, transformers, bitsandbytes, ...):
    the distribution of that name first; else the one whose files hold it (reading every RECORD: ~0.5 s, once)."""
    try:
        return metadata.distribution(package)
    except metadata.PackageNotFoundError:
        pass
    for name in _providers().get(package, []):
        try:
            return metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
    return None


@functools.lru_cache(maxsize=1)
def _providers() -> dict:
    return metadata.packages_distributions()


@functools.lru_cache(maxsize=16)
def installed_has(module: str, name: str, submodule: bool) -> tuple[str, Optional[bool]]:
    """(the installed version of module's package, whether its source defines or exports `name` - or, for a
    submodule, has that file; None when the package is not installed here)."""
    package = module.split(".")[0]
    dist = distribution_of(package)
    if dist is None:
        return "", None
    root = Path(dist.locate_file(package))
    if not root.is_dir():
        return dist.version, None
    if submodule:
        path = root.joinpath(*module.split(".")[1:], *name.split("."))
        return dist.version, path.is_dir() or path.with_suffix(".py").is_file()
    own = root.joinpath(*module.split(".")[1:])
    own_file = own / "__init__.py" if own.is_dir() else own.with_suffix(".py")
    if module != package and own_file.is_file():  # the module the message names: its own source decides
        return dist.version, defines(own_file, name)
    for path in root.rglob("*.py"):  # the package root (lazy exports, re-exports): anywhere in the package
        if defines(path, name):
            return dist.version, True
    return dist.version, False


def defines(path: Path, name: str) -> bool:
    """Whether a source file defines, assigns, imports or lists (a lazy export's string) `name`."""
    try:
        data = path.read_bytes()
    except OSError:
        return False
    if name.encode() not in data:  # the plain search first: fast
        return False
    defined = re.compile(rf"^\s*(?:def|class|async def)\s+{re.escape(name)}\b|^\s*{re.escape(name)}\s*[:=]|"
                         rf"[\"']{re.escape(name)}[\"']|\bimport\s+(?:[\w.]+\s+as\s+)?{re.escape(name)}\b|"
                         rf"\bas\s+{re.escape(name)}\b", re.MULTILINE)
    return defined.search(data.decode(errors="replace")) is not None


def version_key(version: str) -> tuple:
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])


def importer_of(f: Found, package: str) -> str:
    """The package whose code made the import: the innermost frame outside `package`, '' when not shown or when
    it is the user's own script."""
    raised = final_exception(f.log)
    frames = list(raised.frames) if raised else f.log.frames(f.index)
    for frame in reversed(frames):
        if frame.package and frame.package != package:
            return frame.package
    return ""


IMPORT_LINE = r"^\s*from\s+(?P<module>[\w.]+)\s+import\s+\(?[^#\n]*\b{name}\b"
IMPORT_STATEMENT = r"\bfrom\s+(?P<module>[A-Za-z_][\w.]*)\s+import\s+\(?[^#\n`]*?\b{name}\b"  # also inside prose


def full_module(f: Found, module: str, name: str) -> str:
    """The module's whole name when a paste cut it ("from 'tor"): the import statement the traceback quotes."""
    for line in reversed(f.log.lines[max(0, f.index - 8):f.index]):
        m = re.search(IMPORT_LINE.format(name=re.escape(name)), line)
        if m and m.group("module").startswith(module):
            return m.group("module")
    return module


def diagnose(f: Found) -> Diagnosis:
    module, name, submodule = parts(MISSING_NAME.search(f.log.joined(f.index)))
    quoted = None if module else _quoted_import(f.log, name)
    module = quoted[0] if quoted else full_module(f, module, name)
    package = module.split(".")[0]
    # a message without its module was retold: the library named beside the import statement it quotes made it
    importer = (_library_beside(f.log, quoted[1], package) if quoted else "") or importer_of(f, package)
    if not importer and _imports_itself(f, package):
        return _hidden_failure(f, module, name, package)
    here, has = installed_has(module, name, submodule)
    here = here.split("+")[0]  # 2.13.0+cpu: the local build tag names this machine's wheel, not a release
    theirs = f.versions.get(package)
    newer_than_ours = bool(theirs and here and version_key(theirs) > version_key(here))
    d = Diagnosis("missing_name", f"'{name}' is not in the {package} the run imported"
                  + (f" ({package} {theirs})" if theirs else "")
                  + (f", which {importer} imports" if importer else ""), f.line)
    user = importer or "the package that imports it"
    both = f"pip install -U {importer + ' ' if importer else ''}{package}"
    if has and not newer_than_ours:
        d.proposal = Proposal(
            f"upgrade {package}: {package} {here} has '{name}' (`pip install -U {package}`, or `pip install "
            f"{package}=={here}`, the release this project pins)", [],
            f"the run's {package}{' ' + theirs if theirs else ''} predates '{name}', which {user} needs"
            + (f"; if the log's {package} {theirs} should already have it, the script ran another environment's "
               f"{package}: `python -c 'import {package}; print({package}.__version__, {package}.__file__)'` with "
               f"the interpreter that runs it" if theirs else ""))
        d.then.append(Proposal(f"or pin {user} to a release written for the run's {package}", [],
                               "the other direction: keep the environment and match the importer to it"))
    elif has is False and not newer_than_ours:
        upgrade = (f"`pip install -U {importer}`" if importer else
                   "`pip install -U <it>`: the traceback's last frame outside your script names it")
        d.proposal = Proposal(
            f"upgrade {user} to a release written for the newer {package} ({upgrade}), or downgrade {package} to a "
            f"release that still has '{name}'", [],
            f"{package} {here} (this project's pin) does not define '{name}' either: it was removed or renamed in a "
            f"{package} release, and {user} still imports it from there")
    else:
        d.proposal = Proposal(
            f"upgrade {user} together with {package} ({both}), or downgrade {package} to the release {user} was "
            f"written for", [],
            f"'{name}' moved between {package} releases, and the two releases in that environment do not go together"
            + ("" if has is not None else f" ({package} is not installed where the doctor runs, so which release has "
                                           f"'{name}' is not known here)"))
    d.advice.append(f"`pip show {package}{' ' + importer if importer else ''}` in the environment that ran it gives the "
                    "two versions; the importer's release notes or requirements name the range of "
                    f"{package} it supports")
    return d


# compiled packages a project imports inside its own modules (module name -> pip name): built against one torch,
# they fail to load under another, and a project's `try: ... except: pass` turns that into a missing name
COMPILED = {"flash_attn": "flash-attn", "xformers": "xformers", "apex": "apex", "bitsandbytes": "bitsandbytes",
            "mamba_ssm": "mamba-ssm", "causal_conv1d": "causal-conv1d"}


def _imports_itself(f: Found, package: str) -> bool:
    """The import was made by the package's own code (its __init__ importing its submodule)."""
    raised = final_exception(f.log)
    frames = list(raised.frames) if raised else f.log.frames(f.index)
    return bool(frames) and f"/{package}/" in frames[-1].file.replace("\\", "/")


def _hidden_failure(f: Found, module: str, name: str, package: str) -> Diagnosis:
    """A package that cannot import a name from its own submodule: the submodule failed while it was imported, and
    the package (or a try/except in it) hid why - not a release mismatch between two packages."""
    d = Diagnosis("missing_name", f"{package} could not import its own '{name}' from {module}: the import of {module} "
                                  f"failed inside, and the error was hidden", f.line)
    # letters and digits as edges, not \b: `llama_flash_attn_monkey_patch` names flash_attn
    named = [pip for mod, pip in COMPILED.items()
             if mod != package and re.search(rf"(?<![A-Za-z0-9]){mod}(?![A-Za-z0-9])", f.log.text)]
    look = f"`python -c \"import {module}\"` and import the file that defines {name} directly to see the error"
    if named:
        d.proposal = Proposal(
            f"reinstall {named[0]} against the installed torch: pip install {named[0]} --no-build-isolation "
            f"--no-cache-dir (then {look})", [],
            f"the log shows {package} using {named[0]}, a compiled package: built for another torch it fails to load, "
            f"and {package}'s import of {name} fails with it")
    else:
        d.proposal = Proposal(f"see the hidden error: {look}", [],
                              f"'{name}' is {package}'s own, so no release is missing it: its module raised while "
                              f"being imported (most often a compiled dependency built for another torch, or a "
                              f"missing package), and {package} reports only the name")
    return d


def _library_beside(log: Log, index: int, package: str) -> str:
    """A known library other than `package` named on the lines around `index` ("... originates from the deepspeed
    library"), '' when none or several are."""
    near = " ".join(log.lines[max(0, index - 2):index + 3]).lower()
    named = [library for library in LIBRARIES if library != package and re.search(rf"\b{library}\b", near)]
    return named[0] if len(named) == 1 else ""


# --- a call whose signature changed between the caller's and the callee's releases -------------------------------

SIGNATURE = re.compile(r"(?P<func>[\w.]+)\(\) (?:takes (?:from \d+ to )?\d+ positional arguments? but \d+ (?:were|was) "
                       r"given|got an unexpected keyword argument '(?P<kw>\w+)'|missing \d+ required (?:positional|"
                       r"keyword-only) arguments?: (?P<names>[^\n]+))")
CONSTRUCTED = re.compile(r"\b([A-Z]\w*)\($")  # the line ends in building a class: `self.accelerator = Accelerator(`
SELF_CALL = re.compile(r"\bself\.(?P<method>\w+)\((?P<args>[^)]*)\)")
LIBRARIES = ("transformers", "trl", "peft", "accelerate", "deepspeed", "datasets", "torch")


def find_signature(log: Log) -> Optional[int]:
    """A call the callee's signature refuses; not a config key (stated.py reads those against DeepSpeed's keys)."""
    from .settings import deepspeed_fields
    raised = final_exception(log)
    index = raised.index if raised is not None and SIGNATURE.search(raised.headline) else log.last(SIGNATURE)
    if index is None:
        return None
    m = SIGNATURE.search(log.joined(index, following=0))
    return None if m is None or (m.group("kw") and m.group("kw") in deepspeed_fields()) else index


def _find_signature_wrapped(log: Log) -> Optional[int]:
    """The second pass: the message wrapped over two lines (`... keyword argument` / `'name'`)."""
    from .settings import deepspeed_fields
    index = log.first_wrapped(SIGNATURE)
    m = SIGNATURE.search(log.joined(index, following=2)) if index is not None else None
    return None if m is None or (m.group("kw") and m.group("kw") in deepspeed_fields()) else index


find_signature.wrapped = _find_signature_wrapped


@functools.lru_cache(maxsize=16)
def defining_package(qualname: str) -> str:
    """The installed library that defines the class of `Class.method` (DPOTrainer.get_batch_logps -> trl), '' when
    none of them does or the name has no class."""
    if "." not in qualname:
        return ""
    cls = qualname.split(".")[-2]
    pattern = re.compile(rf"^class\s+{re.escape(cls)}\b", re.MULTILINE)
    for package in LIBRARIES:
        dist = distribution_of(package)
        root = Path(dist.locate_file(package)) if dist else None
        if root is None or not root.is_dir():
            continue
        for path in root.rglob("*.py"):
            try:
                data = path.read_bytes()
            except OSError:
                continue
            if f"class {cls}".encode() in data and pattern.search(data.decode(errors="replace")):
                return package
    return ""


def diagnose_signature(f: Found) -> Diagnosis:
    m = SIGNATURE.search(f.log.joined(f.index, following=0)) or SIGNATURE.search(f.log.joined(f.index, following=2))
    func = m.group("func")
    raised = final_exception(f.log)
    frames = list(raised.frames) if raised else f.log.frames(f.index)
    site = frames[-1] if frames else None
    caller = site.package if site else ""
    call = SELF_CALL.search(site.code) if site and site.code else None
    ours = any(not fr.package and not fr.file.startswith("<") for fr in frames)
    if caller and call and call.group("method") == func.split(".")[-1] and ours:
        d = Diagnosis("signature", f"{caller} calls self.{call.group('method')}({call.group('args')}) and your "
                                   f"override of {call.group('method')}() does not take that", f.line)
        d.proposal = Proposal(
            f"give your subclass's {call.group('method')}() the arguments {caller} now passes - "
            f"self.{call.group('method')}({call.group('args')}): add them, e.g. `def {call.group('method')}(self, "
            f"{', '.join(a.strip() + ('=None' if i else '') for i, a in enumerate(call.group('args').split(',')) if a.strip())})`"
            f", or pin {caller} to the release your code was written for", [],
            f"{caller}'s own code ({site.file.split('site-packages/')[-1]}) calls the method with a signature a newer "
            f"{caller} introduced; the override in your script still has the old one")
        return d
    if "." not in func and site and site.code and (built := CONSTRUCTED.search(site.code)):
        func = f"{built.group(1)}.{func}"  # __init__() of the class the raising line builds: `Accelerator(`
    callee = defining_package(func) or (site.package if site and m.group("kw") else "")
    user = caller if caller and caller != callee else "the package that calls it"
    refused = f" ('{m.group('kw')}')" if m.group("kw") else ""
    d = Diagnosis("signature", f"{func}() is called with arguments{refused} its {callee or 'installed'} release does "
                               f"not take: a version mismatch", f.line)
    d.proposal = Proposal(
        f"match the versions: upgrade {user} to a release written for the installed {callee or 'library'}, or "
        f"downgrade {callee or 'the library'} to the release {user} was written for (its requirements file pins it)",
        [], f"{func}()'s signature changed between releases"
        + (f" ('{m.group('kw')}' is not one of its arguments in this one)" if m.group("kw") else "")
        + ("; the call comes from your own script: match it to the installed release's signature" if not caller
           and frames else ""))
    return d


# --- a keyword transformers passes that the model's forward does not take -------------------------------------------

# transformers checks model_kwargs against the signature of the model's forward: a forward replaced by a patching
# package (Liger's, unsloth's) or a model's own remote code written for an older transformers lacks a keyword the
# installed transformers now passes
UNUSED_KWARGS = re.compile(r"The following `?model_kwargs`? are not used by the model: \[(?P<names>[^\]]*)\]")
PATCHERS = re.compile(r"\b(liger[_-]kernel|liger|unsloth)\b", re.IGNORECASE)
TRANSFORMERS_SEEN = re.compile(r"transformers[^\n]{0,40}?\bv?(?P<version>\d+\.\d+\.\d+)", re.IGNORECASE)


def diagnose_unused_kwargs(f: Found) -> Diagnosis:
    names = UNUSED_KWARGS.search(f.log.joined(f.index)).group("names")
    patcher = PATCHERS.search(f.log.text)
    seen = TRANSFORMERS_SEEN.search(f.log.text)
    release = f" {seen.group('version')}" if seen else ""
    d = Diagnosis("signature", f"the model's forward does not take {names}, which transformers{release} passes", f.line)
    if patcher:
        package = "liger-kernel" if patcher.group(1).lower().startswith("liger") else patcher.group(1).lower()
        d.proposal = Proposal(f"upgrade {package} (pip install -U {package}) to a release written for "
                              f"transformers{release}, or train without its patching", [],
                              f"{package} replaces the model's forward with its own; transformers{release} passes "
                              f"{names}, which that forward was not written to take, and refuses a keyword the "
                              "forward's signature lacks")
        return d
    d.proposal = Proposal(f"update the model's own code (its trust_remote_code modeling file, a newer revision) or pin "
                          f"transformers to the release it was written for", [],
                          f"transformers{release} passes {names} and checks them against the forward's signature; a "
                          "forward that lacks them was written for another release (a typo in generate's arguments "
                          "shows up the same way)")
    return d
