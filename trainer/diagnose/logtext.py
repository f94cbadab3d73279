"""A pasted log as the recognisers read it: line endings normalised, lines searchable, tracebacks found.

What users paste is rarely a clean file: Windows line endings, progress bars redrawn with carriage returns
(tqdm's "| 4/8 [02:10<02:22]Killed" when the shell's "Killed" lands on the bar's line), `[rankN]:` prefixes,
rich-formatted tracebacks and exception messages wrapped over several lines.
"""
from __future__ import annotations

import bisect
import functools
import re
from collections import deque
from dataclasses import dataclass
from typing import Optional

from .. import files

EVIDENCE_CHARS = 300  # an evidence line longer than this is cut (a 2 kB CUDA OOM message, a launcher argv)
# The most lines read back from an exception for its traceback. Python collapses a recursion's repeated frames
# ("[Previous line repeated 996 more times]"), so real tracebacks are far shorter; the bound keeps a log of
# 200,000 exceptions under one early "Traceback" line linear.
TRACEBACK_LINES = 1000
WRAPPED_LINES = 8  # the most lines one wrapped message is read over (a terminal's 80 columns: 640 characters)

# The exception line of a traceback: `RuntimeError: ...`, `torch.OutOfMemoryError: ...`, `[rank3]: Foo: ...`
EXCEPTION = re.compile(r"^(?:\[rank\d+\]:\s*)?(?:[A-Za-z_][\w]*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt)\b:?")
ERROR_WORDS = re.compile(r"(Error|Exception|error:|FAILED|fatal|Killed)", re.IGNORECASE)
PY_FRAME = re.compile(r'File "(?P<file>[^"]+)", line \d+, in (?P<func>[\w<>.]+)')
RICH_FRAME = re.compile(r"(?P<file>[\w./\\~:-]+\.py):\d+ in (?P<func>[\w<>]+)")
SPY_FRAME = re.compile(r"^\s*(?P<func>[\w<>.]+) \((?P<file>[^()\s]+\.py):\d+\)\s*$")


# A line that starts a record of its own, never the continuation of a wrapped message: a timestamp, a log level,
# a rank or host prefix, a traceback's lines, an exception line
RECORD_START = re.compile(r"^\s*(?:\[?\d{4}-\d\d-\d\d|\[?\d\d:\d\d:\d\d|[IWEF]\d{4} |\[(?:rank|default)?\d+\]|"
                          r"\[(?:INFO|WARNING|ERROR|DEBUG)|(?:INFO|WARNING|ERROR|DEBUG)\b|[\w.-]+: \[|Traceback|File \"|"
                          r"(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Warning)\b|[#>$|]|\d+%\|)")


def wrapped(line: str, following: str) -> bool:
    """Whether `following` reads as the rest of `line`, cut by a terminal's or a paste's wrapping: the line stops
    mid-sentence (no closing punctuation) and the next one starts no record of its own."""
    line, following = line.rstrip(), following.strip()
    return bool(line and following) and line[-1] not in ".!?:;)]}>\"'" and not RECORD_START.match(following)


KNOWN_PACKAGES = ("deepspeed", "transformers", "accelerate", "torch", "peft", "trl", "datasets", "apex",
                  "bitsandbytes", "megatron", "llamafactory", "axolotl", "trainer")


@dataclass(frozen=True)
class Frame:
    """One stack frame: the file (as printed), the function and, in Python tracebacks, its source line."""
    file: str
    func: str
    code: str = ""

    @property
    def package(self) -> str:
        """The top-level package the file belongs to (`deepspeed`, `transformers`, `torch`, ...), or '' for a
        file outside site-packages/dist-packages (the user's script)."""
        parts = re.split(r"[\\/]", self.file)
        for marker in ("site-packages", "dist-packages"):
            if marker in parts and parts.index(marker) + 1 < len(parts):
                return parts[parts.index(marker) + 1].removesuffix(".py")
        # py-spy prints paths relative to sys.path (torch/utils/x.py); a vendored copy sits in a project's src/
        return next((part for part in parts[:-1] if part in KNOWN_PACKAGES), "")


@dataclass(frozen=True)
class Log:
    lines: tuple[str, ...]

    @classmethod
    def of(cls, raw: str) -> "Log":
        # \r\n (Windows), then a bare \r (a redrawn progress bar): each redraw is a line of its own
        lines = [unquoted(line) for line in raw.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
        return cls(tuple(collapse_repeats(lines)[0]))

    @functools.cached_property
    def text(self) -> str:
        return "\n".join(self.lines)

    @functools.cached_property
    def _starts(self) -> list[int]:
        """Each line's offset in `text`."""
        starts, at = [], 0
        for line in self.lines:
            starts.append(at)
            at += len(line) + 1
        return starts

    def _line_at(self, offset: int) -> int:
        return bisect.bisect_right(self._starts, offset) - 1

    def first(self, pattern: re.Pattern, start: int = 0) -> Optional[int]:
        """The first line from `start` the pattern matches. Only the lines that hold one of the pattern's needles
        (`needles`: literal text every match contains, found with str.find, in C) are matched; a pattern without
        needles is searched over the whole text at once (in C, not line by line in Python); a match that starts
        on a line but only matches across the line break is checked against that line alone and passed over."""
        candidates = self._candidates(pattern)
        if candidates is not None:
            for index in candidates[bisect.bisect_left(candidates, start):]:
                if pattern.search(self.lines[index]):
                    return index
            return None
        text, whole = self.text, _per_line(pattern)
        at = self._starts[start] if start < len(self.lines) else len(text) + 1
        while at <= len(text):
            found = whole.search(text, at)
            if found is None:
                return None
            index = self._line_at(found.start())
            if pattern.search(self.lines[index]):
                return index
            at = self._starts[index + 1] if index + 1 < len(self.lines) else len(text) + 1
        return None

    def last(self, pattern: re.Pattern) -> Optional[int]:
        """The last line the pattern matches: the candidate lines last first (as `first`), else from one search of
        the whole text: every line that matches alone lies within the span of some whole-text match (a match
        starting earlier may run over it), so the lines of those spans, last first, are the only ones checked."""
        candidates = self._candidates(pattern)
        if candidates is not None:
            return next((index for index in reversed(candidates) if pattern.search(self.lines[index])), None)
        spans = [(m.start(), max(m.start(), m.end() - 1)) for m in _per_line(pattern).finditer(self.text)]
        for start, end in reversed(spans):
            for index in range(self._line_at(end), self._line_at(start) - 1, -1):
                if pattern.search(self.lines[index]):
                    return index
        return None

    def first_wrapped(self, pattern: re.Pattern) -> Optional[int]:
        """For a pattern no single line matches: the line where it matches a message that a terminal or a paste
        wrapped over several lines ("NVIDIA H100 PCIe with CUDA capability" / "sm_90 is not compatible with the
        current PyTorch installation."), read with its lines joined by spaces (`paragraphs`). Only the messages
        holding one of the pattern's needles are searched; None for a pattern without needles."""
        found = needles(pattern)
        if not found:
            return None
        text, starts, first_lines = self._paragraphs
        haystack, offsets = self._folded_paragraphs if pattern.flags & re.IGNORECASE else (text, starts)
        hits = sorted({bisect.bisect_right(offsets, at) - 1 for needle in found
                       for at in _all_finds(haystack, needle)})
        for paragraph in hits:
            end = starts[paragraph + 1] - 1 if paragraph + 1 < len(starts) else len(text)
            match = pattern.search(text, starts[paragraph], end)
            if match:
                return self._line_in_paragraph(first_lines[paragraph], match.start() - starts[paragraph])
        return None

    @functools.cached_property
    def _paragraphs(self) -> tuple[str, list[int], list[int]]:
        """The log with each wrapped message's lines joined by a space (at most WRAPPED_LINES lines): the text, each
        paragraph's offset in it and its first line. Built once, on the first wrapped search."""
        parts, starts, first_lines, at, index = [], [], [], 0, 0
        while index < len(self.lines):
            end = index
            while end + 1 < len(self.lines) and end - index + 1 < WRAPPED_LINES and \
                    wrapped(self.lines[end], self.lines[end + 1]):
                end += 1
            paragraph = " ".join(line.strip() for line in self.lines[index:end + 1])
            parts.append(paragraph)
            starts.append(at)
            first_lines.append(index)
            at += len(paragraph) + 1
            index = end + 1
        return "\n".join(parts), starts, first_lines

    @functools.cached_property
    def _folded_paragraphs(self) -> tuple[str, list[int]]:
        """The paragraphs case-folded (`fold`; a folded paragraph may differ in length), with their offsets."""
        text, _, _ = self._paragraphs
        folded = [fold(paragraph) for paragraph in text.split("\n")]
        offsets, at = [], 0
        for paragraph in folded:
            offsets.append(at)
            at += len(paragraph) + 1
        return "\n".join(folded), offsets

    def _line_in_paragraph(self, first: int, offset: int) -> int:
        """The line of a paragraph starting at line `first` that holds the paragraph's character `offset`."""
        index, at = first, 0
        while index + 1 < len(self.lines):
            at += len(self.lines[index].strip()) + 1
            if at > offset:
                break
            index += 1
        return index

    def _candidates(self, pattern: re.Pattern) -> Optional[list[int]]:
        """The lines, in order, that hold one of the pattern's needles (None: the pattern has none). Each needle is
        found with str.find over the whole text (over its case-folded copy for a case-insensitive pattern), a line
        counted once: linear in the log, at memchr's speed rather than the regex engine's."""
        found = self._candidate_cache.get(pattern)
        if found is None and pattern not in self._candidate_cache:
            found = self._find_candidates(pattern)
            self._candidate_cache[pattern] = found
        return found

    def _find_candidates(self, pattern: re.Pattern) -> Optional[list[int]]:
        found = needles(pattern)
        if found is None:
            return None
        folded = bool(pattern.flags & re.IGNORECASE)
        text, starts = (self._folded if folded else (self.text, self._starts))
        lines: set[int] = set()
        for needle in found:
            at = text.find(needle)
            while at != -1:
                index = bisect.bisect_right(starts, at) - 1
                lines.add(index)
                at = text.find(needle, starts[index + 1]) if index + 1 < len(starts) else -1
        return sorted(lines)

    @functools.cached_property
    def _candidate_cache(self) -> dict:
        return {}

    @functools.cached_property
    def _folded(self) -> tuple[str, list[int]]:
        """The text case-folded as the regex engine folds for IGNORECASE (`fold`), with each line's offset."""
        starts, at, folded = [], 0, []
        for line in self.lines:
            line = fold(line)
            starts.append(at)
            at += len(line) + 1
            folded.append(line)
        return "\n".join(folded), starts

    def ends(self, lines: int = 3000) -> str:
        """The first and the last `lines` lines: where a log states its setting (versions, GPUs, the command,
        exports) and its end; a bound on what reading those facts costs in a log of any length."""
        if len(self.lines) <= 2 * lines:
            return self.text
        return "\n".join(self.lines[:lines] + self.lines[-lines:])

    def all(self, pattern: re.Pattern) -> list[re.Match]:
        candidates = self._candidates(pattern)
        lines = self.lines if candidates is None else [self.lines[index] for index in candidates]
        return [m for line in lines for m in pattern.finditer(line)]

    def has(self, pattern: re.Pattern) -> bool:
        return self.first(pattern) is not None

    def line(self, index: int) -> str:
        return self.lines[index].strip()

    def joined(self, index: int, following: int = 3) -> str:
        """A line with the next ones joined: exception messages that a terminal or rich wrapped."""
        return " ".join(line.strip() for line in self.lines[index:index + 1 + following])

    def before(self, index: int, count: int = 40) -> str:
        return "\n".join(self.lines[max(0, index - count):index + 1])

    @functools.cached_property
    def _traceback_headers(self) -> list[int]:
        """The lines that say 'Traceback', in order: one search of the whole text, then a bisect per exception
        (a scan back from each exception was quadratic in a log of many exceptions)."""
        return sorted({self._line_at(m.start()) for m in re.finditer("Traceback", self.text)})

    def traceback_of(self, index: int) -> str:
        """From the last 'Traceback' at or before `index` (a few lines earlier: the progress bars of a load)
        up to `index`, at most TRACEBACK_LINES lines; the 40 lines before it when there is no traceback."""
        headers = self._traceback_headers
        at = bisect.bisect_right(headers, index) - 1
        if at < 0:
            return self.before(index)
        start = max(0, headers[at] - 5, index - TRACEBACK_LINES)
        return "\n".join(self.lines[start:index + 1])

    def frames(self, index: int) -> list["Frame"]:
        """The stack frames printed before line `index` (its traceback, else the 40 lines before), outermost
        first: Python tracebacks (`File "x.py", line N, in f` and the source line after it), rich tracebacks
        (`x.py:N in f`) and py-spy dumps (`f (x.py:N)`, innermost first as py-spy prints them)."""
        lines = self.traceback_of(index).split("\n")
        found, spied = [], []
        for i, line in enumerate(lines):
            match = PY_FRAME.search(line) or RICH_FRAME.search(line)
            if match:
                code = lines[i + 1].strip() if PY_FRAME.search(line) and i + 1 < len(lines) else ""
                found.append(Frame(match.group("file"), match.group("func"), code))
            elif (spy := SPY_FRAME.match(line)):
                spied.append(Frame(spy.group("file"), spy.group("func"), ""))
        return found + spied[::-1]  # py-spy prints the innermost frame first

    def last_exception(self) -> Optional[str]:
        index = self.last(EXCEPTION)
        return None if index is None else self.line(index)

    def summary_line(self) -> str:
        """What an unrecognised log is about: its last exception, else its last error-looking line, else its
        last line."""
        found = self.last_exception()
        if found:
            return found
        index = self.last(ERROR_WORDS)
        if index is not None:
            return self.line(index)
        return next((line.strip() for line in reversed(self.lines) if line.strip()), "")


@functools.lru_cache(maxsize=512)
def _per_line(pattern: re.Pattern) -> re.Pattern:
    """The pattern with ^ and $ at line boundaries, to search a whole log at once."""
    return re.compile(pattern.pattern, pattern.flags | re.MULTILINE)


NEEDLE_CHARS = 3  # the shortest literal worth a str.find (shorter ones are in most lines)


@functools.lru_cache(maxsize=512)
def needles(pattern: re.Pattern) -> Optional[frozenset[str]]:
    """Literal texts at least one of which every match of `pattern` contains (folded as `fold` folds, for an
    IGNORECASE pattern), read from the pattern's parse: a run of literal characters, or one needle per branch of an
    alternation every match passes through. None when the pattern promises no such text (then it is searched as
    it is): a line without any needle cannot match, so searching only the lines that hold one finds the same."""
    try:
        parsed = re._parser.parse(pattern.pattern, pattern.flags)  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - a parser of another Python: search the whole text
        return None
    found = _sequence_needles(list(parsed), bool(pattern.flags & re.IGNORECASE))
    return None if found is None else frozenset(found)


def _sequence_needles(items: list, folded: bool) -> Optional[set[str]]:
    """The best needle set of a sequence of parsed items: its longest literal run, or the needles of one item every
    match passes through (a group, an alternation, a repeat of at least once), whichever has the longest shortest
    needle."""
    from re import _constants as sre  # type: ignore[attr-defined]
    repeats = {sre.MAX_REPEAT, sre.MIN_REPEAT, getattr(sre, "POSSESSIVE_REPEAT", sre.MAX_REPEAT)}
    atomic = getattr(sre, "ATOMIC_GROUP", None)
    options: list[set[str]] = []
    run: list[str] = []
    for op, av in items + [(None, None)]:
        if op is sre.LITERAL:
            run.append(chr(av))
            continue
        if len(run) >= NEEDLE_CHARS:
            text = "".join(run)
            options.append({fold(text) if folded else text})
        run = []
        if op is None:
            break
        inner: Optional[set[str]] = None
        if op is sre.SUBPATTERN:
            _group, add_flags, del_flags, body = av
            if (add_flags | del_flags) & re.IGNORECASE:
                return None  # a scoped (?i:...) changes how literals compare: no needles
            inner = _sequence_needles(list(body), folded)
        elif op is sre.BRANCH:
            branches = [_sequence_needles(list(branch), folded) for branch in av[1]]
            inner = None if any(b is None for b in branches) else set().union(*branches)
        elif op in repeats and av[0] >= 1:
            inner = _sequence_needles(list(av[2]), folded)
        elif atomic is not None and op is atomic:
            inner = _sequence_needles(list(av), folded)
        if inner:
            options.append(inner)
    return max(options, key=lambda o: min(map(len, o)), default=None)


def _fold_table() -> dict[int, str]:
    """Every character the regex engine's IGNORECASE takes for another (re._casefix: after lowering, 'ı' is 'i',
    'ſ' is 's', ...) mapped to one of its class."""
    try:
        from re._casefix import _EXTRA_CASES  # type: ignore[import-not-found]
    except ImportError:
        return {}
    return {c: chr(min((c, *others))) for c, others in _EXTRA_CASES.items()}


FOLD_AFTER_LOWER = _fold_table()
FOLD_BEFORE_LOWER = {0x130: "i"}  # 'İ'.lower() is two characters; the engine lowers it to 'i' alone


def fold(text: str) -> str:
    """`text` as the regex engine compares it under IGNORECASE: each character lowered (simple case mapping) and
    mapped to one of the characters the engine takes for it. Two texts the engine matches case-insensitively fold
    to the same text."""
    return text.translate(FOLD_BEFORE_LOWER).lower().translate(FOLD_AFTER_LOWER)


REPEAT_BLOCK_LINES = 64  # the longest block of lines whose back-to-back repeats are collapsed (a traceback per step)
REPEAT_CANDIDATES = 4  # earlier occurrences of a line tried as the start of the block it repeats


INLINE_CODE = re.compile(r"^(\s*)`(?!``)(?P<inner>[^`].*?)`?\s*$")


def unquoted(line: str) -> str:
    """A line pasted as Markdown inline code (`` `RuntimeError: ...` ``) without its backticks, so an exception
    quoted that way starts its line like any other; fences (```) are left alone."""
    m = INLINE_CODE.match(line)
    return f"{m.group(1)}{m.group('inner')}" if m else line


def collapse_repeats(lines: list[str], longest: int = REPEAT_BLOCK_LINES) -> tuple[list[str], list[tuple]]:
    """`lines` with each block of up to `longest` lines that repeats back to back kept once, and where repeats were
    dropped, in order: (index in the result they followed, block length, times repeated). A rank printing the same
    OOM line 200,000 times, or the same warning and traceback every step, is read as one block (no line is added:
    a log that ends in repeated lines still ends in them). Every recogniser then reads each distinct block once, so the doctor
    is linear in the log (it was quadratic in repeated matching lines). Linear here too: a block is tried only at
    the distances to the line's last few occurrences, and the lines a repeat covers are skipped."""
    out: list[str] = []
    dropped: list[tuple] = []
    seen: dict[str, deque] = {}  # line -> its latest indices in `lines`
    i = 0
    while i < len(lines):
        period = _repeat_period(lines, i, seen.get(lines[i], ()), longest)
        times = 0
        while period and lines[i + times * period:i + (times + 1) * period] == lines[i - period:i]:
            times += 1
        step = times * period or 1
        for j in range(i, i + step):
            occurrences = seen.get(lines[j])
            if occurrences is None:
                seen[lines[j]] = occurrences = deque(maxlen=REPEAT_CANDIDATES)
            occurrences.append(j)
        if times:
            dropped.append((len(out) - 1, period, times))
        else:
            out.append(lines[i])
        i += step
    return out, dropped


def _repeat_period(lines: list[str], i: int, earlier, longest: int) -> int:
    """The length of the block ending just before `i` that `lines[i:]` starts repeating, else 0."""
    for start in reversed(earlier):
        period = i - start
        # the block's last line first: most candidates fail there, without copying the block
        if period <= longest and i + period <= len(lines) and lines[i + period - 1] == lines[i - 1] \
                and lines[i:i + period] == lines[start:i]:
            return period
    return 0


def bounded(line: str, limit: int = EVIDENCE_CHARS) -> str:
    return line if len(line) <= limit else line[:limit - 1].rstrip() + "…"


def read_log(path: str) -> Log:
    """The log through the one safe reader (a regular text file, its last 20 MB, long lines cut; empty, binary,
    missing or unreadable logs are named errors)."""
    return Log.of(files.read_log(path))


def _all_finds(text: str, needle: str):
    at = text.find(needle)
    while at != -1:
        yield at
        at = text.find(needle, at + 1)
