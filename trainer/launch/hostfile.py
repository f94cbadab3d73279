"""DeepSpeed hostfiles (`worker-0 slots=8`), read as DeepSpeed's runner reads them and checked before anything
starts.

The syntax is what `deepspeed.launcher.runner._parse_hostfile` accepts: per line, after stripping, a host
(no whitespace) then whitespace then `slots=<digits>`; blank lines and lines starting with `#` are skipped; a
host given twice and a file with no hosts are errors. DeepSpeed matches only the start of a line, so
`w0 slots=8 gpus=4` or `w0 slots=8x` read as 8 slots with the rest dropped without a word: here text after
the slot count is an error unless it is a `#` comment. A host must be a host name, an IPv4 or an IPv6 address
(`shell.host_problem`): DeepSpeed hands it to ssh as an argument (`-oProxyCommand=...` would be an option that
runs a command) and to pdsh's -w list. Every problem of the file is reported together, each with its file:line.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import UserError
from ..files import read_text
from ..shell import host_problem


# DeepSpeed's own pattern (runner.py), then what may follow it here: nothing, or a comment
DEEPSPEED_PATTERN = re.compile(r"^(\S+)\s+slots=(\d+)")
TRAILER = re.compile(r"^\s*(#.*)?$")


@dataclass(frozen=True)
class Hostfile:
    path: str
    hosts: tuple[tuple[str, int], ...]  # (host, slots) in file order: node 0 is the first

    @property
    def nodes(self) -> int:
        return len(self.hosts)

    @property
    def world_size(self) -> int:
        return sum(slots for _, slots in self.hosts)

    @property
    def first_host(self) -> str:
        return self.hosts[0][0]

    def as_dict(self) -> dict:
        return {"path": self.path, "hosts": [{"host": h, "slots": s} for h, s in self.hosts]}

    def text(self) -> str:
        return "".join(f"{host} slots={slots}\n" for host, slots in self.hosts)


def read_hostfile(path: str) -> Hostfile:
    return parse_hostfile(read_text(path, "hostfile", also_read_by="DeepSpeed's runner"), path)


def parse_hostfile(text: str, path: str = "<hostfile>") -> Hostfile:
    hosts: dict[str, int] = {}
    first_line: dict[str, int] = {}
    problems = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{number}"
        match = DEEPSPEED_PATTERN.search(line)
        if not match:
            problems.append(f"{where}: {line!r} is not `HOST slots=N` (one host per line, e.g. `worker-0 slots=8`; "
                            f"# starts a comment)")
            continue
        host, slots = match.group(1), int(match.group(2))
        if host_problem(host):
            problems.append(f"{where}: host {host!r}: {host_problem(host)}")
            continue
        rest = line[match.end():]
        if not TRAILER.match(rest):
            problems.append(f"{where}: {rest.strip()!r} after `slots={slots}`: DeepSpeed would ignore it and read "
                            f"{slots} slots; remove it (or make it a # comment)")
        if slots < 1:
            problems.append(f"{where}: {host} has slots={slots}: give the number of GPUs on it (>= 1), or remove "
                            f"the line")
        if host in hosts:
            problems.append(f"{where}: {host} is listed twice (first on line {first_line[host]}): DeepSpeed "
                            f"refuses that; keep one line per host with its total slots")
            continue
        hosts[host], first_line[host] = slots, number
    if not hosts and not problems:
        problems.append(f"{path}: no hosts: write one `HOST slots=N` line per node")
    if problems:
        raise UserError("hostfile problems:\n  " + "\n  ".join(problems))
    return Hostfile(path, tuple(hosts.items()))


def check_against_preset(hostfile: Hostfile, gpus_per_node: int) -> None:
    """Every host has the preset's GPUs per node: the ranks-per-node the config (hpZ groups, AutoTP, the
    planner's memory) was made for. A mixed pool would put a ZeRO++ or TP group across a node boundary."""
    wrong = [(host, slots) for host, slots in hostfile.hosts if slots != gpus_per_node]
    if wrong:
        listed = ", ".join(f"{host} slots={slots}" for host, slots in wrong)
        raise UserError(f"hostfile {hostfile.path}: {listed} but the preset has hardware.gpus_per_node="
                        f"{gpus_per_node}: give every host slots={gpus_per_node}, or launch with --set "
                        f"hardware.gpus_per_node=N for the hosts' GPU count (every host the same)")
