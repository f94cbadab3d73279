#!/usr/bin/env bash
# Set up everything on a fresh CPU machine (Python 3.11): the Debian package libaio-dev (DeepSpeed's
# async_io op for NVMe offload), a virtualenv in .venv, and the pinned stack. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! dpkg -s libaio-dev >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libaio-dev >/dev/null
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
if ! .venv/bin/python -c "import trainer, deepspeed, transformers, pytest" >/dev/null 2>&1 \
   || [ pyproject.toml -nt .venv/.installed ]; then
  .venv/bin/pip install -q --upgrade pip
  # torch first and exactly: pip takes the CPU build of 2.13.0 that lies on this machine's disk.
  .venv/bin/pip install -q "torch==2.13.0"
  .venv/bin/pip install -q -e ".[test]"
  touch .venv/.installed
fi
