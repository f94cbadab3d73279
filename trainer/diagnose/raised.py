"""The exception a log ends in, read as a structure: its type and message, the frame that raised it (file,
function, line), the rank that printed it and the exceptions chained before it.

Ranks print their tracebacks at the same time, so a pasted log interleaves them line by line (`[rank0]:` and
`[rank1]:` prefixes, torchrun's `[default0]:`): the traceback is read from the lines of the rank whose exception
it is only. A chained exception ("The above exception was the direct cause of the following exception",
"During handling of the above exception, another exception occurred") keeps the earlier ones as its `chain`,
first cause first; the raising frame is the innermost frame of the final exception's own traceback.
"""
from __future__ import annotations

import builtins
import re
from dataclasses import dataclass
from typing import Optional

from .logtext import EXCEPTION, Frame, Log

RANK_PREFIX = re.compile(r"^\s*(?:(?P<host>[\w.-]+)(?<!Error)(?<!Exception)(?<!Warning)(?<!Exit)(?<!Interrupt): (?=\[|Traceback|\s|(?:\w+\.)*[A-Z]\w*(?:Error|Exception)))?"
                         r"(?:\[(?:rank|default)?(?P<rank>\d+)\]:\s?)?")  # pdsh's "host: ", "[rank3]: "
# an exception line after the prefixes that say who printed it, found by one search of the whole log
PREFIXED_EXCEPTION = re.compile(RANK_PREFIX.pattern + r"(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt)\b:?")
# a Python frame; pasted logs may start the line mid-way through the path ('/trl/trainer/x.py", line 269, in f')
FRAME_LINE = re.compile(r'(?:File "|^\s*(?=[^\s"]*[\\/][^"]*", line \d))(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>[\w<>.]+)')
# a rich traceback's frame, "│ /path/modeling_utils.py:2364 in from_pretrained │", which rich wraps inside its box
RICH_FRAME = re.compile(r"(?P<file>(?:[\w.~-]*[\\/])+[\w.-]+\.py):\s*(?P<line>\d+)\s+in\s+(?P<func>[\w<>]+)")
BOX = re.compile(r"^\s*[│|╭╰]\s?(?P<inner>.*?)\s*[│|╮╯]?\s*$")
FRAME_RUN_LINES = 400  # without a 'Traceback' header, the frames of the lines before the exception, this far back
EXCEPTION_LINE = re.compile(r"^(?P<type>(?:[A-Za-z_]\w*\.)*[A-Z]\w*(?:Error|Exception|Exit|Interrupt|Warning)|"
                            r"(?:[A-Za-z_]\w*\.)+[A-Z]\w*)(?::\s?(?P<message>.*))?$")
CHAINED = re.compile(r"(The above exception was the direct cause of the following exception|During handling of the "
                     r"above exception, another exception occurred)")
MESSAGE_LINES = 12  # lines after the exception line that may continue its message (pydantic's error list)
SEARCH_BACK = 4000  # lines before the exception that its traceback may start at (interleaved ranks spread it out)


@dataclass(frozen=True)
class Site:
    """Where an exception was raised: the innermost frame of its traceback."""
    file: str
    function: str
    line: int
    code: str = ""

    @property
    def package(self) -> str:
        return Frame(self.file, self.function).package

    def short(self) -> str:
        path = re.split(r"(?:site|dist)-packages[\\/]", self.file)[-1]
        return f"{path}:{self.line} in {self.function}"


@dataclass(frozen=True)
class Raised:
    """The final exception of a log."""
    type: str
    message: str
    index: int                          # the exception line's index in the log
    site: Optional[Site] = None
    frames: tuple[Frame, ...] = ()      # outermost first
    rank: Optional[int] = None
    chain: tuple[tuple[str, str], ...] = ()  # (type, first message line) of the exceptions before it

    @property
    def name(self) -> str:
        return self.type.rsplit(".", 1)[-1]

    @property
    def headline(self) -> str:
        first = self.message.split("\n", 1)[0]
        return f"{self.name}: {first}" if first else self.name

    def as_json(self) -> dict:
        out = {"type": self.type, "message": self.message, "rank": self.rank,
               "chain": [{"type": t, "message": m} for t, m in self.chain]}
        if self.site:
            out["site"] = {"file": self.site.file, "function": self.site.function, "line": self.site.line,
                           "code": self.site.code}
        return out


def unprefixed(line: str) -> tuple[tuple, str]:
    """((host, rank), the line without the prefixes that say who printed it); None for a prefix not there."""
    match = RANK_PREFIX.match(line)
    rank = match.group("rank")
    return (match.group("host"), int(rank) if rank else None), line[match.end():] if match.end() else line


# What a launcher raises when a rank failed: it reports the rank's exception, it is not the failure.
LAUNCHER_WRAPPERS = re.compile(r"\b(ChildFailedError|CalledProcessError)\b")


def final_exception(log: Log) -> Optional[Raised]:
    """The last exception line of the log with its traceback, read from its rank's lines only; a launcher's
    report that a rank failed (torchrun's ChildFailedError) gives way to the rank's own exception before it."""
    index = log.last(PREFIXED_EXCEPTION)
    if index is None:
        return _frames_only(log) or _told_in_prose(log)
    if LAUNCHER_WRAPPERS.search(log.lines[index]):
        index = next((i for i in range(index - 1, max(-1, index - SEARCH_BACK), -1)
                      if PREFIXED_EXCEPTION.match(log.lines[i]) and not LAUNCHER_WRAPPERS.search(log.lines[i])),
                     index)
    who, _ = unprefixed(log.lines[index])
    rank = who[1]
    own = [(i, text) for i in range(max(0, index - SEARCH_BACK), index + MESSAGE_LINES + 1)
           if i < len(log.lines) for r, text in [unprefixed(log.lines[i])] if r == who]
    position = next(k for k, (i, _) in enumerate(own) if i == index)
    before = [text for _, text in own[:position]]
    start = _traceback_start(before)
    if start is None:  # a pasted tail without its header: the frames after the previous exception, if any
        start = _frame_run_start(before)
    if start is None and who != (None, None):  # the rank's frames pasted without its prefix
        own = [(i, text) for i in range(max(0, index - SEARCH_BACK), index + MESSAGE_LINES + 1)
               if i < len(log.lines) for r, text in [unprefixed(log.lines[i])] if r in (who, (None, None))]
        position = next(k for k, (i, _) in enumerate(own) if i == index)
        before = [text for _, text in own[:position]]
        start = _traceback_start(before)
        start = _frame_run_start(before) if start is None else start
    blocks = _split_chain(before[start:] if start is not None else [])
    header = EXCEPTION_LINE.match(own[position][1].strip())
    kind = header.group("type") if header else own[position][1].strip().split(":")[0]
    message = _message(own[position][1].strip(), [text for _, text in own[position + 1:]], header)
    frames = _frames(blocks[-1] if blocks else [])
    chain = tuple(_chained(block) for block in blocks[:-1])
    site = None
    if frames:
        file, func, line, code = frames[-1]
        site = Site(file, func, line, code)
    return Raised(kind, message, index, site, tuple(Frame(f, fn, c) for f, fn, _, c in frames), rank,
                  tuple(c for c in chain if c))


RAISE = re.compile(r"\braise\s+((?:[A-Za-z_]\w*\.)*[A-Z]\w*)")


def _frames_only(log: Log) -> Optional[Raised]:
    """A log that ends in frames without an exception line (a rich traceback cut before its last line): the site
    is the innermost frame of the last lines, the type what its source line raises, when it says."""
    lines = [unprefixed(line)[1] for line in log.lines[-FRAME_RUN_LINES:]]
    start = _frame_run_start(lines)
    if start is None:
        return None
    frames = _frames(lines[start:])
    file, func, line, code = frames[-1]
    raised = RAISE.search(code)
    return Raised(raised.group(1) if raised else "", "", len(log.lines) - 1, Site(file, func, line, code),
                  tuple(Frame(f, fn, c) for f, fn, _, c in frames))


# an exception retold in a sentence, not printed by Python: "I got value error: Target modules ... not found",
# "遇到了 runtime error：CUDA ..." (the type in words, any case, a colon of either width)
TOLD = re.compile(r"(?<![A-Za-z])(?P<words>[A-Za-z]+[ _]?(?:error|exception))\s*[:：]\s*(?P<message>\S.*)", re.IGNORECASE)


def _told_in_prose(log: Log) -> Optional[Raised]:
    """A log with no exception line and no frames, where the user retold the exception in a sentence: its type
    spelt as Python spells it ("value error" -> ValueError) and the message after the colon. The last such line of
    the log's last lines (a description is short). Only Python's own exception types count: a bare "ERROR:" is a
    log level (pip's "ERROR: Could not find a version that satisfies the requirement torch==X" states no
    requirement of the run), "CUDA error:" a library's own report."""
    lines = log.lines[-FRAME_RUN_LINES:]
    for offset in range(len(lines) - 1, -1, -1):
        m = TOLD.search(lines[offset])
        if not m:
            continue
        words = re.findall(r"[A-Za-z]+", m.group("words"))
        kind = "".join(w[:1].upper() + w[1:].lower() for w in words)
        if isinstance(getattr(builtins, kind, None), type) and issubclass(getattr(builtins, kind), BaseException):
            return Raised(kind, m.group("message").strip(), len(log.lines) - len(lines) + offset)
    return None


def _traceback_start(lines: list[str]) -> Optional[int]:
    """Where the final exception's traceback (and the chain before it) starts: the first 'Traceback' line of the
    last run of tracebacks joined by chaining lines."""
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith("Traceback")]
    if not starts:
        return None
    first = starts[-1]
    for earlier in reversed(starts[:-1]):
        between = lines[earlier:first]
        if any(CHAINED.search(line) for line in between):
            first = earlier
        else:
            break
    return first


def _frame_run_start(lines: list[str]) -> Optional[int]:
    """Where the frames printed before an exception start when no 'Traceback' line introduces them: after the last
    earlier exception line, within FRAME_RUN_LINES lines; None when those lines hold no frame."""
    lowest = max(0, len(lines) - FRAME_RUN_LINES)
    start = next((i + 1 for i in range(len(lines) - 1, lowest - 1, -1)
                  if EXCEPTION_LINE.match(lines[i].strip()) and not FRAME_LINE.search(lines[i])), lowest)
    return start if _frames(lines[start:]) else None


def _split_chain(lines: list[str]) -> list[list[str]]:
    blocks: list[list[str]] = [[]]
    for line in lines:
        if CHAINED.search(line):
            blocks.append([])
        else:
            blocks[-1].append(line)
    return [b for b in blocks if b]


def _frames(lines: list[str]) -> list[tuple[str, str, int, str]]:
    found = []
    for i, line in enumerate(lines):
        match = FRAME_LINE.search(line)
        if match:
            code = lines[i + 1].strip() if i + 1 < len(lines) and not FRAME_LINE.search(lines[i + 1]) else ""
            found.append((match.group("file").strip(), match.group("func"), int(match.group("line")), code))
    return found or _rich_frames(lines)


def _rich_frames(lines: list[str]) -> list[tuple[str, str, int, str]]:
    """The frames of a rich traceback: the box's lines joined (rich wraps a long path or the function name onto
    the next line), each 'path.py:LINE in function' a frame; the source line is rich's ❱ line after it."""
    inner = [m.group("inner") if (m := BOX.match(line)) else "" for line in lines]
    text, found = " ".join(inner), []
    for match in RICH_FRAME.finditer(text):
        code = re.search(r"❱\s*\d+[\s│|]*([^│|]+)", text[match.end():match.end() + 2000])
        found.append((match.group("file"), match.group("func"), int(match.group("line")),
                      re.sub(r"\s+\d+$", "", code.group(1).strip()) if code else ""))
    return found


def _chained(block: list[str]) -> Optional[tuple[str, str]]:
    for line in reversed(block):
        header = EXCEPTION_LINE.match(line.strip())
        if header and not FRAME_LINE.search(line):
            return header.group("type"), (header.group("message") or "").strip()
    return None


def _message(line: str, following: list[str], header: Optional[re.Match]) -> str:
    """The exception's message: the rest of its line and the lines that continue it (wrapped text, the error
    list pydantic prints), up to a blank line, a new traceback or a log record."""
    lines = [(header.group("message") or "").strip() if header else line]
    for text in following[:MESSAGE_LINES]:
        stripped = text.strip()
        if not stripped or stripped.startswith(("Traceback", "File ", "[20", "[W", "[E", "[I")) or \
                EXCEPTION.search(stripped) or re.match(r"^\[?\d{4}-\d\d-\d\d", stripped) or CHAINED.search(stripped):
            break
        lines.append(stripped)
    return "\n".join(line for line in lines if line or len(lines) == 1).strip()
