"""What a machine without a usable GPU says when asked for the CUDA backend."""

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_backend_without_gpu_says_why_and_what_to_run(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvpoold", "--socket", str(tmp_path / "s.sock"), "--backend", "cuda"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "the CUDA backend cannot run" in out.stderr and "--backend cpu" in out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_several_devices_without_gpu_name_the_first_that_failed(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvpoold", "--socket", str(tmp_path / "s.sock"), "--backend", "cuda",
                          "--devices", "0,1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert out.stderr.startswith("kvpoold: GPU 0: the CUDA backend cannot run") and "--backend cpu" in out.stderr
