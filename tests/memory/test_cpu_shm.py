"""CPU shared-memory backend: real anonymous memfds, real processes, real page accounting."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from kvpool.ipc import open_arena
from kvpool.protocol import ArenaDescriptor
from kvpoold.memory import make_backend
from kvpool.ipc.cpu_shm import CpuMappedArena
from kvpoold.memory.cpu_shm import ARENA_SEALS, CpuShmBackend, instance_id

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20

pytestmark = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (Linux)")


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def _child(code: str, *args, stdin=None, stdout=subprocess.PIPE, pass_fds=()) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
        env=_env(), stdin=stdin, stdout=stdout, stderr=subprocess.PIPE, text=True, pass_fds=pass_fds,
    )


def _open(arena):
    """What a client does with the fd the daemon sends it: map it (``open_arena`` closes its copy)."""
    return open_arena(arena.descriptor, fd=os.dup(arena.fileno()))


def _pattern(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


@pytest.fixture
def backend():
    b = CpuShmBackend(f"t{uuid.uuid4().hex[:10]}")
    yield b
    b.close()


# The child maps the daemon's arena from a JSON descriptor and the inherited fd given on argv.
_MAP = """
import json, sys, hashlib
import numpy as np
from kvpool.ipc import open_arena
from kvpool.protocol import ArenaDescriptor
d = {k: bytes.fromhex(v[4:]) if isinstance(v, str) and v.startswith("hex:") else v
     for k, v in json.loads(sys.argv[1]).items()}
arena = open_arena(ArenaDescriptor(**d), fd=int(sys.argv[2]))
def region(off, n):
    return np.asarray(arena.as_tensor("uint8", (n,), offset=off))
def sha(off, n):
    return hashlib.sha256(region(off, n).tobytes()).hexdigest()
def pattern(seed, n):
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
"""


def _desc_json(arena) -> str:
    d = arena.descriptor.to_dict()
    return json.dumps({k: "hex:" + v.hex() if isinstance(v, bytes) else v for k, v in d.items()})


def test_two_processes_share_bytes(backend):
    arena = backend.create_arena("cls0", 4 * MiB)
    # A writes 1 MiB at offset 0 and stays alive; B reads it and writes at 1 MiB; A reads B's bytes.
    a = _child(_MAP + """
region(0, 1 << 20)[:] = pattern(1, 1 << 20)
print("written", flush=True)
sys.stdin.readline()
print(sha(1 << 20, 1 << 20), flush=True)
""", _desc_json(arena), arena.fileno(), stdin=subprocess.PIPE, pass_fds=(arena.fileno(),))
    assert a.stdout.readline().strip() == "written", a.stderr.read()
    b = _child(_MAP + """
print(sha(0, 1 << 20))
region(1 << 20, 1 << 20)[:] = pattern(2, 1 << 20)
""", _desc_json(arena), arena.fileno(), pass_fds=(arena.fileno(),))
    out, err = b.communicate(timeout=60)
    assert b.returncode == 0, err
    assert out.strip() == hashlib.sha256(_pattern(1, MiB).tobytes()).hexdigest()
    a.stdin.write("go\n")
    a.stdin.flush()
    out, err = a.communicate(timeout=60)
    assert a.returncode == 0, err
    assert out.strip() == hashlib.sha256(_pattern(2, MiB).tobytes()).hexdigest()
    # and the daemon's own view holds both
    mine = arena.as_tensor("uint8", (2 * MiB,)).numpy()
    assert np.array_equal(mine[:MiB], _pattern(1, MiB))
    assert np.array_equal(mine[MiB:], _pattern(2, MiB))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float8_e4m3fn", "uint8"])
def test_client_tensor_zero_copy(backend, dtype):
    arena = backend.create_arena("cls0", 2 * MiB)
    client = _open(arena)
    shape = (4, 2, 2, 16, 8)  # blocks, layers, k|v, tokens, dim
    t = client.as_tensor(dtype, shape)
    assert t.dtype == getattr(torch, dtype) and tuple(t.shape) == shape and t.is_contiguous()
    src = torch.randn(shape).to(getattr(torch, dtype))
    t.copy_(src)
    daemon_view = arena.as_tensor(dtype, shape)
    assert torch.equal(daemon_view.view(torch.uint8), src.view(torch.uint8))
    if dtype in ("float16", "float32", "uint8"):
        a = np.asarray(t)
        assert a.flags.writeable and a.dtype == np.dtype(dtype)
        a[1] = 7
        assert bool((daemon_view[1] == 7).all())
    client.close()


def test_views_bounds_and_dtype_errors(backend):
    arena = backend.create_arena("cls0", MiB)
    client = CpuMappedArena(arena.descriptor, os.dup(arena.fileno()))
    with pytest.raises(ValueError, match="unknown dtype"):
        client.as_tensor("int4", (4,))
    with pytest.raises(ValueError, match="does not fit"):
        client.as_tensor("float32", (MiB,))
    with pytest.raises(ValueError, match="multiple"):
        client.as_tensor("float32", (4,), offset=2)
    with pytest.raises(ValueError, match="not a CPU arena"):
        CpuMappedArena(ArenaDescriptor(kind="cuda", nbytes=1, handle=b"x"))
    with pytest.raises(ValueError, match="not a CPU arena"):  # the old name-based kind: nothing opens by name
        CpuMappedArena(ArenaDescriptor(kind="cpu", nbytes=1, handle=b"/dev/shm/kvpool-x"), -1)
    with pytest.raises(ValueError, match="file descriptor"):
        CpuMappedArena(arena.descriptor)
    with pytest.raises(ValueError, match="holds"):
        CpuMappedArena(ArenaDescriptor(kind="memfd", nbytes=2 * MiB, handle=b"x"), os.dup(arena.fileno()))


def test_release_frees_pages(backend):
    arena = backend.create_arena("cls0", 16 * MiB)
    assert arena.resident_bytes() == 0  # sparse: ftruncate commits nothing
    arena.commit(0, 8 * MiB)
    assert arena.resident_bytes() >= 8 * MiB
    client = _open(arena)
    data = client.as_tensor("uint8", (16 * MiB,)).numpy()
    data[:] = 0xAB  # a client touches every page
    assert arena.resident_bytes() >= 16 * MiB
    before = os.fstat(arena.fileno()).st_blocks
    arena.release(4 * MiB, 8 * MiB)  # the core took the middle slabs back
    after = os.fstat(arena.fileno()).st_blocks
    assert (before - after) * 512 >= 8 * MiB
    assert (data[4 * MiB:12 * MiB] == 0).all()  # the client sees the hole
    assert (data[:4 * MiB] == 0xAB).all() and (data[12 * MiB:] == 0xAB).all()
    # an unaligned range releases only whole pages inside it
    arena.release(100, 5000)
    assert data[100] == 0xAB
    with pytest.raises(ValueError):
        arena.release(15 * MiB, 2 * MiB)


def test_an_arena_is_sealed_at_its_size_before_anyone_gets_its_fd(backend):
    """A client holds the daemon's very file: shrinking it would fault the daemon's next read (SIGBUS),
    growing it would hold memory outside the pool; the seals allow neither, and no seal can be added."""
    arena = backend.create_arena("cls0", 4 * MiB)
    fd = os.dup(arena.fileno())  # what the side socket sends: the same open file
    try:
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) == ARENA_SEALS
        for size in (0, 2 * MiB, 8 * MiB):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 4 * MiB)  # writing past the end would grow it
        with pytest.raises(PermissionError):
            os.posix_fallocate(fd, 4 * MiB - 4096, 8192)  # so would allocating past it
        with pytest.raises(PermissionError):
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)  # nor can a client freeze it
        assert os.fstat(fd).st_size == 4 * MiB
        # what the daemon and its clients do with it still works: commit, write, map, release
        arena.commit(0, 4 * MiB)
        os.pwrite(fd, b"y", 4 * MiB - 1)
        client = _open(arena)
        assert client.as_tensor("uint8", (4 * MiB,)).numpy()[-1] == ord("y")
        arena.release(0, 4 * MiB)
        assert arena.resident_bytes() == 0
    finally:
        os.close(fd)


def test_arenas_have_no_name_to_squat_or_leave_behind(backend, tmp_path):
    other = f"x{uuid.uuid4().hex[:10]}"

    def named():  # files in /dev/shm naming either instance (others' files come and go meanwhile)
        return [n for n in os.listdir("/dev/shm") if backend.instance in n or other in n]

    arena = backend.create_arena("c0", MiB)
    assert os.readlink(f"/proc/self/fd/{arena.fileno()}").startswith("/memfd:kvpool-")
    assert named() == []  # nothing by name, so nothing to squat
    # a crashed daemon leaves nothing: the kernel frees the memfd with the process
    p = _child("""
import os, signal, sys
from kvpoold.memory.cpu_shm import CpuShmBackend
b = CpuShmBackend(sys.argv[1])
for tag in ("c0", "c1"):
    b.create_arena(tag, 1 << 20)
os.kill(os.getpid(), signal.SIGKILL)
""", other)
    p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL
    assert named() == []
    again = backend.create_arena("c0", MiB)  # the same tag twice: two arenas, no clash
    assert again.fileno() != arena.fileno()


def test_close_is_idempotent_and_views_survive(backend):
    arena = backend.create_arena("cls0", 2 * MiB)
    view = arena.as_tensor("uint8", (2 * MiB,))
    client = _open(arena)
    cview = client.as_tensor("uint8", (2 * MiB,))
    view[:10] = 5
    arena.close()
    arena.close()
    backend.close()
    backend.close()
    with pytest.raises(RuntimeError, match="closed"):
        arena.fileno()  # no more fds to hand out
    assert int(view[3]) == 5 and int(cview[3]) == 5  # live views still map the bytes
    cview[4] = 9
    assert int(view[4]) == 9  # and still share them
    client.close()
    client.close()
    assert int(cview[4]) == 9
    with pytest.raises(RuntimeError, match="closed"):
        client.as_tensor("uint8", (1,))


def test_forked_child_never_closes_the_parents_arena(backend):
    arena = backend.create_arena("cls0", MiB)
    pid = os.fork()
    if pid == 0:  # child: close (as a GC or an atexit would) and leave
        try:
            arena.close()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert arena.fileno() >= 0 and int(arena.as_tensor("uint8", (1,))[0]) == 0


def test_names_and_instances(tmp_path):
    inst = instance_id("/run/kvpoold/kvpoold.sock")
    assert inst == instance_id("/run/kvpoold/../kvpoold/kvpoold.sock") and len(inst) == 12
    assert inst != instance_id(str(tmp_path / "other.sock"))
    with pytest.raises(ValueError, match="instance"):
        CpuShmBackend("a-b")
    b = make_backend("cpu", instance="y", shm_dir=str(tmp_path))
    a = b.create_arena("c0:meta/llama 8b", 4096)
    assert a.name == "kvpool-y-c0_meta_llama_8b" and a.descriptor.kind == "memfd"
    assert os.listdir(tmp_path) == []  # shm_dir holds no files
    b.close()


def test_descriptor_dict_roundtrip(backend):
    arena = backend.create_arena("cls0", MiB)
    d = arena.descriptor.to_dict()
    assert set(d) >= {"kind", "nbytes", "handle"}
    assert ArenaDescriptor.from_dict({**d, "future_field": 1}) == arena.descriptor
    client = open_arena(d, fd=os.dup(arena.fileno()))
    assert client.as_tensor("uint8", (16,)).numel() == 16


def test_close_arena_gives_back_its_descriptors_and_forgets_it(backend):
    """A dropped class's arena goes at once: its memfd and the mapping's own copy of it are closed."""
    before = len(os.listdir("/proc/self/fd"))
    arenas = [backend.create_arena(f"c{i}", MiB) for i in range(5)]
    for a in arenas:
        a.commit(0, MiB)
    assert len(os.listdir("/proc/self/fd")) == before + 2 * len(arenas)
    for a in arenas:
        backend.close_arena(a)
    assert len(os.listdir("/proc/self/fd")) == before
    assert backend._arenas == []
