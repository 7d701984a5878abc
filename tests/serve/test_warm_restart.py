"""Model processes that restart warm: what a killed process computed serves its successor, byte for byte.

Real processes on a real daemon.  A model process prefills a prompt through ``kvpool.hf`` and is SIGKILLed
while it holds the sequence; once the grace period is over the daemon has reclaimed the sequence, the
prompt's blocks stay cached, and a new process of the same model id finds them (``num_cached_tokens``) with
the very bytes the first one wrote, and generates what transformers generates.  The same through ``kvpool
serve``: killed (SIGKILL) or redeployed (SIGTERM) with a request in flight, then started again.  Each test
runs on the CPU backend and, marked ``gpu``, on the GPU's elastic VMM pool where there is one
(``bash scripts/gpu_tests.sh tests/serve/test_warm_restart.py``).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

pytest.importorskip("fastapi")

from hf_models import make_model  # noqa: E402
from servers import Server, wait_for  # noqa: E402

import kvpool  # noqa: E402
from kvpool.serve.demo_model import demo_tokenizer  # noqa: E402

pytestmark = pytest.mark.timeout(600)

RESTART_PROC = str(Path(__file__).with_name("restart_proc.py"))
BACKENDS = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])]
FULL_BLOCKS = 6  # of the hf test's prompt (blocks of 16 tokens), which has 5 tokens more


def start_pool(daemon_factory, backend: str):
    # a long lease: a model process compiling its kernels on a loaded CI machine must keep its session
    # (a dead one is found by its stream and its pid, within the grace period)
    common = ("--grace-seconds", "1", "--lease-seconds", "120")
    if backend == "cuda":
        return daemon_factory("--backend", "cuda", "--cuda-memory", "vmm", "--chunk-bytes", "2MiB",
                              "--pool-bytes", "512MiB", *common)
    return daemon_factory(*common)


def stats(d):
    with kvpool.Connection(d.socket) as conn:
        return conn.stats()


def self_check(d) -> None:
    with kvpool.Connection(d.socket) as conn:
        ok, detail = conn.check()
    assert ok, detail


def wait_reclaimed(d) -> None:
    """The daemon dropped every session and freed every sequence (after its grace period: polled)."""

    def reclaimed() -> bool:
        st = stats(d)
        return st.clients == 0 and st.sequences == 0

    wait_for(reclaimed, timeout=60)


def assert_nothing_left(d, backend: str) -> None:
    wait_reclaimed(d)
    st = stats(d)
    assert all(c.used_blocks == 0 and c.reserved_blocks == 0 for c in st.classes), st.classes
    self_check(d)
    if backend == "cuda":  # chunks the processes mapped are given back once they let go
        wait_for(lambda: stats(d).devices[0].draining_bytes == 0, timeout=60)


def model_proc(d, tmp_path, backend: str, arch: str, role: str, prompt: list[int]) -> list[str]:
    """The command line of a restart_proc.py process."""
    spec = {"arch": arch, "device": backend, "model_id": f"restart-{arch}", "prompt": prompt, "new_tokens": 8,
            "role": role, "dump": str(tmp_path / f"{role}.npy")}
    return [sys.executable, RESTART_PROC, d.socket, json.dumps(spec)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_killed_model_process_prefix_serves_its_successor_byte_exact(daemon_factory, tmp_path, backend, arch):
    d = start_pool(daemon_factory, backend)
    prompt = torch.randint(3, 256, (FULL_BLOCKS * 16 + 5,), generator=torch.Generator().manual_seed(1)).tolist()
    first = subprocess.Popen(model_proc(d, tmp_path, backend, arch, "first", prompt),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = first.stdout.readline()
        assert line, first.stderr.read()[-3000:]
        a = json.loads(line)
        st = stats(d)
        assert a["cached"] == 0 and st.clients == 1 and st.sequences == 1
        first.send_signal(signal.SIGKILL)
        first.wait(60)
        wait_reclaimed(d)  # its sequence is gone; the prompt's full blocks stay in the pool
        (cls,) = stats(d).classes
        assert cls.used_blocks == 0 and cls.reserved_blocks == 0 and cls.cached_blocks >= FULL_BLOCKS
        self_check(d)
    finally:
        first.kill()
        first.wait()
    out = subprocess.run(model_proc(d, tmp_path, backend, arch, "successor", prompt),
                         capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, out.stderr[-3000:]
    b = json.loads(out.stdout.strip().splitlines()[-1])
    assert b["cached"] == FULL_BLOCKS * 16 and b["generate_cached"] == FULL_BLOCKS * 16
    assert b["table"][:FULL_BLOCKS] == a["table"][:FULL_BLOCKS]  # the very blocks the first process wrote
    written, read = np.load(tmp_path / "first.npy"), np.load(tmp_path / "successor.npy")
    assert written.shape == read.shape and written.any()
    assert np.array_equal(written, read)  # byte for byte, through each process's own view of the pool
    assert b["tokens"][0] == a["first_token"]
    assert b["tokens"] == b["reference_tokens"]  # transformers' greedy tokens
    assert_nothing_left(d, backend)


# -- through kvpool serve ------------------------------------------------------------------------------
def tiny_model_dir(path: Path) -> str:
    """A random float32 Llama with head_dim 64 and the demo's word-level tokenizer."""
    make_model("llama", hidden_size=256).save_pretrained(path)
    demo_tokenizer().save_pretrained(path)
    return str(path)


def complete(url: str, prompt: list[int], max_tokens: int = 8) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def stream_until_signal(server: Server, prompt: list[int], sig: int) -> int:
    """A streaming request: once its second token is in, ``sig`` goes to the server; the tokens that came.

    Not at the first: the engine streams a prompt's first token before it tells the daemon that the
    prompt's K/V is written (the same step, after sampling), so a process killed right then leaves the
    last prefill chunk's blocks unconfirmed (dropped, never prefix hits).  The second token's step comes
    after that.
    """
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True}
    tokens = 0
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    tokens += 1
                    if tokens == 2:
                        server.proc.send_signal(sig)
    except httpx.HTTPError:
        assert sig == signal.SIGKILL  # a killed server cuts the stream; a redeployed one finishes it
    return tokens


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["crash", "redeploy"])
def test_restarted_server_finds_its_prompts_in_the_pool(daemon_factory, tmp_path, backend, sig):
    d = start_pool(daemon_factory, backend)
    model_dir = tiny_model_dir(tmp_path / "model")
    g = torch.Generator().manual_seed(2)
    prompt, other = (torch.randint(3, 256, (n,), generator=g).tolist() for n in (150, 90))
    server = Server(model_dir, d.socket, "--device", backend)
    try:
        server.wait_ready(timeout=300)
        a = complete(server.url, prompt)
        assert a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        streamed = stream_until_signal(server, other, sig)  # the server goes with this request running
        assert server.proc.wait(120) == (-signal.SIGKILL if sig == signal.SIGKILL else 0)
        assert streamed == 200 if sig == signal.SIGTERM else streamed >= 2
        wait_reclaimed(d)
        self_check(d)
    finally:
        server.stop()
    successor = Server(model_dir, d.socket, "--device", backend)
    try:
        successor.wait_ready(timeout=300)
        b = complete(successor.url, prompt)
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 150 // 8 * 8  # blocks of 8 tokens
        assert b["choices"][0]["text"] == a["choices"][0]["text"]
        c = complete(successor.url, other)  # the prompt of the request that was running: prefilled, so cached
        assert c["usage"]["prompt_tokens_details"]["cached_tokens"] == 90 // 8 * 8
    finally:
        successor.stop()
    assert_nothing_left(d, backend)
