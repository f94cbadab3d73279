#!/usr/bin/env bash
# Set up everything on a fresh CPU machine (Python 3.11): the Debian packages the builds need (a C++ compiler for
# DeepSpeed's JIT ops, libaio-dev for its async_io op / NVMe offload), a virtualenv in .venv, and the pinned stack
# (ninja included: the trainer puts .venv's ninja first on every rank's PATH). Safe to run again.
#
#   scripts/setup.sh              # install
#   scripts/setup.sh tiny_cpu     # install, then build the DeepSpeed ops tiny_cpu's run loads (~5 min on 2 cores,
#                                 # once per environment), with a line every 30 s while they build
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
dpkg -s libaio-dev >/dev/null 2>&1 || missing+=(libaio-dev)
command -v c++ >/dev/null 2>&1 || missing+=(build-essential)
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "setup: installing ${missing[*]} (apt-get)"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
if ! .venv/bin/python -c "import trainer, deepspeed, transformers, pytest, ninja" >/dev/null 2>&1 \
   || [ pyproject.toml -nt .venv/.installed ]; then
  echo "setup: installing the pinned stack into .venv (pip)"
  .venv/bin/pip install -q --upgrade pip
  # torch first and exactly: pip takes the CPU build of 2.13.0 that lies on this machine's disk.
  .venv/bin/pip install -q "torch==2.13.0"
  .venv/bin/pip install -q -e ".[test]"
  touch .venv/.installed
fi
if ! .venv/bin/python -c "import sysconfig, os, sys; sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')))"; then
  echo "setup: warning: no Python.h for .venv's python: DeepSpeed's ops cannot compile; install the headers" \
       "(Debian: sudo apt-get install python3-dev)" >&2
fi

# Bytecode for the trainer's own modules, written here once: where PYTHONDONTWRITEBYTECODE is set (this machine
# and CI set it) no process writes it, so every command, rank and test worker compiled the ~180 modules it
# imports anew (a light command ~0.55 -> ~0.4 s of CPU). An edited module is compiled in memory until the next run.
.venv/bin/python -m compileall -q -j 0 trainer scripts train.py >/dev/null

if [ $# -gt 0 ]; then
  .venv/bin/python scripts/build_ops.py "$@"
else
  cat <<EOF
setup: done. DeepSpeed compiles its ops on first use, once per environment, into
  $(.venv/bin/python -c "import trainer, os; print(os.environ['TORCH_EXTENSIONS_DIR'])")
  (on a 2-core machine: the CPU all-reduce op ~1.5-3.5 min, fused_adam ~2 min, cpu_adam ~3 min); the run prints a
  line per op and every 30 s while one builds. To build them now: scripts/setup.sh tiny_cpu
EOF
fi
