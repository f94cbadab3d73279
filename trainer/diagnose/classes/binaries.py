"""What the run's compiled parts and devices say about the environment, not about the config:

- a compiled extension that fails to load with an undefined C++ symbol (`flash_attn_2_cuda...so: undefined symbol:
  _ZN3c104cuda9SetDeviceEi`): the extension was built against another torch (the symbol's namespace says whose:
  c10/at/torch are torch's); the remedy is that package rebuilt against the installed torch, not a config change;
- `invalid device ordinal`: a process asked for a GPU index the node does not show it - more ranks per node than
  visible GPUs (`--nproc_per_node 8` on a one-GPU machine), or CUDA_VISIBLE_DEVICES hiding some;
- a sample without a field the code reads (`KeyError: 'input_ids_j'` from `feature["input_ids_j"]`): the data that
  batch came from was not prepared like the training data - after N steps of training, the evaluation set.
"""
from __future__ import annotations

import re
from typing import Optional

from ..findings import Diagnosis, Found, Proposal
from ..raised import final_exception

UNDEFINED_SYMBOL = re.compile(r"(?P<lib>[\w./-]+\.so(?:\.\d+)*): undefined symbol: (?P<symbol>\w+)")
TORCH_NAMESPACES = {"c10": "torch", "at": "torch", "torch": "torch", "caffe2": "torch", "pybind11": "pybind11"}
PIP_NAMES = {"flash_attn": "flash-attn", "flash_attn_2_cuda": "flash-attn", "xformers": "xformers",
             "apex": "apex", "bitsandbytes": "bitsandbytes", "vllm": "vllm", "deepspeed": "deepspeed",
             "liger_kernel": "liger-kernel", "causal_conv1d": "causal-conv1d", "mamba_ssm": "mamba-ssm"}
# how to rebuild a package that compiles against torch at install time (from source, with the installed torch)
REBUILD = {"flash-attn": "FLASH_ATTENTION_FORCE_BUILD=TRUE pip install flash-attn --no-build-isolation --no-cache-dir",
           "deepspeed": "DS_BUILD_OPS=0 pip install deepspeed --no-cache-dir (the JIT ops then build against this "
                        "torch), or clear ~/.cache/torch_extensions"}


def mangled_namespace(symbol: str) -> str:
    """The outer namespace of an Itanium-mangled C++ name: _ZN3c104cuda9SetDeviceEi -> c10; '' when not one."""
    m = re.match(r"_ZN?K?(\d+)([A-Za-z_]\w*)", symbol)
    if not m:
        return ""
    length = int(m.group(1))
    return m.group(2)[:length]


def owner_of(f: Found, library: str) -> str:
    """The pip name of the package whose extension failed: the frame that imported it, else its path."""
    raised = final_exception(f.log)
    frames = list(raised.frames) if raised else f.log.frames(f.index)
    for frame in reversed(frames):
        if frame.package:
            return PIP_NAMES.get(frame.package, frame.package.replace("_", "-"))
    parts = re.split(r"[\\/]", library)
    if "site-packages" in parts and parts.index("site-packages") + 2 < len(parts):
        top = parts[parts.index("site-packages") + 1]
        return PIP_NAMES.get(top, top.replace("_", "-"))
    stem = parts[-1].split(".")[0]
    return PIP_NAMES.get(stem, re.sub(r"(_\d+)?_(cuda|C|ext|kernels?)$", "", stem).replace("_", "-"))


def diagnose_undefined_symbol(f: Found) -> Diagnosis:
    m = UNDEFINED_SYMBOL.search(f.log.joined(f.index))
    library, symbol = m.group("lib"), m.group("symbol")
    package = owner_of(f, library)
    against = TORCH_NAMESPACES.get(mangled_namespace(symbol), "")
    d = Diagnosis("extension_abi", f"{package}'s compiled extension was built against another "
                  f"{against or 'library'} than the one installed ({library.rsplit('/', 1)[-1]})", f.line)
    rebuild = REBUILD.get(package, f"pip install {package} --no-build-isolation --no-cache-dir")
    d.proposal = Proposal(
        f"reinstall {package} built against the installed {against or 'libraries'}: pip uninstall -y {package}, then "
        f"{rebuild}", [],
        f"'undefined symbol: {symbol}' means the extension expects a function "
        + (f"of {against}'s C++ API ({mangled_namespace(symbol)}::...) that this {against} does not export: it was "
           f"compiled for another {against} release (a prebuilt wheel for another torch/CUDA pair, or {against} "
           f"upgraded after it was installed)" if against else "that the loaded libraries do not export: it was "
           "compiled against other versions of them"))
    d.then.append(Proposal(f"or install the {against or 'library'} release {package} was built for", [],
                           f"`pip show {package}` and its wheel's name (…+cu121torch2.3…) say which"))
    return d


INVALID_ORDINAL = re.compile(r"invalid device ordinal", re.IGNORECASE)


def diagnose_invalid_ordinal(f: Found) -> Diagnosis:
    d = Diagnosis("invalid_device_ordinal", "a rank asked for a GPU this node does not show it", f.line)
    visible = f.facts.exported.get("CUDA_VISIBLE_DEVICES")
    d.proposal = Proposal(
        "start as many ranks per node as the node has GPUs: --nproc_per_node / --num_gpus / accelerate's "
        "num_processes = the count `nvidia-smi -L` prints" + (f" among CUDA_VISIBLE_DEVICES={visible}" if visible
                                                                else ""), [],
        "each rank takes the GPU of its local rank (cuda:LOCAL_RANK); a local rank past the last visible GPU has none "
        "- more ranks than GPUs, or CUDA_VISIBLE_DEVICES hiding some of them")
    return d


# a library naming the device it was told to use: "The requested device for vllm (cuda:1) is not available"
DEVICE_UNAVAILABLE = re.compile(r"(?:requested )?device(?: for (?P<what>[\w-]+))? \(?'?(?P<device>cuda:(?P<index>\d+))'?\)? "
                                r"is not available", re.IGNORECASE)


def diagnose_device_unavailable(f: Found) -> Diagnosis:
    """A device index past the node's GPUs. What the message advises next (train on fewer processes) is computed
    for the node it assumed; on a node of one GPU it would leave no process to train, so the device is what changes.
    """
    m = DEVICE_UNAVAILABLE.search(f.log.joined(f.index))
    what, device, index = m.group("what") or "the component", m.group("device"), int(m.group("index"))
    gpus = f.resolved.config.hardware.gpus_per_node
    vllm = what.lower() == "vllm"
    d = Diagnosis("device_unavailable", f"{what} was given {device}, which this node does not show", f.line)
    if index < gpus:
        d.proposal = Proposal(f"make {device} visible to the process that starts {what} (CUDA_VISIBLE_DEVICES)", [],
                              f"the node has {gpus} GPUs, so {device} exists: the process sees fewer "
                              "(CUDA_VISIBLE_DEVICES, or a launcher that narrows each rank to its own GPU)")
        return d
    last = f"cuda:{gpus - 1}" if gpus > 1 else "cuda:0"
    key = f' (vllm_device="{last}" in TRL\'s config)' if vllm else ""
    if gpus <= 1:
        d.proposal = Proposal(f"put {what} on the GPU that trains: cuda:0{key}, with a memory fraction that leaves "
                              f"training room (vllm_gpu_memory_utilization)" if vllm else
                              f"put {what} on cuda:0, the node's only GPU", [],
                              f"a node of one GPU has only cuda:0; {device} assumes a GPU of its own for {what}, and "
                              f"training on one process fewer would leave none to train")
        return d
    d.proposal = Proposal(f"give {what} a GPU the node has: {last}{key}, and train on the other {gpus - 1} "
                          f"(num_processes {gpus - 1})", [], f"the node shows cuda:0..{last}; {device} is past them")
    return d


FIELD_READ = re.compile(r"""(?:feature|features|example|examples|batch|sample|samples|item|row|inputs?|data)\[['"]"""
                        r"""(?P<field>\w+)['"]\]""")
KEY_ERROR = re.compile(r"KeyError\W*'(?P<field>\w+)'")
STEPS_DONE = re.compile(r"\b(?P<done>\d+)/(?P<total>\d+) \[")


def find_missing_field(log) -> Optional[int]:
    raised = final_exception(log)
    index = raised.index if raised is not None and raised.type.endswith("KeyError") else log.last(KEY_ERROR)
    found = KEY_ERROR.search(log.line(index)) if index is not None else None
    if found is None:  # two ranks' lines interleaved ("KeyErrorKeyError: : 'x'") still name the field
        return None
    key = found.group("field")
    code = " ".join([*(fr.code for fr in (raised.frames if raised else ())), *log.lines[max(0, index - 6):index]])
    return index if any(m.group("field") == key for m in FIELD_READ.finditer(code)) else None


def diagnose_missing_field(f: Found) -> Diagnosis:
    line = f.log.joined(f.index)
    key = (KEY_ERROR.search(line) or re.search(r"'(?P<field>\w+)'", line)).group("field")
    progress = [m for m in f.log.all(STEPS_DONE) if int(m.group("done")) > 0]
    after = int(progress[-1].group("done")) if progress else 0
    d = Diagnosis("missing_field", f"a sample has no field '{key}'" + (f" after {after} steps of training" if after
                                                                       else ""), f.line)
    if after:
        d.proposal = Proposal(
            f"preprocess the eval dataset like the training set: map(tokenize) it so its samples have '{key}' too", [],
            f"training read '{key}' for {after} steps; the batch that lacks it came later - the first evaluation (an "
            f"eval/validation set passed in raw, or tokenized by another function), or a later file with other "
            f"columns")
    else:
        d.proposal = Proposal(
            f"give every sample the field '{key}': map the dataset with the tokenize function that writes it before "
            f"the trainer reads it", [],
            f"the code reads sample['{key}'] and the dataset's samples do not have it: another preprocessing, a "
            f"column renamed, or a split that was not tokenized")
    d.advice.append("`print(dataset.column_names)` for each split shows which lacks it")
    return d
