"""A library's own defect: a programming error (AttributeError, TypeError, NameError) or a broken invariant of its
own bookkeeping (IndexError, a bare assert, an index past a tensor's end) raised inside an installed library's code,
with no class above for it and nothing of the run's config in the message.

Which release fixes it is read from the installed source (installed.py), not guessed: where the installed release
(DeepSpeed at this trainer's pin) still runs the very line that raised, upgrading to it does not help, and the fix is
the library's patch for it or the release that last worked; where that line changed or its function is gone, the
installed release is the upgrade to try. A line the log quotes without its frame (a traceback cut to its last line)
is found in the installed libraries by its rarest name.
"""
from __future__ import annotations

import re
from typing import Optional

from ..findings import Diagnosis, Found, Proposal
from ..installed import Compared, Place, compare, locate
from ..logtext import Frame
from ..raised import final_exception
from .binaries import PIP_NAMES

PROGRAMMING_ERRORS = ("AttributeError", "TypeError", "NameError", "UnboundLocalError")
INVARIANT_ERRORS = ("IndexError", "ZeroDivisionError", "StopIteration")
# an index computed by the library past a tensor it sliced (narrow, select, index_select with its own offsets)
PAST_THE_END = re.compile(r"(exceeds dimension size|is out of bounds for dimension|out of range \(expected to be in "
                          r"range of)")
QUOTED_FRAME = re.compile(r'"(?P<file>[^"]+\.py)", line (?P<line>\d+), in (?P<func>[\w<>]+)')
NOT_A_LIBRARY = {"", "torch", "trainer", "python", "site-packages"}
CARETS = re.compile(r"^[\s~^]+$")
RANK = re.compile(r"^\s*\[(?:rank|default)?\d+\]:\s?")


def internal(raised) -> bool:
    """An exception that says the library's code is wrong, not its input: a programming error, a broken invariant,
    an assert with no words of its own, or an index the library computed past a tensor's end."""
    if raised.name in PROGRAMMING_ERRORS + INVARIANT_ERRORS:
        return True
    if raised.name == "AssertionError":
        return not re.search(r"[A-Za-z]{3,}\s+[A-Za-z]{3,}", raised.message)
    return raised.name == "RuntimeError" and bool(PAST_THE_END.search(raised.message))


def library_frame(log, raised) -> Optional[tuple[str, str]]:
    """(package, file:function) of the innermost frame, when it lies in an installed library other than torch."""
    frames = [(fr.package, f"{fr.file.split('site-packages/')[-1]} ({fr.func})") for fr in raised.frames]
    if not frames:  # a frame pasted without its "File" word ('error : "/x/site-packages/p/m.py", line 254, in f')
        for line in reversed(log.lines[max(0, raised.index - 6):raised.index]):
            m = QUOTED_FRAME.search(line)
            if m and "site-packages/" in m.group("file"):
                path = m.group("file").split("site-packages/")[-1]
                frames = [(path.split("/")[0].removesuffix(".py"), f"{path} ({m.group('func')})")]
                break
    if not frames or frames[-1][0] in NOT_A_LIBRARY:
        return None
    return frames[-1]


def quoted_line(log, raised) -> str:
    """The source line printed right above the exception (and its carets) of a traceback cut to its last frame."""
    for line in reversed(log.lines[max(0, raised.index - 3):raised.index]):
        line = RANK.sub("", line)
        if line.strip() and not CARETS.match(line):
            return line.strip() if re.search(r"[=(.\[]", line) and not line.strip().startswith("File ") else ""
    return ""


def _where(log, raised) -> Optional[tuple[str, str, Optional[Compared]]]:
    """(package, where, the raising line against the installed release) for an exception raised in a library."""
    innermost = raised.frames[-1] if raised.frames else None
    if innermost is not None and innermost.package in NOT_A_LIBRARY - {""}:
        return None  # torch's own code (an op refusing its input), or this trainer's: not a library's defect
    compared = compare(innermost) if innermost else None
    if compared is not None:
        place = compared.place
        return place.package, f"{place.file} ({place.function})", compared
    frame = library_frame(log, raised)
    if frame is not None:
        return frame[0], frame[1], None
    code = quoted_line(log, raised) if not raised.frames else ""
    place = locate(code) if code else None
    if place is None:
        return None
    state = "same" if place.code == code else "changed"
    return place.package, f"{place.file} ({place.function})", Compared(place, state)


def find(log) -> Optional[int]:
    raised = final_exception(log)
    if raised is None or not internal(raised) or _where(log, raised) is None:
        return None
    return raised.index


def diagnose(f: Found) -> Diagnosis:
    raised = final_exception(f.log)
    package, where, compared = _where(f.log, raised)
    pip_name = PIP_NAMES.get(package, package.replace("_", "-"))
    seen = f.versions.get(package)
    kind = "a programming error" if raised.name in PROGRAMMING_ERRORS else "a broken invariant of its own bookkeeping"
    d = Diagnosis("library_bug", f"{raised.name} inside {package}'s own code ({where})", f.line)
    said = (f"{raised.headline.rstrip(chr(34) + '.')} is {kind} raised inside {package} itself, with nothing of the "
            f"run's config in it")
    if compared is not None and compared.state == "same":
        d.proposal = _still_there(pip_name, compared.place, said, seen)
        return d
    if compared is not None:
        place = compared.place
        changed = (f"{pip_name} {place.version} (installed here) no longer has {place.function} in {place.file}"
                   if compared.state == "gone" else
                   f"{pip_name} {place.version} (installed here) runs another line there: `{place.code}` "
                   f"({place.short()})")
        d.proposal = Proposal(f"upgrade {pip_name} to {place.version} (pip install {pip_name}=={place.version})"
                              + (f": the run had {seen}" if seen else ""), [],
                              f"{said}; {changed}: the code that raised it is not the installed release's, and this "
                              f"trainer runs and tests that release")
        d.then.append(Proposal(f"or, if this began with an upgrade of {pip_name}: go back to the release that last "
                               f"worked (pip install {pip_name}==THAT_VERSION)", [], "a regression of the release in "
                               "between; report it with the traceback"))
        return d
    d.proposal = Proposal(
        f"upgrade {pip_name} (pip install -U {pip_name})" + (f": the run had {seen}" if seen else ""), [],
        f"{said}: most often a defect of that release that a later one fixed (its changelog or issue tracker "
        f"names it)")
    d.then.append(Proposal(f"if the latest {pip_name} fails the same way: report it to {pip_name} with the traceback "
                           f"and `pip show {pip_name} torch transformers`", [], "then pin the last release that worked"))
    return d


def _still_there(pip_name: str, place: Place, said: str, seen: Optional[str]) -> Proposal:
    script = place.file.rsplit("/", 1)[-1]
    return Proposal(
        f"take {pip_name}'s fix for {script} ({place.function}) from its issue tracker or main branch, or go back to "
        f"the {pip_name} release that last worked for this", [],
        f"{said}; {pip_name} {place.version} (installed here"
        + (f"; the run had {seen}" if seen else "") + f") still runs the same line in {place.function} "
        f"({place.short()}: `{place.code}`), so upgrading to it does not fix this: a patch after it, or a "
        f"release before the defect, does. Report it with the traceback if no issue names it")
