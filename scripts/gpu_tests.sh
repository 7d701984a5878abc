#!/usr/bin/env bash
# The GPU test suite, on a machine with an NVIDIA GPU and CuPy (pip install -e '.[cuda]'):
# kernels against their float64 reference, CUDA IPC arenas between processes, and the
# daemon with client processes on the GPU.  Extra arguments go to pytest (a path narrows it: tests/tiers).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pytest -q -m gpu -p no:cacheprovider "$@"  # no path given: pyproject testpaths (tests)
