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
