#!/usr/bin/env bash
# The main job on any machine: kvpoold on the embedded CPU backend, two model
# processes sharing a prompt prefix through it, then `kvpoolctl stats`.
set -euo pipefail
cd "$(dirname "$0")/.."
ctl() {  # the installed console script, or the same module when scripts are not on PATH
    if command -v kvpoolctl >/dev/null 2>&1; then kvpoolctl "$@"; else python3 -m kvpoold.ctl "$@"; fi
}
dir=$(mktemp -d)
sock="$dir/kvpoold.sock"
python3 -m kvpoold --socket "$sock" --pool-bytes 256MiB --log-level warning &
daemon=$!
trap 'kill "$daemon" 2>/dev/null; wait "$daemon" 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 100); do
    ctl --socket "$sock" --timeout 1 check >/dev/null 2>&1 && break
    sleep 0.2
done
python3 examples/shared_prefix_demo.py --socket "$sock"
ctl --socket "$sock" stats
