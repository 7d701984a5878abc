#!/usr/bin/env bash
# On the GPU machine, from a copy of the checkout with the wheels the device image lacks in .whl/
# (benchmarks/NOTES-engine.md lists them):
#
#   bash scripts/device/offline.sh [bench_offline.py arguments]    # carry: [".whl"]; at most 9.5 minutes
#
# 1. the fused layers' and the engine's GPU tests (tests/hf/test_fused_gpu.py, tests/engine/test_engine_gpu.py,
#    tests/engine/test_differential_gpu.py: serial and overlapped steps against transformers), or those in $TESTS,
# 2. benchmarks/bench_offline.py (default: --fused on --overlap both, Llama-3.1-8B and -3.2-1B shapes): 1,000
#    ShareGPT-like requests at once, output tok/s against the measured limit; decode steps at 32/64/128 x 1k
#    tokens, wall time against GPU time against the bandwidth floor; serial and overlapped steps.
# Logs and the benchmark's JSON go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/prepare.sh
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1 | tee "$OUT/gpu.txt"

TESTS=${TESTS:-tests/hf/test_fused_gpu.py tests/engine/test_engine_gpu.py tests/engine/test_differential_gpu.py}
export KVPOOL_DIFF_EXAMPLES=${KVPOOL_DIFF_EXAMPLES:-6}
# shellcheck disable=SC2086
timeout --kill-after=10 ${TESTS_TIMEOUT:-150} bash scripts/gpu_tests.sh $TESTS -rs ${TESTS_K:+-k "$TESTS_K"} 2>&1 \
    | grep -v "^$" | tee "$OUT/gpu_tests.log" | tail -15

args=("$@")
[ ${#args[@]} -eq 0 ] && args=(--fused on --overlap both)
# the JSON, in $OUT, is rewritten after every run: a run stopped by the timeout keeps what it measured
KVPOOL_BENCH_RESULTS=$OUT timeout --kill-after=30 ${BENCH_TIMEOUT:-420} python3 benchmarks/bench_offline.py "${args[@]}" \
    2>&1 | tee "$OUT/bench_offline.log"
ls -la "$OUT"
