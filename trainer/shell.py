"""What the launch writes for a shell or a scheduler to read, and the values refused where quoting cannot help.

Generated scripts are data. Every value written into a shell script or a printed command goes through
`quote` (`join` is `quote` per word): the only quoting function. The launch's own shell variables
(`$SLURM_NODEID`, `$MASTER_ADDR`, expanded on each node) are `ShellVariable` words, written as "$NAME"; a
user's value that merely looks like one (`$HOME`) is quoted like any other text.

Three readers take no quoted shell, so values bound for them are checked against a grammar and refused,
naming where they came from:
- `#SBATCH` directive lines, which sbatch parses itself (not a shell) before the script runs: a value there
  is one plain token (`sbatch_token`); a newline would end the directive and start a command.
- DeepSpeed's pdsh runner, which pastes into one command line for each node's shell: its exports (`export
  K=v;`, v wrapped in double quotes when it holds anything outside [\\w@%+=:,./-]), `cd <cwd>;`, the Python
  path, the script and every training argument (wrapped in double quotes only when it holds a space):
  `pdsh_word_problem`, `export_value_problem`. pdsh also rewrites `%h`/`%n`, so `%` is refused there too.
- host names, which reach ssh and pdsh as arguments (DeepSpeed's ssh check runs `ssh <host> hostname`: a host
  `-oProxyCommand=...` is an option) and torchrun's rendezvous: `host_problem`.
"""
from __future__ import annotations

import ipaddress
import re
import shlex
from typing import Optional

from .errors import UserError
from .paths import CONTROL, control_characters


VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SBATCH_TOKEN = re.compile(r"[A-Za-z0-9._+:@,/=-]+")   # no space, quote, $, `, \, %, # or control character
PDSH_PLAIN = re.compile(r"[\w@+=:,./-]+")             # DeepSpeed's own "needs no quotes" set, less pdsh's %
LIVE_IN_DOUBLE_QUOTES = re.compile(r"[\"$`\\%]")     # what a shell still reads as code inside "...", and pdsh's %
VARIABLE_REFERENCE = re.compile(r"\$(?:[A-Za-z_][A-Za-z0-9_]*|\{[A-Za-z_][A-Za-z0-9_]*\})")
LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]*[A-Za-z0-9_])?"
HOSTNAME = re.compile(rf"{LABEL}(?:\.{LABEL})*")


class ShellVariable(str):
    """`$NAME` (optionally followed by fixed text: `$MASTER_ADDR:29500`) for the shell on each node to expand.
    Only the launch makes these; `quote` writes them as "$NAME" (expanded, never split or globbed)."""

    def __new__(cls, name: str, suffix: str = ""):
        if not VARIABLE.fullmatch(name):
            raise ValueError(f"not a shell variable name: {name!r}")
        word = super().__new__(cls, f"${name}{suffix}")
        word.name, word.suffix = name, suffix
        return word

    def followed_by(self, suffix: str) -> "ShellVariable":
        return ShellVariable(self.name, self.suffix + suffix)


class EnvAssignment(str):
    """`NAME=value` before a command (the fabric profile for the launcher): written NAME='value', which the shell
    reads as an assignment ('NAME=value' in quotes would be a program name)."""

    def __new__(cls, name: str, value: str):
        if not VARIABLE.fullmatch(name):
            raise UserError(f"{name!r} is not an environment variable name (letters, digits and _, not first a "
                            f"digit)")
        word = super().__new__(cls, f"{name}={value}")
        word.name, word.value = name, value
        return word


def quote(word) -> str:
    """One word for a shell: the launch's own variables as "$NAME", an assignment as NAME='value', everything
    else single-quoted where needed; a word holding what a terminal would not show as itself (a control
    character, a byte that is not UTF-8 - a file name's, kept by Python as a lone surrogate) as bash's $'...' with
    escapes, which is the same bytes when run and the same text when shown or pasted."""
    if isinstance(word, ShellVariable):
        return f'"${word.name}"' + (_quoted(word.suffix) if word.suffix else "")
    if isinstance(word, EnvAssignment):
        return f"{word.name}={_quoted(word.value)}"
    return _quoted(str(word))


def _quoted(text: str) -> str:
    if all(c.isprintable() and not 0xD800 <= ord(c) <= 0xDFFF for c in text):
        return shlex.quote(text)
    return "$'" + "".join(_escaped(c) for c in text) + "'"


def _escaped(char: str) -> str:
    """One character inside bash's $'...': itself when printable, else the bytes it stands for as \\xNN."""
    if char in "\\'":
        return "\\" + char
    code = ord(char)
    if 0xDC80 <= code <= 0xDCFF:  # os.fsdecode's stand-in for the byte code - 0xDC00
        return f"\\x{code - 0xDC00:02x}"
    if char.isprintable() and not 0xD800 <= code <= 0xDFFF:
        return char
    return "".join(f"\\x{b:02x}" for b in char.encode("utf-8", "surrogatepass"))


def join(words) -> str:
    return " ".join(quote(w) for w in words)


def export(name: str, value: str) -> str:
    """`export NAME='value'` for a script."""
    return f"export {quote(EnvAssignment(name, value))}"


def sbatch_token(value: str, source: str) -> str:
    """`value` for an `#SBATCH --option=value` line, or a UserError naming `source` (the flag or key)."""
    if SBATCH_TOKEN.fullmatch(value):
        return value
    what = control_characters(value) or "characters outside letters, digits and . _ + : @ , / = -"
    raise UserError(f"{source} {value!r} holds {what}: it is written into an `#SBATCH` directive, which sbatch "
                    f"reads without a shell's quoting (a newline there would start a command); give a value of "
                    f"letters, digits and . _ + : @ , / = - only")


def pdsh_word_problem(word: str) -> Optional[str]:
    """Why `word` does not reach each node intact through DeepSpeed's pdsh runner (PDSHRunner.parse_user_args
    wraps a word holding a space in double quotes, escaping only `"`, and pastes any other word as it is);
    None when it does."""
    if CONTROL.search(word):
        return f"it holds {control_characters(word)}"
    if " " in word:
        live = sorted(set(LIVE_IN_DOUBLE_QUOTES.findall(word)) - {'"'})
        return f"it holds {' '.join(live)}, which the node's shell reads inside double quotes" if live else None
    if not PDSH_PLAIN.fullmatch(word):
        odd = sorted(set(re.sub(PDSH_PLAIN, "", word))) or ["nothing (an empty word vanishes)"]
        return f"it holds {' '.join(repr(c) for c in odd)}, pasted unquoted into the node's shell command"
    return None


def export_value_problem(value: str, variables: bool = False) -> Optional[str]:
    """Why `value` is not exported intact by DeepSpeed's pdsh runner (`export K="value";` on each node's shell:
    `"`, `$`, backquote and backslash are live inside those quotes, pdsh rewrites `%`); None when it is.
    `variables`: `$NAME`/`${NAME}` references are allowed (a user's ~/.deepspeed_env may say PATH=$PATH:/x,
    expanded on the node, as DeepSpeed documents); command substitution never is."""
    if CONTROL.search(value):
        return f"it holds {control_characters(value)}"
    rest = VARIABLE_REFERENCE.sub("", value) if variables else value
    live = sorted(set(LIVE_IN_DOUBLE_QUOTES.findall(rest)))
    if live:
        return (f"it holds {' '.join(live)}, which the node's shell reads as code inside DeepSpeed's "
                f"`export NAME=\"value\";`" + (" ($NAME and ${NAME} are allowed)" if variables else ""))
    return None


def host_problem(host: str) -> Optional[str]:
    """Why `host` is not a host name, an IPv4 or an IPv6 address; None when it is one."""
    if host.startswith("-"):
        return "it starts with '-': ssh and pdsh would read it as an option (-oProxyCommand=... runs a command)"
    try:
        ipaddress.ip_address(host)
        return "an IPv6 zone (%...) is not accepted: give the address alone" if "%" in host else None
    except ValueError:
        pass
    if len(host) > 253 or not HOSTNAME.fullmatch(host):
        user = " (a login name, user@host, goes in ~/.ssh/config: `Host h` / `User u`)" if "@" in host else ""
        return ("not a host name (letters, digits, - and _ in dot-separated labels, none starting or ending with "
                f"-), an IPv4 or an IPv6 address{user}")
    if all(label.isdigit() for label in host.split(".")):
        return "not an IPv4 address (four numbers 0-255)"
    return None


def check_host(host: str, source: str) -> str:
    problem = host_problem(host)
    if problem:
        raise UserError(f"{source} {host!r}: {problem}")
    return host
