"""Connecting a CPU model compiles the CPU kernels first: a Numba compile holds the GIL, and a first forward
that compiled them inside the session could starve the heartbeat past the session's lease."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

HERE = Path(__file__).resolve().parent
PROBE = f"""
import sys
sys.path[:0] = [{str(HERE)!r}]
from hf_models import make_model
from kvpool.hf import PagedModel
from kvpool.kernels import cpu_attention, cpu_write_kv

assert not cpu_attention.paged_attention_cpu.signatures, "compiled before connect"
with PagedModel.connect(make_model("llama"), sys.argv[1], name="warm", model_id="warm-llama", block_size=8) as pm:
    compiled = (len(cpu_attention.paged_attention_cpu.signatures), len(cpu_write_kv.write_kv_cpu.signatures))
print(compiled)
"""


def test_connect_compiles_the_cpu_kernels_before_the_session_starts(daemon):
    out = subprocess.run([sys.executable, "-c", PROBE, daemon.socket], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    attention, write = eval(out.stdout.strip().splitlines()[-1])
    assert attention >= 1 and write >= 1
