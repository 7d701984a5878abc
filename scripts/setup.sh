#!/usr/bin/env bash
# Installs kvpool (editable) with its test tools; the build generates the gRPC
# code (setup.py runs scripts/gen_protos.py).
# On a machine without an NVIDIA GPU it first installs the CPU build of torch
# (torch==2.13.0), so that pip never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! command -v nvidia-smi >/dev/null 2>&1; then
    $PY -m pip install -q torch==2.13.0
fi
$PY -m pip install -q -e '.[test]'
# The remote tier's tests start their own redis-server processes (never a system service).
if ! command -v redis-server >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo -n"
    $SUDO apt-get install -y -q redis-server >/dev/null 2>&1 \
        || { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q redis-server >/dev/null 2>&1; } \
        || echo "setup.sh: could not install redis-server: the remote tier's tests will skip" >&2
fi
# The vLLM connector's tests build their own venv when they first run (scripts/vllm_venv.sh): the demo
# does not need it.
