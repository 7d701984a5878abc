"""The GPU attention kernels on a pool with unmapped places, as an elastic class's range has after it gave chunks
back: no read of a block named past a sequence's length (it would fault), results equal to the reference. Each
case runs in a process of its own (``support/holes_probe.py``), so a fault fails this test and no other.

    bash scripts/gpu_tests.sh tests/kernels/test_gpu_holes.py
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernels_never_touch_an_unmapped_block_past_a_sequence(head_dim):
    pytest.importorskip("cuda.bindings.driver", reason="CUDA virtual memory needs cuda-python")
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.support.holes_probe", str(head_dim)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    assert proc.stdout.count("ok: ") == 3, proc.stdout
