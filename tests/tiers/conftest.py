"""Fixtures of the tier tests (helpers in tierlib.py)."""

from __future__ import annotations

import pytest

from tierlib import BLOCK


@pytest.fixture
def tier_daemon(daemon_factory, tmp_path):
    """``tier_daemon(host_blocks, disk_blocks, pool_blocks=256, backend="cpu", disk_dir=None)`` -> Daemon."""

    def make(host_blocks: int = 0, disk_blocks: int = 0, pool_blocks: int = 256, backend: str = "cpu",
             disk_dir=None, start: bool = True):
        args = ["--backend", backend, "--pool-bytes", str(pool_blocks * BLOCK), "--chunk-bytes", "64KiB",
                "--host-bytes", str(host_blocks * BLOCK)]
        if backend == "cuda":  # pools of a few hundred small blocks: less than one 2 MiB VMM chunk (test_gpu_vmm.py)
            args += ["--cuda-memory", "ipc"]
        if disk_blocks:
            args += ["--disk-bytes", str(disk_blocks * BLOCK), "--disk-dir", str(disk_dir or tmp_path / "disk")]
        return daemon_factory(*args, start=start)

    return make
