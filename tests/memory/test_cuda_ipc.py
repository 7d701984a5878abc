"""CUDA IPC backend.  Tests marked gpu need an NVIDIA GPU and CuPy and skip without;
the rest (device matching, error messages, lazy import) run everywhere."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kvpool.ipc import BackendUnavailable, DeviceMismatch
from kvpool.ipc.cuda import probe_cuda, resolve_device
from kvpool.protocol import ArenaDescriptor
from kvpoold.memory import PoolDoesNotFit, make_backend

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20
_REASON = probe_cuda(check_ipc=False)


def needs_gpu(f):
    return pytest.mark.gpu(pytest.mark.skipif(_REASON is not None, reason=f"no CUDA: {_REASON}")(f))


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def _child(code: str, *args, stdin=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        env=_env(), stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _desc_json(desc: ArenaDescriptor) -> str:
    return json.dumps({k: "hex:" + v.hex() if isinstance(v, bytes) else v for k, v in desc.to_dict().items()})


def _pattern(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()


_MAP = """
import hashlib, json, sys
import numpy as np, torch
from kvpool.ipc import open_arena
from kvpool.protocol import ArenaDescriptor
d = {k: bytes.fromhex(v[4:]) if isinstance(v, str) and v.startswith("hex:") else v
     for k, v in json.loads(sys.argv[1]).items()}
arena = open_arena(ArenaDescriptor(**d))
def region(off, n):
    return arena.as_tensor("uint8", (n,), offset=off)
def sha(off, n):
    return hashlib.sha256(region(off, n).cpu().numpy().tobytes()).hexdigest()
def pattern(seed, n):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))
"""

# ------------------------------------------------------------------ everywhere

BUSES = ["0000:0A:00.0", "0000:0B:00.0"]


def test_resolve_device_by_bus_id():
    assert resolve_device("0000:0b:00.0", 1, None, BUSES) == 1
    # another CUDA_VISIBLE_DEVICES order: the daemon's cuda:1 is this process's cuda:0
    assert resolve_device("0000:0B:00.0", 1, 0, ["0000:0B:00.0"]) == 0
    assert resolve_device("", 1, None, BUSES) == 1  # no bus id: trust the ordinal


def test_resolve_device_mismatch_messages():
    with pytest.raises(DeviceMismatch, match=r"runs on cuda:0 .*pool is on GPU 0000:0B:00.0"):
        resolve_device("0000:0B:00.0", 1, 0, BUSES)
    with pytest.raises(DeviceMismatch, match="cannot see"):
        resolve_device("0000:FF:00.0", 0, None, BUSES)
    with pytest.raises(DeviceMismatch, match="cannot see"):
        resolve_device("", 3, None, BUSES)


def test_device_spellings():
    import torch

    from kvpool.ipc.cuda import device_index as _device_index

    assert [_device_index(d) for d in (None, 2, "cuda", "cuda:3", torch.device("cuda", 1))] == [None, 2, None, 3, 1]
    with pytest.raises(ValueError, match="not a CUDA device"):
        _device_index("cpu")


@pytest.mark.skipif(_REASON is None, reason="a GPU is present")
def test_no_gpu_says_use_cpu_backend():
    assert isinstance(probe_cuda(), str)
    with pytest.raises(BackendUnavailable, match="--backend cpu"):
        make_backend("cuda", device=0)


def test_cpu_path_never_imports_cupy(tmp_path):
    code = """
import sys
from kvpool.ipc import open_arena
from kvpoold.memory import make_backend
b = make_backend("cpu", instance="lazy", shm_dir=sys.argv[1])
a = b.create_arena("c0", 1 << 20)
import os
open_arena(a.descriptor, fd=os.dup(a.fileno())).as_tensor("float16", (8,))
b.close()
assert "cupy" not in sys.modules, "the CPU path imported cupy"
"""
    p = _child(code, tmp_path)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err


# ------------------------------------------------------------------ on a GPU


@pytest.fixture
def backend():
    from kvpoold.memory.cuda_ipc import CudaBackend

    b = CudaBackend(0)
    yield b
    b.close()


@needs_gpu
def test_two_processes_share_a_cuda_arena(backend):
    arena = backend.create_arena("c0", 64 * MiB)
    n = 32 * MiB
    a = _child(_MAP + """
region(0, 32 << 20).copy_(pattern(1, 32 << 20))
torch.cuda.synchronize()
print("written", flush=True)
sys.stdin.readline()
print(sha(32 << 20, 32 << 20), flush=True)
""", _desc_json(arena.descriptor), stdin=subprocess.PIPE)
    line = a.stdout.readline().strip()
    assert line == "written", a.stderr.read()
    b = _child(_MAP + """
print(sha(0, 32 << 20))
region(32 << 20, 32 << 20).copy_(pattern(2, 32 << 20))
torch.cuda.synchronize()
""", _desc_json(arena.descriptor))
    out, err = b.communicate(timeout=120)
    assert b.returncode == 0, err
    assert out.strip() == _sha(_pattern(1, n))
    a.stdin.write("go\n")
    a.stdin.flush()
    out, err = a.communicate(timeout=120)
    assert a.returncode == 0, err
    assert out.strip() == _sha(_pattern(2, n))
    mine = arena.as_tensor("uint8", (2 * n,)).cpu().numpy()
    assert _sha(mine[:n]) == _sha(_pattern(1, n)) and _sha(mine[n:]) == _sha(_pattern(2, n))


@needs_gpu
def test_wrong_device_is_a_clear_error(backend):
    from kvpool.ipc.cuda import CudaMappedArena

    arena = backend.create_arena("c0", 4 * MiB)
    d = arena.descriptor
    elsewhere = ArenaDescriptor(**{**d.to_dict(), "device_id": "0000:FF:00.0"})
    with pytest.raises(DeviceMismatch, match="cannot see"):
        CudaMappedArena(elsewhere)
    with pytest.raises(DeviceMismatch, match="runs on cuda:7"):
        CudaMappedArena(d, device="cuda:7")


@needs_gpu
def test_pool_that_does_not_fit(backend):
    with pytest.raises(PoolDoesNotFit, match=r"wanted.*free"):
        backend.create_arena("huge", 1 << 50)


@needs_gpu
def test_fraction_sizing_and_close_frees_memory(backend):
    from kvpoold.memory.cuda_ipc import device_memory, pool_bytes_for_fraction

    free0, total = device_memory(0)
    size = pool_bytes_for_fraction(0, 0.5)
    assert 0 < size <= free0 * 0.5 + 1 and size % (2 * MiB) == 0
    with pytest.raises(ValueError):
        pool_bytes_for_fraction(0, 1.5)
    arena = backend.create_arena("big", 8 << 30)
    assert device_memory(0)[0] <= free0 - (8 << 30) + 64 * MiB
    arena.close()
    assert device_memory(0)[0] >= free0 - 64 * MiB


@needs_gpu
def test_daemon_side_views(backend):
    import torch

    arena = backend.create_arena("c0", 4 * MiB)
    t = arena.as_tensor("bfloat16", (4, 2, 2, 16, 64))
    assert t.device == torch.device("cuda", 0) and t.dtype == torch.bfloat16
    t.fill_(1.5)
    c = arena.as_cupy("float16", (8,))  # same bytes, another dtype
    assert c.dtype == np.float16 and int(c.view(np.uint16)[0]) == int(t.view(torch.int16)[0, 0, 0, 0, 0])
    with pytest.raises(ValueError, match="CuPy has no"):
        arena.as_cupy("bfloat16", (8,))
    arena.close()
    assert float(t[0, 0, 0, 0, 0]) == 1.5  # the view keeps the allocation alive

