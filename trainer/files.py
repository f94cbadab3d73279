"""Every input file read safely and every output file written atomically: the one place where the trainer
touches a user-named file.

Reading: the path must be a regular file (not a directory, a device or a FIFO, which would hang or read
forever) under a size limit, decoded as UTF-8 (`read_log` alone tolerates bad bytes), and of the top-level type
the caller expects (a JSON object, a YAML mapping). YAML refuses duplicate keys (PyYAML keeps the last one
silently) and documents whose aliases expand past a limit ("billion laughs"). Every `OSError` becomes a
`UserError` that names what the file is for and the path.

Writing: to a temporary file beside the target, then renamed over it, so that a full disk, a file-size limit
or a crash leaves the old file (or none), never part of the new one.
"""
from __future__ import annotations

import codecs
import contextlib
import json
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Optional

import yaml

from .errors import UserError, short
from .paths import what_is


MAX_CONFIG_BYTES = 4 << 20     # a preset, a template, a scenario or a config.json is a few KB
MAX_LOG_BYTES = 20 << 20       # doctor reads the last 20 MB of a log: the failure is at the end
MAX_LOG_LINE = 2000            # longer log lines are cut (a progress bar without newlines, a binary blob)
MAX_YAML_NODES = 100_000       # nodes after alias expansion; a preset has a few hundred


# --- reading -------------------------------------------------------------------------------------


def regular_file(path: str | Path, what: str) -> Path:
    """`path` as an existing regular file, or a UserError saying what it is instead."""
    file = Path(path).expanduser()
    found = what_is(file)
    if found == "missing":
        raise UserError(f"{what} {str(path)!r} does not exist")
    if found == "a directory":
        raise UserError(f"{what} {path} is a directory: give a file")
    if found.startswith("unreadable"):
        raise UserError(f"{what} {path}: cannot read it ({found})")
    if found != "a regular file":
        raise UserError(f"{what} {path} is {found}, not a regular file: give a file")
    return file


def read_bytes(path: str | Path, what: str, max_bytes: int = MAX_CONFIG_BYTES, tail: bool = False) -> bytes:
    """The file's bytes; over `max_bytes` it is refused, or with tail=True only its last `max_bytes` are read."""
    file = regular_file(path, what)
    try:
        with open(file, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size > max_bytes and not tail:
                raise UserError(f"{what} {path} is {size:,} bytes, over the {max_bytes:,} a {what} may have: "
                                f"is it the right file?")
            if size > max_bytes:
                handle.seek(size - max_bytes)
            return handle.read(max_bytes + 1)[:max_bytes]  # a file that grows while read is cut, not read on
    except OSError as err:
        raise UserError(f"{what} {path}: cannot read it ({err.strerror})") from None


def read_text(path: str | Path, what: str, max_bytes: int = MAX_CONFIG_BYTES, allow_empty: bool = False,
              also_read_by: str = "") -> str:
    """A UTF-8 text file (a config a person wrote): binary content, bad UTF-8 and (unless allowed) an empty or
    blank file are refused, each naming `what` and the path. A byte-order mark is dropped, unless the file is
    `also_read_by` another program (DeepSpeed's runner reads a hostfile as plain UTF-8: the mark would be part
    of its first host name): then it is refused, so both read the same text."""
    data = read_bytes(path, what, max_bytes)
    if also_read_by and data.startswith(codecs.BOM_UTF8):
        raise UserError(f"{what} {path} line 1: starts with a byte-order mark (an editor's U+FEFF), which "
                        f"{also_read_by} reads as part of the line; save the file without it (UTF-8, no BOM)")
    if b"\0" in data:
        raise UserError(f"{what} {path} is a binary file (it holds NUL bytes), not text: is it the right file?")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[:err.start].count(b"\n") + 1
        raise UserError(f"{what} {path} line {line}: not UTF-8 text (byte {data[err.start]:#04x} at offset "
                        f"{err.start}); save it as UTF-8") from None
    if not text.strip() and not allow_empty:
        raise UserError(f"{what} {path} is empty")
    return text


def read_json_object(path: str | Path, what: str, max_bytes: int = MAX_CONFIG_BYTES) -> dict:
    """A JSON file whose top level is an object; NaN/Infinity (not JSON, though Python writes them) and a key given
    twice in one object refused."""
    text = read_text(path, what, max_bytes)
    try:
        value = json.loads(text, parse_constant=_refuse_constant, object_pairs_hook=unique_members)
    except json.JSONDecodeError as err:
        raise UserError(f"{what} {path} line {err.lineno} column {err.colno}: not valid JSON ({err.msg})") from None
    except ValueError as err:
        raise UserError(f"{what} {path}: {err}") from None
    except RecursionError:
        raise UserError(f"{what} {path}: nested too deeply to be a config") from None
    return _expect_mapping(value, what, path, "a JSON object ({...})")


KEY_MARK = re.compile(r'"\s*:')  # where a JSON object's key ends: at least one per key written


def loads_unique(text: str):
    """json.loads for what users write (data records, prompts): a key given twice in one object, at any depth and
    however spaced or escaped ({"a" : 1, "\\u0061": 2}), is a ValueError naming it, not a silent overwrite. Parsed
    at C speed; read again with the refusing hook only when fewer keys were kept than the text writes."""
    value = json.loads(text)
    if len(KEY_MARK.findall(text)) > _keys_in(value):
        json.loads(text, object_pairs_hook=unique_members)
    return value


def _keys_in(value) -> int:
    count, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            count += len(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


def unique_members(pairs: list) -> dict:
    """JSON keeps the last of two equal keys without a word (DeepSpeed's own reader refuses them): refuse them."""
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate key {short(key, 60)} in one object; JSON would keep only the last: merge them")
        seen[key] = value
    return seen


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number; write a finite number")


def read_yaml_mapping(path: str | Path, what: str, max_bytes: int = MAX_CONFIG_BYTES, hint: str = "") -> dict:
    """A YAML file whose top level is a mapping (`key: value` lines), read with `parse_yaml`'s checks."""
    value = parse_yaml(read_text(path, what, max_bytes), f"{what} {path}")
    return _expect_mapping(value, what, path, hint or "a mapping of `key: value` lines")


def _expect_mapping(value: Any, what: str, path, expected: str) -> dict:
    if not isinstance(value, dict):
        raise UserError(f"{what} {path}: the top level is {_kind(value)} {short(value, 60)}, but a {what} is "
                        f"{expected}")
    return value


def _kind(value: Any) -> str:
    return {list: "a list", str: "a string", int: "a number", float: "a number", bool: "a boolean",
            type(None): "empty"}.get(type(value), type(value).__name__)


_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def read_log(path: str | Path, max_bytes: int = MAX_LOG_BYTES) -> str:
    """A run's log for `doctor`: the last `max_bytes` (the failure is at the end), bad bytes replaced, control
    characters dropped, lines over MAX_LOG_LINE cut. A gzip, bzip2 or xz log is decompressed (its tail kept);
    UTF-16 (Windows' `>` redirect) is decoded; an empty log, a zip archive and a binary file are named as such."""
    file = regular_file(path, "log file")
    head = _head(file)
    codec = next((c for magic, c in _COMPRESSED.items() if head.startswith(magic)), None)
    if head.startswith(b"PK\x03\x04"):
        raise UserError(f"log file {path} is a zip archive: extract the log from it and give that file")
    data = _decompressed_tail(file, codec, max_bytes) if codec else read_bytes(path, "log file", max_bytes, tail=True)
    if head.startswith((b"\xff\xfe", b"\xfe\xff")):
        data = data.decode("utf-16", errors="replace").encode("utf-8")
    if not data.strip():
        raise UserError(f"log file {path} is empty: give the failed run's log (stdout and stderr of every rank)")
    if _looks_binary(data[:8192]):
        raise UserError(f"log file {path} is a binary file, not a log: give the failed run's text log")
    text = _CONTROL.sub("", data.decode("utf-8", errors="replace").replace("\r\n", "\n").replace("\r", "\n"))
    return "\n".join(_cut(line) for line in text.split("\n"))


_COMPRESSED = {b"\x1f\x8b": "gzip", b"BZh": "bz2", b"\xfd7zXZ\x00": "lzma"}
MAX_DECOMPRESSED = 4 << 30  # a compressed "log" that inflates past this is not a log (or a decompression bomb)


def _head(file: Path, count: int = 8) -> bytes:
    try:
        with open(file, "rb") as handle:
            return handle.read(count)
    except OSError as err:
        raise UserError(f"log file {file}: cannot read it ({err.strerror})") from None


def _decompressed_tail(file: Path, codec: str, max_bytes: int) -> bytes:
    """The last `max_bytes` of a compressed log, streamed (the whole file is never held)."""
    import bz2
    import gzip
    import lzma
    opener = {"gzip": gzip.open, "bz2": bz2.open, "lzma": lzma.open}[codec]
    tail, total = bytearray(), 0
    try:
        with opener(file, "rb") as handle:
            while chunk := handle.read(1 << 20):
                total += len(chunk)
                if total > MAX_DECOMPRESSED:
                    raise UserError(f"log file {file} ({codec}) inflates past {MAX_DECOMPRESSED:,} bytes: not a log")
                tail += chunk
                del tail[:-max_bytes]
    except (OSError, EOFError, lzma.LZMAError) as err:
        raise UserError(f"log file {file} is {codec}-compressed but does not decompress ({err}): is it whole?") from None
    return bytes(tail)


def _looks_binary(head: bytes) -> bool:
    """NUL bytes or control characters a terminal log does not hold (tab, newlines, escape sequences aside) in
    more than a few percent of the bytes: random bytes have ~11%, a core dump or an image more."""
    controls = sum(1 for b in head if (b < 32 and b not in (9, 10, 12, 13, 27)) or b == 127)
    return head.count(0) > len(head) // 100 or controls > len(head) * 0.03


def _cut(line: str) -> str:
    if len(line) <= MAX_LOG_LINE:
        return line
    return f"{line[:MAX_LOG_LINE]} ... [{len(line) - MAX_LOG_LINE:,} more characters cut]"


# --- YAML ----------------------------------------------------------------------------------------


class _Refusals:
    """What both loaders refuse beyond YAML itself: duplicate keys (here) and documents that expand past
    MAX_YAML_NODES through aliases (each loader checks the document it composed)."""

    def construct_mapping(self, node, deep=False):
        _refuse_duplicate_keys(node)
        return super().construct_mapping(node, deep=deep)


class _Loader(_Refusals, yaml.SafeLoader):
    """SafeLoader that reads 5e8 and 1e-4 as floats (YAML 1.1 wants a dot), as JSON and DeepSpeed users write
    them, with the refusals above."""

    def compose_document(self):
        node = super().compose_document()
        _expanded_size(node)
        return node


# The same loader on libyaml's parser (PyYAML's wheels carry it): ~9x faster than the pure-Python one on a preset
# (0.6 ms against 5.5 ms here), and every command, test and rank reads presets, templates and run configs. It
# stops at 1,000 levels of nesting where the Python parser would recurse. The values it builds are the same
# (the same constructor and resolvers); a document it refuses is read again by the Python parser, whose
# messages are the ones users see.
_CLoader = None
if getattr(yaml, "__with_libyaml__", False):
    class _CLoader(_Refusals, yaml.CSafeLoader):  # type: ignore[no-redef]
        def get_single_node(self):  # libyaml composes the document in C: the size is checked on what it built
            node = super().get_single_node()
            _expanded_size(node)
            return node


FLOAT_WITHOUT_DOT = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
for _loader in filter(None, (_Loader, _CLoader)):
    _loader.add_implicit_resolver("tag:yaml.org,2002:float", FLOAT_WITHOUT_DOT, list("-+0123456789"))


class _YamlProblem(Exception):
    """A document PyYAML would accept but we refuse; the message is completed with the source."""


def _refuse_duplicate_keys(node: yaml.MappingNode) -> None:
    seen: dict = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: *base` merges may be overridden; complex keys are rare and compared by PyYAML
        key = key_node.value
        if key in seen:
            raise _YamlProblem(f"line {key_node.start_mark.line + 1}: duplicate key {short(key, 60)} (first at "
                               f"line {seen[key] + 1}); YAML would silently keep only the last one: merge them")
        seen[key] = key_node.start_mark.line


def _expanded_size(root) -> int:
    """Nodes of the document with every alias expanded (what a deep copy or a message would build), counted
    once per distinct node; a recursive alias or more than MAX_YAML_NODES is refused."""
    sizes: dict[int, int] = {}
    active: set[int] = set()

    def size(node) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in active:
            raise _YamlProblem(f"line {node.start_mark.line + 1}: an alias refers to itself (a recursive structure)")
        active.add(id(node))
        children = node.value if isinstance(node, yaml.SequenceNode) else (
            [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else [])
        total = 1 + sum(size(child) for child in children)
        active.discard(id(node))
        if total > MAX_YAML_NODES:
            raise _YamlProblem(f"its aliases expand to more than {MAX_YAML_NODES:,} values (an alias bomb?); "
                               f"write the values out")
        sizes[id(node)] = total
        return total

    return size(root) if root is not None else 0


def parse_yaml(text: str, source: str = "<text>") -> Any:
    """YAML text as data, or a UserError naming `source` (a file, a `--set` item) and the line."""
    try:
        if _CLoader is not None:
            try:
                return yaml.load(text, Loader=_CLoader)
            except (yaml.YAMLError, UnicodeEncodeError):  # a lone surrogate cannot reach libyaml as UTF-8
                pass  # the Python parser below refuses it too, in its own words
        return yaml.load(text, Loader=_Loader)
    except _YamlProblem as err:
        raise UserError(f"{source}: {err}") from None
    except yaml.YAMLError as err:
        raise UserError(f"{source}: not valid YAML: {short(str(err), 400)}") from None
    except RecursionError:
        raise UserError(f"{source}: nested too deeply to be a config") from None


# --- writing -------------------------------------------------------------------------------------


def check_target(target: str, flag: str = "-o") -> Path:
    """The path to write, refused early (before any work) when it cannot be a file."""
    path = Path(target).expanduser()
    if not target or path.is_dir():
        raise UserError(f"{flag} {target!r}: " + ("a directory" if target else "empty") + "; give a file path")
    if not path.parent.is_dir():
        raise UserError(f"{flag} {target}: directory {path.parent} does not exist")
    if path.exists() and not path.is_file():  # /dev/full, a FIFO: the rename would replace the device node
        raise UserError(f"{flag} {target}: not a regular file (a device or a FIFO); give a file path, or '-' "
                        f"where the command prints to stdout")
    if not os.access(path.parent, os.W_OK):
        raise UserError(f"{flag} {target}: directory {path.parent} is not writable")
    return path


def write_text_atomic(target: str, text: str, flag: str = "-o", mode: Optional[int] = None) -> Path:
    """Write `text` to a temporary file beside `target`, then rename it over `target`: a full disk or a crash
    leaves the old file (or none), never part of the new one. Problems are a UserError naming the flag.
    `mode` (0o600 for a file that must stay private) is set before the rename; by default a replaced file
    keeps its mode and a new one gets the umask's."""
    return write_bytes_atomic(target, text.encode("utf-8"), flag, mode)


def write_bytes_atomic(target: str, data: bytes, flag: str = "-o", mode: Optional[int] = None) -> Path:
    """`write_text_atomic` for bytes (a PNG)."""
    with atomic_writer(target, flag, mode) as handle:
        handle.write(data)
    return Path(target).expanduser()


@contextlib.contextmanager
def atomic_writer(target: str, flag: str = "-o", mode: Optional[int] = None) -> Iterator[BinaryIO]:
    """A binary handle on a temporary file beside `target`, for a file written in pieces (a rewritten
    metrics.jsonl of any size): when the block ends it is fsynced and renamed over `target`; an exception in the
    block removes it and leaves `target` as it was. An OSError is a UserError naming the flag."""
    path = check_target(target, flag)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                yield handle
                handle.flush()
                os.fsync(handle.fileno())
            os.chmod(tmp, _mode_for(path) if mode is None else mode)  # mkstemp makes 0600
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as err:
        raise UserError(f"{flag} {target}: cannot write it ({err.strerror}); nothing was written") from None


def _mode_for(path: Path) -> int:
    if path.exists():
        return stat.S_IMODE(path.stat().st_mode)
    return 0o666 & ~current_umask()


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def modes_as_umask_allows(directory: Path) -> None:
    """Every file under `directory` gets the mode a new file gets from the user's umask (0644 under 022): libraries
    that write through a private temporary file (safetensors: 0600) would otherwise keep the export from a serving
    engine running as another user."""
    mode = 0o666 & ~current_umask()
    for path in directory.rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, mode)


def finite_json(value: Any, flag: str = "-o") -> str:
    """JSON text of `value`, refusing NaN/Infinity (Python's json writes them; no JSON reader accepts them)."""
    try:
        return json.dumps(value, indent=2, allow_nan=False) + "\n"
    except ValueError:
        raise UserError(f"{flag}: the config holds a non-finite number (inf or nan), which JSON cannot hold") \
            from None

