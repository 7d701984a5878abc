#!/usr/bin/env bash
# On the GPU machine, from a copy of the checkout with the wheels the device image lacks in .whl/ (gRPC,
# protobuf, sdnotify, redis, hiredis, and for kvpool serve fastapi, starlette, pydantic(-core), uvicorn,
# annotated-types, typing-inspection, typing-extensions, opentelemetry-api: benchmarks/NOTES-engine.md):
#
#   bash scripts/device/multimodel.sh        # carry: [".whl"]; about 8 minutes
#
# 1. the elastic pool's GPU tests of chunks moving between classes while their processes run
#    (tests/server/test_gpu_vmm.py, two of them), then
# 2. benchmarks/bench_multimodel.py --backend cuda (the elastic pool, a static split and the elastic pool with a
#    host tier under bursts and a steady mix; a crash and a rolling redeploy of one server; about 6 minutes).
# The warm-restart tests on the GPU take 3-4 minutes more: a call of their own,
#   bash scripts/gpu_tests.sh tests/serve/test_warm_restart.py -rs
# Extra arguments go to the benchmark (--quick, --configs elastic,static, ...). With KVPOOL_CHECK_STEPS=1 in the
# environment every server checks each step's blocks before its kernels run (docs/engine.md: slower steps; for a
# run that looks for a fault, not for figures):
#   KVPOOL_CHECK_STEPS=1 bash scripts/device/multimodel.sh --configs elastic
# Logs, the benchmark's JSON and PNG, and the daemons' and servers' logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/../.."
source scripts/device/prepare.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/gpu.txt"
python3 -c "import matplotlib" 2>/dev/null || echo "matplotlib is missing: the benchmark writes no picture" | tee -a "$OUT/gpu.txt"

timeout --kill-after=10 90 bash scripts/gpu_tests.sh tests/server/test_gpu_vmm.py -rs \
    -k "between_two_of_its_client_calls or gives_its_chunks_to_another" 2>&1 | tee "$OUT/gpu_tests_vmm.log" | tail -5

# each configuration's figures are in the JSON as soon as it is done: a run stopped by the timeout keeps them
# (SIGTERM stops the daemons and servers it started)
KVPOOL_BENCH_RESULTS=$OUT timeout --kill-after=30 380 python3 benchmarks/bench_multimodel.py --backend cuda "$@" 2>&1 \
    | tee "$OUT/bench_multimodel.log"
logs=$(sed -n 's/^run logs: \(.*\)$/\1/p' "$OUT/bench_multimodel.log" | tail -1)
[ -n "$logs" ] && tar -czf "$OUT/bench_multimodel_logs.tgz" -C "$logs" . 2>/dev/null

ls -la "$OUT"
