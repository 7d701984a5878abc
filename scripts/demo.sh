#!/usr/bin/env bash
# The main job on any machine: kvpoold on the embedded CPU backend, two model
# processes sharing a prompt prefix through it, then `kvpoolctl stats`; then
# two `kvpool serve` processes of a tiny model built here, on the same daemon,
# queried with curl and the openai client, the second finding the first's prompt.
set -euo pipefail
cd "$(dirname "$0")/.."
ctl() {  # the installed console script, or the same module when scripts are not on PATH
    if command -v kvpoolctl >/dev/null 2>&1; then kvpoolctl "$@"; else python3 -m kvpoold.ctl "$@"; fi
}
dir=$(mktemp -d)
sock="$dir/kvpoold.sock"
pids=()
python3 -m kvpoold --socket "$sock" --pool-bytes 256MiB --log-level warning &
pids+=($!)
trap 'kill "${pids[@]}" 2>/dev/null; wait "${pids[@]}" 2>/dev/null; rm -rf "$dir"' EXIT
for _ in $(seq 100); do
    ctl --socket "$sock" --timeout 1 check >/dev/null 2>&1 && break
    sleep 0.2
done
python3 examples/shared_prefix_demo.py --socket "$sock"
ctl --socket "$sock" stats

# two OpenAI-compatible servers of one tiny random-weight model (python3 -m kvpool.serve is `kvpool serve`)
python3 -m kvpool.serve.demo_model "$dir/tiny" >/dev/null
read -r port_a port_b < <(python3 -c '
import socket
socks = [socket.socket() for _ in range(2)]
for s in socks: s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in socks))')
for port in "$port_a" "$port_b"; do
    python3 -m kvpool.serve --model "$dir/tiny" --served-model-name tiny --socket "$sock" --port "$port" \
        --block-size 8 --log-level warning >"$dir/serve-$port.log" 2>&1 &
    pids+=($!)
done
for port in "$port_a" "$port_b"; do
    for _ in $(seq 300); do
        curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
        sleep 0.2
    done
done
prompt="the quick brown fox jumps over the lazy dog a pool of blocks holds the keys and values of every sequence"
echo "serve-a: curl /v1/completions"
curl -sf "http://127.0.0.1:$port_a/v1/completions" -H 'content-type: application/json' \
    -d "{\"model\": \"tiny\", \"prompt\": \"$prompt\", \"max_tokens\": 8, \"temperature\": 0}"
echo
python3 examples/serve_demo.py --url "http://127.0.0.1:$port_b" --prompt "$prompt" --name serve-b
curl -sf "http://127.0.0.1:$port_b/metrics" | grep -E '^kvpool_serve_(prefix_hit_tokens|generation_tokens)_total'
ctl --socket "$sock" clients
