"""The elastic GPU pool (CUDA VMM): chunk costs, paging cost, and a burst between models.

    python3 benchmarks/bench_vmm.py [--parts chunks,firstmap,kernels,burst] [--chunks 512] [--pool-gib 6]

* ``chunks``: per 2 MiB chunk, the daemon's create + map (``VmmArena.commit``),
  export as a file descriptor, and a client process importing + mapping what
  came over a Unix socket with SCM_RIGHTS, batched as the side socket does.
* ``firstmap``: end to end through a daemon: a new client's first
  ``kv_cache()`` mapping every chunk of a class another client filled.
* ``kernels``: paged decode (B=32 x 4096, bf16, 32/8 heads, d=128) and prefill
  (one 4096-token sequence) on a pool in VMM chunks against the same kernels
  on one plain ``torch.empty`` allocation; interleaved, median of CUDA-event times.
* ``burst``: three models of three geometries on one GPU, two idle (each
  holding a few sequences), one bursting: how many 1024-token sequences the
  bursting model holds at once on one elastic pool of P bytes, against a
  static split (its own pool of P/3, what three one-model pools would give);
  and how long a create that needs memory another model just freed takes,
  against one served from unassigned memory.

Prints tables and writes ``benchmarks/results/vmm.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import print_table, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MiB, GiB = 1 << 20, 1 << 30


# -- chunks -------------------------------------------------------------------------------------
_IMPORTER = r"""
import os, socket, sys, time
from kvpool.ipc.vmm import VirtualRange, check, posix_fd_type, use_device
sock = socket.socket(fileno=int(sys.argv[1]))
n, chunk = int(sys.argv[2]), int(sys.argv[3])
cu = use_device(0)
vr = VirtualRange(0, n * chunk, chunk)
t0, done = None, 0
while done < n:
    data, fds, _f, _a = socket.recv_fds(sock, 64, 64)
    if t0 is None:
        t0 = time.perf_counter()
    for fd in fds:
        h = check(cu.cuMemImportFromShareableHandle(fd, posix_fd_type()), "import")
        os.close(fd)
        vr.map(done, h)
        done += 1
    sock.sendall(b"n")
print((time.perf_counter() - t0) / n * 1e3, flush=True)
vr.free(release_handles=True)
"""


def bench_chunks(n: int) -> dict:
    from kvpoold.memory.cuda_vmm import VmmBackend

    backend = VmmBackend(0)
    c = backend.chunk_bytes
    arena = backend.create_arena("bench", n * c, class_id=0)
    t0 = time.perf_counter()
    arena.commit(0, n * c)
    commit_ms = (time.perf_counter() - t0) / n * 1e3
    chunks = [backend.ledger.places[0][i] for i in range(n)]
    t0 = time.perf_counter()
    fds = [backend.export(ch) for ch in chunks]
    export_ms = (time.perf_counter() - t0) / n * 1e3
    for fd in fds:
        os.close(fd)
    a, b = socket.socketpair()
    child = subprocess.Popen([sys.executable, "-c", _IMPORTER, str(b.fileno()), str(n), str(c)],
                             pass_fds=[b.fileno()], stdout=subprocess.PIPE, text=True)
    b.close()
    t0 = time.perf_counter()
    for start in range(0, n, 64):
        batch = chunks[start:start + 64]
        fds = [backend.export(ch) for ch in batch]
        socket.send_fds(a, [b"f"], fds)
        for fd in fds:
            os.close(fd)
        a.recv(1)
    handoff_ms = (time.perf_counter() - t0) / n * 1e3
    import_ms = float(child.communicate(timeout=120)[0].strip())
    t0 = time.perf_counter()
    arena.release(0, n * c)
    backend.settle()
    release_ms = (time.perf_counter() - t0) / n * 1e3
    backend.close()
    return {"chunks": n, "chunk_bytes": c, "create_map_ms": commit_ms, "export_ms": export_ms,
            "import_map_ms": import_ms, "export_send_import_map_ms": handoff_ms, "unmap_release_ms": release_ms}


class Daemon:
    def __init__(self, pool_bytes: int, *extra: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvpool-bench-vmm-")
        self.socket = os.path.join(self.dir, "kvpoold.sock")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvpoold", "--backend", "cuda", "--socket", self.socket, "--pool-bytes",
             str(pool_bytes), "--admin-socket", "none", "--log-level", "warning", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        line = self.proc.stdout.readline()
        if "ready" not in line:
            raise RuntimeError(f"kvpoold did not start: {line}{self.proc.stderr.read()[-2000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def layout(model: str, layers: int, kv_heads: int, head_dim: int, dtype: str):
    import kvpool

    return kvpool.Layout(model, num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)


def bench_first_map(pool_bytes: int) -> dict:
    """A client's first kv_cache() maps every chunk its class has (end to end, through the side socket)."""
    import kvpool

    d = Daemon(pool_bytes)
    try:
        lay = layout("map", 8, 8, 128, "bfloat16")  # 512 KiB blocks
        with kvpool.connect(d.socket, name="filler", layout=lay, device=0) as a:
            a.kv_cache()
            seqs, n = [], 0
            try:
                while True:
                    seqs += a.create_sequences([[n * 4096 + i for i in range(1024)] for n in range(n, n + 8)])
                    n += 8
            except kvpool.OutOfBlocks:
                pass
            chunks = a._mapping.arena.chunk_of.astype(bool).sum()
            with kvpool.connect(d.socket, name="mapper", layout=lay, device=0) as b:
                t0 = time.perf_counter()
                b.kv_cache()
                ms = (time.perf_counter() - t0) * 1e3
        return {"chunks": int(chunks), "first_kv_cache_ms": ms, "per_chunk_ms": ms / max(1, chunks)}
    finally:
        d.stop()


# -- kernels --------------------------------------------------------------------------------------
def _time(fn, reps: int = 30) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3  # us


def bench_kernels() -> list[dict]:
    from kvpool.kernels import paged_decode_attention, paged_prefill_attention
    from kvpoold.memory.cuda_vmm import VmmBackend

    hq, hkv, d, bs, dtype = 32, 8, 128, 16, torch.bfloat16
    batch, ctx = 32, 4096
    per_seq = ctx // bs
    nblocks = batch * per_seq
    block_elems = 2 * hkv * bs * d
    nbytes = nblocks * block_elems * 2
    backend = VmmBackend(0)
    c = backend.chunk_bytes
    arena = backend.create_arena("kern", -(-nbytes // c) * c, class_id=0)
    arena.commit(0, arena.nbytes)
    pools = {
        "vmm": arena.as_tensor("bfloat16", (nblocks, 1, 2, hkv, bs, d)),
        "plain": torch.empty((nblocks, 1, 2, hkv, bs, d), dtype=dtype, device="cuda"),
    }
    g = torch.Generator(device="cuda").manual_seed(0)
    for p in pools.values():  # the same bytes in both pools: the outputs must be equal
        p.copy_(torch.randn(p.shape, generator=torch.Generator(device="cuda").manual_seed(0), device="cuda",
                            dtype=torch.float32).to(dtype))
    perm = torch.randperm(nblocks, device="cuda", generator=g).to(torch.int32)
    tables = perm.view(batch, per_seq)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, hq, d, device="cuda", dtype=dtype, generator=g)
    qp = torch.randn(ctx, hq, d, device="cuda", dtype=dtype, generator=g)
    cu = torch.tensor([0, ctx], dtype=torch.int32, device="cuda")
    rows = []
    for name, call in (
        ("decode B32 x 4096", lambda kv: paged_decode_attention(q, kv[:, 0, 0], kv[:, 0, 1], tables, lens,
                                                                 max_seq_len=ctx)),
        ("prefill 4096", lambda kv: paged_prefill_attention(qp, kv[:, 0, 0], kv[:, 0, 1], tables[:1], lens[:1], cu,
                                                            max_seq_len=ctx)),
    ):
        out_v, out_p = call(pools["vmm"]), call(pools["plain"])
        diff = (out_v.float() - out_p.float()).abs().max().item()  # the same bytes: 0 unless the kernel races
        times = {"vmm": [], "plain": []}
        for _ in range(7):  # interleaved: clocks and neighbours drift alike for both
            for kind in ("vmm", "plain"):
                times[kind].append(_time(lambda: call(pools[kind])))
        v, p = statistics.median(times["vmm"]), statistics.median(times["plain"])
        rows.append({"kernel": name, "vmm_us": v, "plain_us": p, "vmm_over_plain": v / p, "max_abs_diff": diff})
    del pools
    backend.close()
    return rows


# -- a burst between models -----------------------------------------------------------------------------
MODELS = {  # three geometries of one GPU: 8x128 bf16, 2x64 fp16, 1x256 fp32 (KV heads x head dim)
    "burst": ("burst", 16, 8, 128, "bfloat16"),
    "idle-a": ("idle-a", 16, 2, 64, "float16"),
    "idle-b": ("idle-b", 16, 1, 256, "float32"),
}


def _fill(client, tokens: int, limit: int | None = None) -> int:
    import kvpool

    n = 0
    try:
        while limit is None or n < limit:
            client.create_sequence([client.session_id * 10**7 + n * tokens + i for i in range(tokens)])
            n += 1
    except kvpool.OutOfBlocks:
        pass
    return n


def bench_burst(pool_bytes: int, idle_seqs: int = 8, tokens: int = 1024) -> dict:
    import kvpool

    out = {"pool_bytes": pool_bytes, "tokens_per_sequence": tokens, "idle_sequences_each": idle_seqs}
    d = Daemon(pool_bytes, "--release-after-seconds", "3600")
    try:
        idle = [kvpool.connect(d.socket, name=m, layout=layout(*MODELS[m]), device=0) for m in ("idle-a", "idle-b")]
        for c in idle:
            c.kv_cache()
            _fill(c, tokens, idle_seqs)
        with kvpool.connect(d.socket, name="burst", layout=layout(*MODELS["burst"]), device=0) as b:
            b.kv_cache()
            out["elastic_sequences"] = _fill(b, tokens)
        for c in idle:
            c.close()
    finally:
        d.stop()
    d = Daemon(pool_bytes // 3 // (2 * MiB) * (2 * MiB), "--release-after-seconds", "3600")
    try:
        with kvpool.connect(d.socket, name="burst", layout=layout(*MODELS["burst"]), device=0) as b:
            b.kv_cache()
            out["static_third_sequences"] = _fill(b, tokens)
    finally:
        d.stop()
    out["elastic_over_static"] = out["elastic_sequences"] / max(1, out["static_third_sequences"])

    # memory one model freed, taken by another: the create that needs it vs one from unassigned memory
    d = Daemon(pool_bytes, "--release-after-seconds", "3600")
    try:
        with kvpool.connect(d.socket, name="burst", layout=layout(*MODELS["burst"]), device=0) as b, \
                kvpool.connect(d.socket, name="idle-a", layout=layout(*MODELS["idle-a"]), device=0) as a:
            a.kv_cache()
            b.kv_cache()
            batch = [[10**8 + n * tokens + i for i in range(tokens)] for n in range(16)]
            t0 = time.perf_counter()
            first = b.create_sequences(batch)  # from unassigned memory
            fresh_ms = (time.perf_counter() - t0) * 1e3
            b.free(first)
            _fill(a, tokens)  # the other model takes every chunk left, and B's cached ones
            a.free(a.sequences())  # ... and lets them go (cached: its bytes stay until needed)
            batch = [[2 * 10**8 + n * tokens + i for i in range(tokens)] for n in range(16)]
            synced, t0 = b.chunk_sync_seconds, time.perf_counter()
            b.create_sequences(batch)  # evicts A's cached blocks, moves their chunks, maps them here
            moved_ms = (time.perf_counter() - t0) * 1e3
            moved_sync_ms = (b.chunk_sync_seconds - synced) * 1e3
        out.update({"create_16x1024_fresh_ms": fresh_ms, "create_16x1024_from_other_model_ms": moved_ms,
                    "of_which_client_mapping_ms": moved_sync_ms})
    finally:
        d.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="chunks,firstmap,kernels,burst")
    ap.add_argument("--chunks", type=int, default=512)
    ap.add_argument("--pool-gib", type=float, default=6.0)
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    result = {"gpu": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d")}
    if "chunks" in parts:
        r = result["chunks"] = bench_chunks(args.chunks)
        print_table(f"chunk operations, per {r['chunk_bytes'] >> 20} MiB chunk ({r['chunks']} chunks)",
                    ["operation", "ms per chunk"],
                    [[k[:-3], f"{v:.4f}"] for k, v in r.items() if k.endswith("_ms")])
    if "firstmap" in parts:
        r = result["first_map"] = bench_first_map(int(args.pool_gib * GiB) // 2)
        print_table("a client's first kv_cache(): every chunk of its class over the side socket",
                    ["chunks", "ms", "ms per chunk"],
                    [[r["chunks"], f"{r['first_kv_cache_ms']:.1f}", f"{r['per_chunk_ms']:.4f}"]])
    if "kernels" in parts:
        rows = result["kernels"] = bench_kernels()
        print_table("the same kernels on VMM chunks vs one plain allocation", ["kernel", "vmm us", "plain us", "ratio"],
                    [[r["kernel"], f"{r['vmm_us']:.1f}", f"{r['plain_us']:.1f}", f"{r['vmm_over_plain']:.4f}"]
                     for r in rows])
    if "burst" in parts:
        r = result["burst"] = bench_burst(int(args.pool_gib * GiB))
        print_table(f"a burst: one model bursting, two idle ({r['idle_sequences_each']} sequences each), "
                    f"{args.pool_gib:g} GiB", ["", "value"],
                    [["sequences, elastic pool", r["elastic_sequences"]],
                     ["sequences, static 1/3 split", r["static_third_sequences"]],
                     ["elastic / static", f"{r['elastic_over_static']:.2f}x"],
                     ["create 16x1024 from unassigned memory (ms)", f"{r['create_16x1024_fresh_ms']:.1f}"],
                     ["create 16x1024 from memory another model freed (ms)",
                      f"{r['create_16x1024_from_other_model_ms']:.1f}"],
                     ["  of which this client mapping the chunks (ms)", f"{r['of_which_client_mapping_ms']:.1f}"]])
    write_json("vmm", result)
    out = os.environ.get("OUT")
    if out:
        Path(out, "vmm.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
