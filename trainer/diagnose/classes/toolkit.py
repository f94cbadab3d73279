"""Compilers, CUDA toolkits and JIT-built ops: DeepSpeed's op builds failing (with the cause the compiler
output names), a CUDA toolkit older than the GPU or another major version than torch's, binaries without the
GPU's architecture, and a run that waits for ever on the `lock` file of an op build that was killed."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from ... import ds as dsc
from ...shell import quote
from ..advice import TRAINER_DEEPSPEED, _nvme_to_cpu
from ..findings import Diagnosis, Found, Proposal

# --- JIT-compiled ops ----------------------------------------------------------------------------------------

OP_OF_OBJECT = {"CPUAdam": "cpu_adam", "multi_tensor_adam": "fused_adam", "fused_adam_frontend": "fused_adam", "cpu_adam_impl": "cpu_adam",
                "deepspeed_aio_common": "async_io", "deepspeed_py_aio": "async_io"}
BUILD_ENV = {"cpu_adam": "DS_BUILD_CPU_ADAM", "fused_adam": "DS_BUILD_FUSED_ADAM", "async_io": "DS_BUILD_AIO",
             "cpu_adagrad": "DS_BUILD_CPU_ADAGRAD", "cpu_lion": "DS_BUILD_CPU_LION", "fused_lamb": "DS_BUILD_FUSED_LAMB"}
OP_NAME = [re.compile(p) for p in (
    r"Error building extension '(\w+)'", r"Unable to JIT load the (\w+) op", r"DeepSpeed's (\w+) op must be compiled",
    r"Unable to pre-compile (\w+)",
    r"FAILED: (\w+?)(?:\.cuda)?\.(?:o|so)\b", r"/(\w+)/\1\.so: cannot open shared object", r"Building extension module (\w+)",
    r"\b(async_io) requires the", r"'DeepSpeed(CPUAdam)' object has no attribute 'ds_opt_adam'")]


@dataclass(frozen=True)
class BuildCause:
    pattern: re.Pattern
    cause: str
    fix: str
    outcome: str = "failed to build"


BUILD_CAUSES = [BuildCause(re.compile(p), c, x, *outcome) for p, c, x, *outcome in (
    (r"due to ninja not being installed|Ninja is required to load C\+\+ extension|No such file or directory: "
     r"'ninja'|ninja: (command )?not found|there is no `ninja` in this environment",
     "there is no working `ninja` on the ranks' PATH: torch compiles every JIT op with it, and runs it even to load "
     "an op built before (ranks started over ssh or by a scheduler often lack the environment's bin/ on PATH, and "
     "another program called ninja may come first)",
     "install ninja into the environment that runs the ranks: `python -m pip install ninja` (this trainer's "
     "scripts/setup.sh does; `pip list | grep ninja` shows it) - the trainer then puts that environment's ninja "
     "first on every rank's PATH, over ssh too; with another script, activate the environment on every node or "
     "`export PATH=<env>/bin:$PATH`", "cannot be built or loaded: no ninja"),
    (r"(c\+\+|g\+\+|gcc|cc): (command )?not found|-cc: not found",
     "there is no C/C++ compiler", "install one: `sudo apt install build-essential` (conda: `conda install gxx_linux-64`)"),
    (r"cannot find -l(curand|cudart|cublas)",
     "the linker cannot find the CUDA libraries (libcurand/libcudart) where torch's build looks",
     "point CUDA_HOME at the CUDA toolkit torch was built with and make its libraries visible - `export "
     "CUDA_HOME=/usr/local/cuda LIBRARY_PATH=$CUDA_HOME/lib64:$LIBRARY_PATH LD_LIBRARY_PATH=$CUDA_HOME/lib64:"
     "$LD_LIBRARY_PATH`, or link it where the build looks: `ln -s $CUDA_HOME/lib64/libcurand.so "
     "$(python -c 'import torch, os; print(os.path.dirname(torch.__file__))')/lib/`"),
    (r"nvcc fatal\s*: Value 'c\+\+17' is not defined",
     "the nvcc on PATH is older than CUDA 11 and has no C++17",
     "install the CUDA toolkit matching torch (`python -c 'import torch; print(torch.version.cuda)'`) and use its "
     "nvcc: `export CUDA_HOME=/usr/local/cuda-<that version> PATH=$CUDA_HOME/bin:$PATH`"),
    (r"unsupported GNU version|gcc versions later than|host compiler version",
     "the host gcc is newer than this nvcc supports",
     "build with a gcc this CUDA supports: `export CC=gcc-11 CXX=g++-11` (CUDA 11.8 supports gcc <= 11)"),
    (r"Your compiler \(c\+\+ [0-4]\.|ABI-incompatible|unrecognized command.line option .-std=c\+\+17",
     "the C++ compiler is too old (C++17 and torch's ABI need gcc >= 9)",
     "install gcc >= 9 (`sudo apt install g++-11` or `conda install gxx_linux-64=11`) and `export CC=gcc-11 CXX=g++-11`"),
    (r"(cuda_profiler_api|cuda_runtime|cusolverDn|cublas_v2|curand)\.h: No such file",
     "the CUDA headers are missing: only the CUDA runtime is installed, not the toolkit",
     "install the CUDA toolkit (nvcc and headers) matching torch and `export CUDA_HOME=/usr/local/cuda-<version>`"),
    (r"CUDA_HOME does not exist|MissingCUDAException|nvcc: (command )?not found|No such file or directory: '[^']*nvcc'",
     "nvcc is missing (CUDA_HOME unset or pointing at no toolkit)",
     "install the CUDA toolkit matching torch and `export CUDA_HOME=/usr/local/cuda-<version> PATH=$CUDA_HOME/bin:$PATH`"),
    (r"libaio|async_io requires",
     "the libaio development files (libaio.so and headers) are missing",
     "`sudo apt install libaio-dev` (RHEL: `sudo yum install libaio-devel`), or point CFLAGS=-I<dir>/include and "
     "LDFLAGS=-L<dir>/lib at a libaio built from source"),
    (r"Installed CUDA version (\S+) does not match the version torch was compiled with",
     "the CUDA toolkit and torch's CUDA differ", "use the toolkit matching torch.version.cuda for CUDA_HOME"),
)]


# A compiler that cannot find a header: the header names the package that provides it.
MISSING_HEADER = re.compile(r"fatal error: ([\w/.+-]+\.h(?:pp)?): No such file or directory")
INTERPRETER = re.compile(r"\bpython(3\.\d+)\b")
HEADER_PACKAGES = [(re.compile(p), x) for p, x in (
    (r"^Python\.h$|^pyconfig\.h$",
     "the Python development headers of the interpreter that runs the build: `sudo apt install python{py}-dev` "
     "(RHEL/Fedora: `sudo dnf install python{py}-devel`; conda: the env's own python has them - build with the env's "
     "interpreter, not the system one)"),
    (r"^(cuda_runtime|cuda_runtime_api|cuda|cuda_fp16|cuda_bf16|cuda_profiler_api|cusolverDn|cublas_v2|cublas|"
     r"cusparse|curand|cufft|nvrtc|nvToolsExt)\.h$",
     "the CUDA toolkit's headers (only the runtime is installed): install the CUDA toolkit matching torch "
     "(`python -c 'import torch; print(torch.version.cuda)'`, apt `cuda-toolkit-<major>-<minor>` or conda "
     "`cuda-toolkit`) and `export CUDA_HOME=/usr/local/cuda-<version>`"),
    (r"^cudnn(_version)?\.h$", "cuDNN's headers: `sudo apt install libcudnn<N>-dev` (or conda `cudnn`), matching torch's cuDNN"),
    (r"^nccl(_net)?\.h$", "NCCL's headers: `sudo apt install libnccl-dev` (the version matching torch's NCCL)"),
    (r"^(libaio|aio)\.h$", "libaio's headers: `sudo apt install libaio-dev` (RHEL: `sudo yum install libaio-devel`)"),
    (r"^mpi\.h$", "MPI's headers: `sudo apt install libopenmpi-dev` (or conda `openmpi`)"),
    (r"^zlib\.h$", "zlib's headers: `sudo apt install zlib1g-dev` (RHEL: `zlib-devel`)"),
    (r"^crypt\.h$", "libcrypt's headers: `sudo apt install libcrypt-dev` (conda: `conda install libxcrypt`)"),
    (r"^omp\.h$", "the OpenMP headers of the compiler: `sudo apt install libomp-dev` (clang) or use gcc, which ships them"),
    (r"^numpy/", "numpy's headers: `pip install numpy` into the environment that runs the build"),
    (r"^(cuda\w*|curand\w*|cublas\w*|cusparse\w*|cusolver\w*|cufft\w*|nvrtc\w*|nvToolsExt\w*|nvtx3?/\S*|"
     r"cuda/\S*|thrust/\S*|cub/\S*)\.(h|hpp|cuh)$|^(thrust|cub)/",
     "the CUDA toolkit's headers: install the full CUDA toolkit of torch's CUDA version (`python -c 'import torch; "
     "print(torch.version.cuda)'`, e.g. the cuda-toolkit-12-1 package; a runtime-only CUDA or conda's cudatoolkit lacks "
     "them) and point CUDA_HOME at it"),
    (r"^(torch|ATen|c10|pybind11)/", "torch's own headers: build with the environment whose torch is installed "
     "(the same interpreter), reinstall torch if its include/ is missing"),
)]


def missing_header(f: Found) -> Optional[tuple[str, str]]:
    """(header, the package that provides it) for the first header the compiler could not find."""
    match = next(iter(f.log.all(MISSING_HEADER)), None)
    if match is None:
        return None
    header = match.group(1).split("/include/")[-1]
    py = INTERPRETER.search(f.log.joined(f.log.first(MISSING_HEADER) or 0, following=0)) or INTERPRETER.search(f.log.text)
    version = py.group(1) if py else "3"
    for pattern, package in HEADER_PACKAGES:
        if pattern.search(header):
            return header, package.format(py=version)
    return header, (f"the package that provides {header}: `apt-file search {header}` (Debian/Ubuntu) or `dnf provides "
                    f"'*/{header}'` names it - usually the library's -dev/-devel package")


def find_op(f: Found) -> Optional[str]:
    for pattern in OP_NAME:
        for match in reversed(f.log.all(pattern)):
            return OP_OF_OBJECT.get(match.group(1), match.group(1))
    return None


def diagnose_op_build(f: Found) -> Diagnosis:
    op = find_op(f)
    cause = next((c for c in BUILD_CAUSES if f.log.has(c.pattern)), None)
    outcome = cause.outcome if cause else BuildCause.outcome
    d = Diagnosis("op_build", f"DeepSpeed's {op or 'CUDA/C++'} op {outcome} (JIT extension)", f.line)
    prebuild = (f"prebuild it when installing DeepSpeed so nothing compiles at run time: `{BUILD_ENV.get(op, 'DS_BUILD_OPS')}=1 "
                f"pip install deepspeed=={TRAINER_DEEPSPEED} --no-cache-dir --force-reinstall`, then `ds_report` "
                f"shows it installed")
    header = missing_header(f)
    if header is not None:
        name, package = header
        d.title = f"the {op + ' op' if op else 'C/C++ extension'} build stops: the compiler cannot find {name}"
        d.proposal = Proposal(f"install what provides {name}: {package.split(':')[0]}", [],
                              f"`fatal error: {name}: No such file or directory` is the compiler's: install {package}; "
                              f"then rerun (the op compiles once into the extensions directory)")
    elif cause is None and (site := compile_error_site(f.log)) and TORCH_SOURCES.search(site):
        d.title = (f"the {op + ' op' if op else 'C/C++/CUDA extension'} build fails inside torch's own headers "
                   f"({site.split('/include/')[-1]}): the compiler or CUDA toolkit does not match this torch")
        d.proposal = _toolchain_for_torch(f)
    elif cause is not None:
        d.proposal = Proposal(f"fix the build: {cause.fix}", [], f"{cause.cause}; rerun (it compiles once into "
                                                                  f"the environment's extensions directory), or "
                                                                  f"{prebuild}")
    else:
        d.proposal = Proposal("fix the build toolchain", [], f"the compiler output above the failure names the "
                              f"missing piece (compiler too old, CUDA_HOME/nvcc missing); `ds_report` lists what can "
                              f"build; or {prebuild}")
    fallback = _without_op(f, op)
    if fallback is not None:
        d.then.append(fallback)
    return d


# The compiler's own error line names the file it was compiling: where that file lives says whose code did not
# compile. torch's headers compile with the toolchain torch was built and tested with, so an error inside them is
# the toolchain (nvcc's CUDA release, the gcc it drives), not the op's code.
COMPILER_ERROR = re.compile(r"(?P<file>/\S+?\.(?:h|hpp|hxx|cuh|c|cc|cpp|cxx|cu))(?:\(\d+\)|(?::\d+){1,2}):? (?:fatal )?error\b")
TORCH_SOURCES = re.compile(r"/torch/(include|csrc)/")


def compile_error_site(log) -> Optional[str]:
    """The file of the first compiler error in the log, when it shows one."""
    match = next(iter(log.all(COMPILER_ERROR)), None)
    return match.group("file") if match else None


def _toolchain_for_torch(f: Found) -> Proposal:
    toolkit, torch_cuda = f.facts.cuda_toolkit, f.facts.torch_cuda
    if toolkit and torch_cuda and toolkit.split(".")[0] != torch_cuda.split(".")[0]:
        return Proposal(f"use the CUDA {torch_cuda} toolkit torch was built with (the log shows nvcc {toolkit}): "
                        f"export CUDA_HOME=/usr/local/cuda-{torch_cuda}", [],
                        f"torch's headers are compiled by the nvcc under CUDA_HOME with the gcc it supports; a toolkit of "
                        f"another major release ({toolkit} against torch's {torch_cuda}) does not compile them. Or "
                        f"install the torch wheel for CUDA {toolkit}")
    shown = f" (the log shows nvcc {toolkit})" if toolkit else f" (torch's CUDA is {torch_cuda})" if torch_cuda else ""
    return Proposal(f"build with the CUDA toolkit version torch was built with{shown}: compare `nvcc --version` with "
                    f"`python -c \"import torch; print(torch.version.cuda)\"` and downgrade (or upgrade) the toolkit to "
                    f"match - CUDA_HOME points the build at it", [],
                    "torch's headers compile with the toolkit and compiler torch was built and tested with; an error "
                    "inside them means the nvcc (or the gcc it drives) is another release - a newer CUDA than torch's "
                    "is the usual one. Check also that gcc is within that toolkit's supported range (`gcc --version`)")


def _without_op(f: Found, op: Optional[str]) -> Optional[Proposal]:
    """The same run without the op that failed to build, where the config allows it."""
    r = f.resolved
    if op == "cpu_adam" and dsc.offload_optimizer_device(r.ds) != "none" and dsc.forces_ds_cpu_optimizer(r.ds):
        return Proposal("or run torch's AdamW on the CPU (fallback)", dsc.torch_adam_on_cpu_overrides(),
                        "lets the offloaded optimizer run without the compiled extension; the CPU step is 5-7x "
                        "slower than DeepSpeedCPUAdam, so fix the build when you can")
    if op == "fused_adam" and dsc.offload_optimizer_device(r.ds) == "none":
        return Proposal("or use torch's Adam instead of FusedAdam (fallback)",
                        [dsc.set_override("optimizer.params.torch_adam", True)],
                        "DeepSpeed's Adam type then runs torch.optim.AdamW on the GPU: no extension to build, a "
                        "little slower")
    if op == "async_io" and "nvme" in (dsc.offload_optimizer_device(r.ds), dsc.offload_param_device(r.ds)):
        return _nvme_to_cpu(f)
    return None


# --- CUDA toolkit, torch's CUDA and the GPU's architecture -------------------------------------------------------

# The first CUDA release whose nvcc compiles for each architecture (compute capability without the dot).
FIRST_CUDA = {70: "9.0", 72: "10.0", 75: "10.0", 80: "11.0", 86: "11.1", 87: "11.4", 89: "11.8", 90: "11.8",
              100: "12.8", 101: "12.8", 120: "12.8"}
GPUS_OF = {80: "A100/A30", 86: "RTX 30xx/A10/A40/A6000", 89: "RTX 40xx/L4/L40", 90: "H100/H200", 100: "B200",
           120: "RTX 50xx"}
# nvcc's own words ("Unsupported gpu architecture 'compute_89'", as pasted also "architechture"), and its other form
# "Value 'sm_90' is not defined for option 'gpu-name'"; an 'a' suffix (compute_90a) is the same architecture's
UNSUPPORTED_ARCH = re.compile(r"(?:nvcc fatal\s*:?\s*unsupported gpu archi\w*\s*'?(?:compute|sm)_(\d+)a?|nvcc fatal\s*:?\s*"
                              r"Value '(?:compute|sm)_(\d+)a?' is not defined for option 'gpu-(?:name|architecture)')",
                              re.IGNORECASE)
CUDA_MISMATCH = re.compile(r"(?:Installed CUDA version (\d+)\.(\d+) does not match the version torch was compiled with "
                           r"(\d+)\.(\d+)(?!.*accepting)|detected CUDA version \((\d+)\.(\d+)\) mismatches the version "
                           r"that was used to compile)")
# the second half of torch's own wording, on the next line as torch prints it: "PyTorch (11.3). Please make sure ..."
COMPILED_WITH = re.compile(r"used to compile\s+PyTorch \((\d+)\.(\d+)\)")
# the CUDA versions PyTorch publishes wheels for: a toolkit's major.minor maps to the highest index at or below it
WHEEL_CUDA = ("11.8", "12.1", "12.4", "12.6", "12.8", "12.9", "13.0")
NO_KERNEL = re.compile(r"(no kernel image is available for execution on the device|CUDA capability (sm_\d+) is not "
                       r"compatible with the current PyTorch installation)")
OLD_DRIVER = re.compile(r"(CUDA driver version is insufficient for CUDA runtime version|The NVIDIA driver on your "
                        r"system is too old)")
CUDA_TOOLKIT = re.compile("|".join(p.pattern for p in (UNSUPPORTED_ARCH, CUDA_MISMATCH, NO_KERNEL, OLD_DRIVER)),
                          re.IGNORECASE)


def diagnose_cuda_toolkit(f: Found) -> Diagnosis:
    arch = next(iter(f.log.all(UNSUPPORTED_ARCH)), None)
    mismatch = next(iter(f.log.all(CUDA_MISMATCH)), None)
    if arch is not None:
        return _arch_too_new(f, int(arch.group(1) or arch.group(2)))
    if mismatch is not None:
        if mismatch.group(5):  # torch's cpp_extension wording: the toolkit here, torch's CUDA from the next line
            compiled = COMPILED_WITH.search(f.log.joined(f.log.first(CUDA_MISMATCH) or f.index, following=2))
            if compiled is None:
                return _toolkit_mismatch(f, (mismatch.group(5), mismatch.group(6), "?", "?"))
            return _toolkit_mismatch(f, (mismatch.group(5), mismatch.group(6), compiled.group(1), compiled.group(2)))
        return _toolkit_mismatch(f, mismatch.groups()[:4])
    if f.log.has(OLD_DRIVER):
        d = Diagnosis("cuda_toolkit", "the NVIDIA driver is older than the CUDA runtime torch was built with", f.line)
        d.proposal = Proposal("update the NVIDIA driver (or install torch built for an older CUDA)", [],
                              "each CUDA release needs a minimum driver (`nvidia-smi` prints the driver and the "
                              "highest CUDA it supports); torch wheels bundle their CUDA runtime, so a cu118 wheel runs "
                              "on a driver the cu124 wheel refuses")
        return d
    d = Diagnosis("cuda_toolkit", "the binary has no kernels for this GPU's architecture", f.line)
    d.proposal = Proposal("build for this GPU's architecture", [],
                          "torch (or a DeepSpeed op prebuilt with DS_BUILD_*) was compiled without this GPU's compute "
                          "capability: install the torch wheel for a CUDA that supports the GPU (H100 needs cu118 or "
                          "newer), and rebuild prebuilt ops with it listed: `TORCH_CUDA_ARCH_LIST=\"8.0;9.0\" "
                          f"DS_BUILD_OPS=1 pip install deepspeed=={TRAINER_DEEPSPEED} --no-cache-dir --force-reinstall`"
                          " (`python -c 'import torch; print(torch.cuda.get_arch_list())'` shows what torch has)")
    return d


def _arch_too_new(f: Found, arch: int) -> Diagnosis:
    needed = FIRST_CUDA.get(arch)
    gpu = f" ({GPUS_OF[arch]})" if arch in GPUS_OF else ""
    d = Diagnosis("cuda_toolkit", f"the CUDA toolkit's nvcc cannot compile for compute_{arch}{gpu}", f.line)
    if needed is None or arch < 70:
        d.proposal = Proposal("build only for architectures this toolkit knows: TORCH_CUDA_ARCH_LIST", [],
                              f"this nvcc dropped (or never had) compute_{arch}: list your GPU's capability only, e.g. "
                              f"`export TORCH_CUDA_ARCH_LIST=\"8.0\"`, before the op builds")
        return d
    d.proposal = Proposal(f"install CUDA >= {needed} (the toolkit matching torch) and point CUDA_HOME at it", [],
                          f"compute_{arch} needs nvcc from CUDA {needed} or newer; the nvcc on PATH/CUDA_HOME is older. "
                          f"Install the toolkit of torch's CUDA (`python -c 'import torch; print(torch.version.cuda)'`) "
                          f"and `export CUDA_HOME=/usr/local/cuda-<version> PATH=$CUDA_HOME/bin:$PATH`; the ops then "
                          f"build for the GPU that is there")
    d.then.append(Proposal("or, keeping this toolkit, skip the architecture it does not know", [],
                           f"`export TORCH_CUDA_ARCH_LIST=<the capabilities this toolkit supports>` stops the build "
                           f"from targeting compute_{arch} - only if no GPU of that architecture runs the job"))
    return d


def wheel_index(major: str, minor: str) -> Optional[str]:
    """PyTorch's wheel index for a CUDA toolkit: the highest published CUDA of that major version at or below it."""
    try:
        wanted = (int(major), int(minor))
    except ValueError:
        return None
    fits = [v for v in WHEEL_CUDA if int(v.split(".")[0]) == wanted[0] and tuple(map(int, v.split("."))) <= wanted]
    return f"cu{fits[-1].replace('.', '')}" if fits else None


def _toolkit_mismatch(f: Found, m: tuple) -> Diagnosis:
    installed, torch_cuda = f"{m[0]}.{m[1]}", f"{m[2]}.{m[3]}"
    d = Diagnosis("cuda_toolkit", f"CUDA toolkit {installed} vs torch built with CUDA {torch_cuda}: DeepSpeed will not "
                                  f"JIT-build its ops", f.line)
    d.proposal = Proposal(f"use the CUDA {torch_cuda} toolkit for the build: export CUDA_HOME=/usr/local/cuda-"
                          f"{torch_cuda}", [],
                          f"the ops compile with the nvcc under CUDA_HOME ({installed}) against torch's CUDA "
                          f"({torch_cuda}); the major versions must match. Install toolkit {torch_cuda} (or a torch "
                          f"wheel built for CUDA {m[0]}.x: `pip install torch --index-url "
                          f"https://download.pytorch.org/whl/{wheel_index(m[0], m[1]) or f'cu{m[0]}{m[1]}'}`)")
    if m[0] == m[2]:
        d.advice.append("the major versions agree: DS_SKIP_CUDA_CHECK=1 lets DeepSpeed build anyway (untested by it)")
    return d


# --- a JIT build's lock file ---------------------------------------------------------------------------------

# torch's FileBaton: the first process creates <build dir>/lock, builds, removes it; the others poll until it is
# gone. A builder killed midway leaves the file, and every later run waits for ever, printing nothing.
LOCK_WAIT = re.compile(r"(file_baton\.py|Waited on lock file|JIT (build )?lock)")
OP_LOADING = re.compile(r"(Using \S+ as PyTorch extensions root|Emitting ninja build file|Building extension module "
                        r"\w+|Allowing ninja to set a default number of workers|Loading extension module \w+|Detected "
                        r"CUDA files, patching ldflags|Creating extension directory)")
EXTENSIONS_ROOT = re.compile(r"Using (\S+) as PyTorch extensions root")
LOCK_FILE = re.compile(r"(/\S+/lock)\b")
OP_MODULE = re.compile(r"(?:Building|Loading) extension module (\w+)")
BUILDING_NOW = re.compile(r"is being built by (pid \d+ \([^)]*\))")  # the trainer's own words (trainer/jit_locks.py)
STALE = re.compile(r"stale JIT lock")


def find_stopped_at_op_loading(log) -> Optional[int]:
    """A log whose last lines are the JIT op loader's, with nothing after them: it stopped while loading an op."""
    tail = [i for i in range(len(log.lines)) if log.lines[i].strip()][-3:]
    loading = [i for i in tail if OP_LOADING.search(log.lines[i])]
    return loading[-1] if loading and loading[-1] == tail[-1] else None


def diagnose_jit_lock(f: Found) -> Diagnosis:
    root = next((m.group(1) for m in reversed(f.log.all(EXTENSIONS_ROOT))), None)
    ops = [m.group(1) for m in f.log.all(OP_MODULE)]
    named = next((m.group(1) for m in f.log.all(LOCK_FILE)), None)
    lock = named or (f"{root}/{ops[-1]}/lock" if root and ops else None)
    waiting = f.log.has(LOCK_WAIT)
    d = Diagnosis("jit_lock", ("waiting on a JIT op build's lock file" if waiting else
                               "the run stopped while loading a JIT-built op (a stale lock file, or a build still "
                               "running)"), f.line)
    # paths read from the log are pasted into a shell: quoted by the one quoting function (the glob left outside)
    pattern = quote(lock) if lock else f"{quote(root) if root else '~/.cache/torch_extensions/<py>_<cuda>'}/*/lock"
    building = next(iter(f.log.all(BUILDING_NOW)), None)
    if building is not None and not f.log.has(STALE):
        d.proposal = Proposal(f"let the build that holds the lock finish ({building.group(1)})", [],
                              f"the trainer saw {building.group(1)} working in the op's directory: the ranks wait for "
                              f"it. If it never finishes (`top`, `ps -o etime -p PID`), stop it, then `rm -f {pattern}`")
        return d
    d.proposal = Proposal(f"remove the stale lock: rm -f {pattern}", [],
                          "torch's JIT loader lets one process build an op while the others wait for <build dir>/lock "
                          "to disappear; a build that was killed (timeout, preemption, Ctrl-C) leaves it behind and "
                          "every later run waits for ever. First check that nothing is building (`pgrep -af "
                          f"'ninja|nvcc|cc1plus'` shows no build in that directory), then remove it (`ls -la {pattern}` "
                          "shows its age); the next run builds or loads the op at once")
    d.advice.append("this trainer looks for such lock files before DeepSpeed loads its ops (train and preflight) and "
                    "names the file, its age and the removal command every 30 s while a rank waits on one; give each "
                    "job its own TORCH_EXTENSIONS_DIR when builds may be killed")
    return d
