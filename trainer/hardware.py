"""The accelerators the validator, the planner and the MFU meter know, and their lookups.

The facts live in data, `trainer/accelerators.yaml` (one entry per card with its sources), read strictly here:
an unknown key, a missing one or a wrong type names the file, the accelerator and the key. Peaks are dense
tensor-core TFLOP/s (bf16, or fp16 where a card has no bf16: V100); memory is the data sheet's (1e9 bytes) and
what torch reports (GiB), which is what the planner budgets.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from . import strict
from .errors import ConfigError, UserError, closest
from .files import read_yaml_mapping

TABLE = Path(__file__).with_name("accelerators.yaml")


@dataclass
class AcceleratorEntry:
    """One entry of accelerators.yaml, as written (the file's header documents each key)."""
    name: str = ""
    aliases: list[str] = dataclasses.field(default_factory=list)
    vendor: Literal["nvidia", "amd", "cpu"] = "nvidia"
    description: str = ""
    memory_gb: float = 0.0
    usable_gib: float = 0.0
    bf16_tflops: Optional[float] = None
    fp16_tflops: float = 0.0
    fp8_tflops: Optional[float] = None
    interconnect: Literal["nvlink", "pcie", "infinity-fabric", "none"] = "none"
    device_names: list[str] = dataclasses.field(default_factory=list)
    source: str = ""


OPTIONAL_KEYS = ("aliases", "device_names", "bf16_tflops", "fp8_tflops")  # every other key must be written


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gb: float      # device memory, 1e9 bytes
    bf16: bool            # hardware bf16 support (Ampere and newer, CDNA2 and newer)
    peak_tflops: float    # dense 16-bit tensor-core peak (bf16, else fp16)
    description: str
    # What PyTorch reports as the card's total (torch.cuda.get_device_properties().total_memory, the
    # "total capacity" in CUDA OOM messages), GiB: less than the marketing size, and what the planner budgets.
    usable_gib: float = 0.0
    vendor: str = "nvidia"
    fp8_tflops: Optional[float] = None
    interconnect: str = "none"
    aliases: tuple[str, ...] = ()
    device_names: tuple[str, ...] = ()
    source: str = ""

    @property
    def memory_bytes(self) -> int:
        """Device memory the allocator can see, in bytes (falls back to the vendor size)."""
        return int(self.usable_gib * 2**30) if self.usable_gib else int(self.memory_gb * 1e9)

    @property
    def rocm(self) -> bool:
        """An AMD card: ROCm builds of torch and DeepSpeed, RCCL for the collectives (it reads the NCCL_* names)."""
        return self.vendor == "amd"


def load_accelerators(path: Path = TABLE) -> dict[str, Gpu]:
    """name -> Gpu from an accelerators file, or a ConfigError naming the file and, per problem, the accelerator
    and the key."""
    raw = read_yaml_mapping(path, "accelerators file", hint="a mapping with one key, accelerators: a list")
    entries = raw.get("accelerators")
    problems = [f"unknown key {key!r}{closest(str(key), ['accelerators'])}" for key in raw if key != "accelerators"]
    if not isinstance(entries, list) or not entries:
        raise ConfigError(problems + ["accelerators: expected a list of entries"], str(path))
    table: dict[str, Gpu] = {}
    names: dict[str, str] = {}  # every name and alias -> the entry that owns it
    for index, item in enumerate(entries):
        label = f"accelerators[{index}]" + (f" ({item.get('name')})" if isinstance(item, dict) and
                                            item.get("name") else "")
        found: list[str] = []
        entry = strict.build(AcceleratorEntry, item, label, found)
        if isinstance(item, dict):
            found += [f"{label}.{key}: missing" for key in (f.name for f in dataclasses.fields(AcceleratorEntry))
                      if key not in item and key not in OPTIONAL_KEYS]
        if not found:
            found += _entry_problems(entry, label, names)
        problems += found
        if not found:
            table[entry.name] = _gpu(entry)
    if problems:
        raise ConfigError(problems, str(path))
    return table


def _entry_problems(entry: AcceleratorEntry, label: str, names: dict[str, str]) -> list[str]:
    out = []
    for key in [entry.name] + list(entry.aliases):
        if key != key.strip().lower() or not key.strip():
            out.append(f"{label}: name or alias {key!r} must be lower case, without spaces")
        elif key in names:
            out.append(f"{label}: {key!r} is already the name or an alias of {names[key]!r}")
        else:
            names[key] = entry.name
    for pattern in entry.device_names:
        try:
            re.compile(pattern)
        except re.error as err:
            out.append(f"{label}.device_names: {pattern!r} is not a regular expression ({err})")
    numbers = {"memory_gb": entry.memory_gb, "usable_gib": entry.usable_gib, "fp16_tflops": entry.fp16_tflops,
               "bf16_tflops": entry.bf16_tflops or 0, "fp8_tflops": entry.fp8_tflops or 0}
    out += [f"{label}.{key}: {value} must be >= 0" for key, value in numbers.items() if value < 0]
    if entry.vendor != "cpu":
        out += [f"{label}.{key}: a GPU needs a positive value" for key in ("memory_gb", "usable_gib", "fp16_tflops")
                if numbers[key] <= 0]
        if entry.usable_gib > entry.memory_gb:  # an "80GB" card holds 80 GiB, of which torch sees a little less
            out.append(f"{label}.usable_gib: {entry.usable_gib} is more than memory_gb {entry.memory_gb}")
    if not entry.source.strip():
        out.append(f"{label}.source: name the data sheet the numbers come from")
    return out


def _gpu(entry: AcceleratorEntry) -> Gpu:
    peak = entry.bf16_tflops if entry.bf16_tflops is not None else entry.fp16_tflops
    return Gpu(entry.name, entry.memory_gb, entry.bf16_tflops is not None, peak, entry.description,
               entry.usable_gib, entry.vendor, entry.fp8_tflops, entry.interconnect, tuple(entry.aliases),
               tuple(entry.device_names), entry.source)


GPUS: dict[str, Gpu] = load_accelerators()
ALIASES: dict[str, str] = {alias: g.name for g in GPUS.values() for alias in g.aliases}


def canonical_name(name: object) -> Optional[str]:
    """The entry a typed name means (its name or an alias, any case, `_` or a space for `-`), or None."""
    key = re.sub(r"[\s_]+", "-", str(name).strip().lower())
    return key if key in GPUS else ALIASES.get(key)


def gpu(name: str) -> Gpu:
    """The row of a `hardware.gpu` that `resolve` has already checked (a KeyError here is a bug)."""
    return GPUS[canonical_name(name) or name]


def gpu_named(name: str, where: str, allow_cpu: bool = False) -> Gpu:
    """A GPU type a user typed (a flag, a scenario key), or a UserError naming `where` and the close types."""
    key = canonical_name(name)
    known = [g for g in GPUS if g != "cpu" or allow_cpu]
    if key == "cpu" and not allow_cpu:
        raise UserError(f"{where}: 'cpu' ranks have no GPU memory to plan; give a GPU type ({', '.join(known)})")
    if key not in known:
        raise UserError(f"{where}: unknown GPU type {name!r}{unknown_hint(str(name), allow_cpu)}; known: "
                        f"{', '.join(known)} (add an entry to {TABLE.relative_to(TABLE.parent.parent)} for another)")
    return GPUS[key]


def gpu_of_device(device_name: str | None) -> Gpu | None:
    """The row for a device torch names ("NVIDIA H100 80GB HBM3"), or None for an unknown one: the first entry
    in the file whose device_names match."""
    return next((g for g in GPUS.values() for pattern in g.device_names
                 if re.search(pattern, device_name or "", re.IGNORECASE)), None)


def unknown_hint(name: str, allow_cpu: bool = True) -> str:
    """' (did you mean 'a' or 'b'?)': the names and aliases that start with what was typed, else the close ones
    (difflib), each as the entry's name."""
    typed = re.sub(r"[\s_]+", "-", name.strip().lower())
    everything = {**{g: g for g in GPUS}, **ALIASES}
    if not allow_cpu:
        everything = {k: v for k, v in everything.items() if v != "cpu"}
    prefixed = [everything[k] for k in everything if typed and k.startswith(typed)]
    if not prefixed:
        prefixed = [everything[k] for k in difflib.get_close_matches(typed, list(everything), n=6, cutoff=0.6)]
    close = list(dict.fromkeys(prefixed))[:4]
    return f" (did you mean {' or '.join(repr(g) for g in close)}?)" if close else ""
