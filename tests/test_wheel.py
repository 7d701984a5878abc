"""The wheel, built from this checkout and installed into a fresh virtual environment, works on its own.

The wheel is built from a copy of the checkout without any generated code, so
that it proves the build generates the gRPC code itself.  The environment
lives outside the checkout and every command runs from a folder outside it,
so nothing can be imported from the source tree.  To stay fast and not pull a
CUDA torch, the environment sees the system's site-packages (torch, grpcio...)
and the wheel is installed with ``--no-deps``; the tests check that kvpool and
kvpoold still come from the environment's own copy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow

#: test helpers of kvpool.kernels that must not ship (they live with the tests)
TEST_ONLY_KERNEL_MODULES = ("cuda_emulator", "reference", "testing")

#: what a build leaves in a checkout; none of it may reach the copy the wheel is built from
_NOT_SOURCE = shutil.ignore_patterns(
    ".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__", "*.pyc", ".pytest_cache",
    ".hypothesis", "kvpool_pb2*",
)

_CLIENT = """
import json, sys
import kvpool, kvpoold
import kvpool.protocol.kvpool_pb2 as pb
layout = kvpool.Layout("wheel-model", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_size=4)
with kvpool.connect(sys.argv[1], name="wheel", layout=layout) as client:
    seq = client.create_sequence(list(range(10)))
    kv = client.kv_cache()
    kv[int(seq.block_table[0])] = 1.0
    print(json.dumps({
        "files": {"kvpool": kvpool.__file__, "kvpool_pb2": pb.__file__, "kvpoold": kvpoold.__file__},
        "blocks": len(seq.block_table), "shape": list(kv.shape), "value": float(kv[int(seq.block_table[0])].sum()),
    }))
"""


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVPOOL_CONFIG", "KVPOOL_SOCKET")}
    env["PYTHONNOUSERSITE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _run(args, cwd, timeout=120, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run([str(a) for a in args], cwd=cwd, env=_env(), capture_output=True, text=True,
                         timeout=timeout, **kw)
    assert out.returncode == 0, f"{args} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}"
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCE)
    assert not list((src / "client").rglob("kvpool_pb2*")), "the copy must not hold generated code"
    dist = work / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", dist, src], cwd=work, timeout=600)
    (path,) = dist.glob("kvpool-*.whl")
    return path


@pytest.fixture(scope="module")
def wheel_names(wheel) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    env_dir = tmp_path_factory.mktemp("venv") / "env"
    assert not env_dir.resolve().is_relative_to(ROOT)
    _run([sys.executable, "-m", "venv", "--system-site-packages", env_dir], cwd=env_dir.parent, timeout=300)
    _run([env_dir / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", wheel], cwd=env_dir.parent,
         timeout=300)
    return env_dir


def test_wheel_ships_the_generated_code(wheel_names):
    for name in ("kvpool_pb2.py", "kvpool_pb2_grpc.py"):
        assert f"kvpool/protocol/{name}" in wheel_names
    for name in ("kvpool/__init__.py", "kvpool/ipc/__init__.py", "kvpool/protocol/wire.py",
                 "kvpool/kernels/__init__.py", "kvpoold/cli.py", "kvpoold/memory/cpu_shm.py"):
        assert name in wheel_names
    assert not [n for n in wheel_names if n.startswith(("kvpool/_generated/", "tests/", "client/"))]


def test_wheel_ships_no_test_only_kernel_modules(wheel_names):
    shipped = [m for m in TEST_ONLY_KERNEL_MODULES if f"kvpool/kernels/{m}.py" in wheel_names]
    assert not shipped, f"test-only modules in the wheel: {shipped}"


def test_installed_wheel_runs_daemon_client_and_ctl(venv, tmp_path):
    bin_dir = venv / "bin"
    cwd = tmp_path  # outside the checkout: nothing is imported from the source tree
    assert not cwd.resolve().is_relative_to(ROOT)
    config = json.loads(_run([bin_dir / "kvpoold", "--check-config"], cwd=cwd).stdout)
    assert config["backend"] == "cpu" and "pool_bytes" in config

    socket = tmp_path / "kvpoold.sock"
    log_path = tmp_path / "kvpoold.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(bin_dir / "kvpoold"), "--socket", str(socket), "--pool-bytes", "64MiB"],
                                cwd=cwd, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "kvpoold ready" not in log_path.read_text():
            assert proc.poll() is None, f"kvpoold exited with {proc.returncode}:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, f"kvpoold did not become ready:\n{log_path.read_text()}"
            time.sleep(0.1)

        out = _run([bin_dir / "python", "-c", _CLIENT, socket], cwd=cwd)
        answer = json.loads(out.stdout.strip().splitlines()[-1])
        for name, file in answer["files"].items():
            path = Path(file).resolve()
            assert path.is_relative_to(venv.resolve()) and not path.is_relative_to(ROOT), f"{name} from {file}"
        assert answer["blocks"] == 3 and answer["shape"][1:] == [1, 2, 1, 4, 8]
        assert answer["value"] == 2 * 4 * 8

        stats = _run([bin_dir / "kvpoolctl", "--socket", socket, "stats", "--json"], cwd=cwd)
        assert json.loads(stats.stdout)["backend"] == "cpu"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log_path.read_text()
