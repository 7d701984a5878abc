"""Differential scenarios: kvpool.engine under memory pressure against transformers' own generate.

A ``Scenario`` is everything one run varies: the pool (from below one request's
need to above the whole batch), the host and disk tiers, the engine's step
limits, the client's reserve and flush settings, and the requests (prompts with
shared prefixes and repeats, staggered arrivals, aborts).  ``run_engine`` plays
it on a real daemon and returns each request's final output; ``check_outputs``
compares them with the oracle (transformers' greedy ``generate`` on each prompt
alone, float32) and ``check_pool_clean`` checks the daemon afterwards.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field

from hypothesis import strategies as st

import kvpool
import kvpool.engine as ke

#: the tiny Llama of tests/hf (2 layers, 2 KV heads of 16, float32): bytes of one block per token
BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4
VOCAB = 256
MAX_STEPS = 3000


@dataclass(frozen=True)
class Req:
    prompt: tuple[int, ...]
    max_tokens: int
    arrival: int = 0  # the step before which it is added
    abort_at: int | None = None  # the step before which it is aborted (None: never)

    def __repr__(self) -> str:
        abort = f", abort_at={self.abort_at}" if self.abort_at is not None else ""
        return f"Req(len={len(self.prompt)}, head={list(self.prompt[:3])}, max_tokens={self.max_tokens}, " \
               f"arrival={self.arrival}{abort})"


@dataclass(frozen=True)
class Scenario:
    block_size: int
    pool_blocks: int
    host_blocks: int  # 0: no host tier (preemption recomputes)
    disk_blocks: int  # 0: no disk tier
    max_num_seqs: int
    max_num_batched_tokens: int
    flush_every: int
    max_reserve_blocks: int
    requests: tuple[Req, ...] = field(default_factory=tuple)
    bytes_per_token: int = BYTES_PER_TOKEN  # of the model's K/V in the pool
    chunk_bytes: int = 0  # the daemon's --chunk-bytes (0: one block)
    backend: str = "cpu"
    overlap_steps: bool = False  # the engine reads each step's tokens after queuing the next (StepLoop)

    @property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    def blocks_needed(self, req: Req) -> int:
        """Blocks a request holds at its longest: its prompt and every token but the last (no K/V written)."""
        return -(-(len(req.prompt) + req.max_tokens - 1) // self.block_size)

    def daemon_args(self, disk_dir: str) -> list[str]:
        bb, chunk = self.block_bytes, self.chunk_bytes or self.block_bytes
        pool = -(-self.pool_blocks * bb // chunk) * chunk  # whole chunks: the session's ceiling says how many blocks
        args = ["--backend", self.backend, "--pool-bytes", str(pool), "--chunk-bytes", str(chunk),
                "--max-reserve-blocks", str(self.max_reserve_blocks)]
        if self.host_blocks:
            args += ["--host-bytes", str(self.host_blocks * bb)]
        if self.disk_blocks:
            args += ["--disk-dir", disk_dir, "--disk-bytes", str(self.disk_blocks * bb)]
        return args


def tokens(draw, n: int) -> tuple[int, ...]:
    return tuple(draw(st.lists(st.integers(1, VOCAB - 1), min_size=n, max_size=n)))


@st.composite
def requests(draw, max_requests: int = 8, max_prompt: int = 64, max_new: int = 10, max_arrival: int = 40):
    """Prompts with shared prefixes (a common system prompt, whole repeats of earlier prompts) and arrivals."""
    n = draw(st.integers(1, max_requests))
    shared = tokens(draw, draw(st.integers(0, max_prompt // 2)))
    out: list[Req] = []
    for _ in range(n):
        kind = draw(st.sampled_from(["fresh", "shared", "repeat"] if out else ["fresh", "shared"]))
        if kind == "repeat":
            prompt = draw(st.sampled_from(out)).prompt
        else:
            head = shared if kind == "shared" else ()
            prompt = head + tokens(draw, draw(st.integers(0 if head else 1, max_prompt - len(head))))
        arrival = draw(st.one_of(st.just(0), st.integers(0, max_arrival)))
        abort_at = draw(st.one_of(st.none(), st.none(), st.integers(arrival, arrival + 12)))
        out.append(Req(prompt, draw(st.integers(1, max_new)), arrival, abort_at))
    return tuple(out)


@st.composite
def scenarios(draw, max_requests: int = 8, max_prompt: int = 64, block_sizes=(8, 16), **geometry):
    """A pool from below one request's need to above the whole batch, with or without lower tiers.

    ``geometry``: ``Scenario`` fields of the model and daemon (``bytes_per_token``, ``chunk_bytes``, ``backend``).
    """
    block_size = draw(st.sampled_from(block_sizes))
    reqs = draw(requests(max_requests, max_prompt=max_prompt))
    probe = Scenario(block_size, 1, 0, 0, 1, 1, 1, 0)
    largest = max(probe.blocks_needed(r) for r in reqs)
    total = sum(probe.blocks_needed(r) for r in reqs)
    pool = draw(st.integers(max(1, largest - 3), total + 8))
    max_num_seqs = draw(st.integers(1, 8))
    return Scenario(
        block_size=block_size, pool_blocks=pool,
        host_blocks=draw(st.sampled_from([0, 0, 4, 16, 256])),
        disk_blocks=draw(st.sampled_from([0, 0, 8, 256])),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=draw(st.integers(max(16, max_num_seqs), 160)),
        flush_every=draw(st.sampled_from([1, 2, 5, 32])),
        max_reserve_blocks=draw(st.sampled_from([0, 2, 16, 1024])),
        requests=reqs, overlap_steps=draw(st.booleans()), **geometry,
    )


class Oracle:
    """transformers' greedy tokens per prompt (eager attention, DynamicCache), computed once per prompt."""

    def __init__(self, ref, max_new: int = 16) -> None:
        from hf_models import reference_generate

        self._generate, self.ref, self.max_new, self._cache = reference_generate, ref, max_new, {}

    def tokens(self, prompt, n: int) -> list[int]:
        key = tuple(prompt)
        if key not in self._cache:
            self._cache[key] = self._generate(self.ref, list(key), self.max_new)[0]
        return self._cache[key][:n]


class TempDaemon:
    """A daemon for one scenario (and its disk directory), stopped and removed on exit."""

    def __init__(self, daemon_cls, scenario: Scenario, *extra: str) -> None:
        self.disk_dir = tempfile.mkdtemp(prefix="kvpool-disk-")
        os.chmod(self.disk_dir, 0o700)
        self.daemon = daemon_cls(*scenario.daemon_args(self.disk_dir), *extra)

    def __enter__(self):
        return self.daemon.start()

    def __exit__(self, *exc) -> None:
        code = self.daemon.stop()
        shutil.rmtree(self.disk_dir, ignore_errors=True)
        shutil.rmtree(self.daemon.dir, ignore_errors=True)
        assert code == 0 or exc[0] is not None, f"kvpoold exited with {code}:\n{self.daemon.output()[-3000:]}"


def play(eng, reqs: tuple[Req, ...], prefix: str = "r") -> dict[int, object]:
    """Step ``eng`` by hand: add and abort requests at their steps; each request's final output."""
    streams, step = {}, 0
    params = {i: ke.SamplingParams(max_tokens=r.max_tokens, temperature=0) for i, r in enumerate(reqs)}
    while step < MAX_STEPS:
        for i, r in enumerate(reqs):
            if r.arrival == step:
                streams[i] = eng.add_request(list(r.prompt), params[i], request_id=f"{prefix}{i}")
            if r.abort_at == step and i in streams:
                eng.abort(f"{prefix}{i}")
        if len(streams) == len(reqs) and all(s.last is not None and s.last.finished for s in streams.values()):
            return {i: s.last for i, s in streams.items()}
        eng.step()
        step += 1
    raise AssertionError(f"requests still running after {MAX_STEPS} steps: {eng.stats()}")


def connect_engine(model, socket: str, scenario: Scenario, name: str = "m", model_id: str = "diff-llama"):
    config = ke.EngineConfig(max_num_seqs=scenario.max_num_seqs,
                             max_num_batched_tokens=scenario.max_num_batched_tokens,
                             flush_every=scenario.flush_every, overlap_steps=scenario.overlap_steps)
    return ke.Engine.connect(model, socket, name=name, model_id=model_id, block_size=scenario.block_size,
                             config=config)


def run_engine(model, socket: str, scenario: Scenario, name: str = "m", prefix: str = "r"):
    """One engine on ``socket`` plays the scenario's requests; (outputs by index, the session's max blocks)."""
    eng = connect_engine(model, socket, scenario, name)
    try:
        return play(eng, scenario.requests, prefix), eng.client.max_blocks
    finally:
        eng.close()


def check_outputs(scenario: Scenario, outputs: dict, oracle: Oracle, max_blocks: int) -> None:
    """Every request ends as the oracle says: its greedy tokens, or a prefix of them when it was aborted or
    can never fit in the pool (then with a clear error).  No other error is allowed."""
    for i, req in enumerate(scenario.requests):
        out = outputs[i]
        got = list(out.token_ids)
        want = oracle.tokens(req.prompt, req.max_tokens)
        where = f"request {i} {req!r}: finish {out.finish_reason!r} error {out.error!r}"
        assert got == want[:len(got)], f"{where}: tokens {got} but transformers gives {want}"
        if out.finish_reason == "abort":
            assert req.abort_at is not None, where
        elif scenario.blocks_needed(req) > max_blocks:
            assert out.finish_reason == "error" and "does not fit" in out.error, where
        else:
            assert out.finish_reason == "length" and got == want, where


def check_pool_clean(socket: str) -> None:
    """The daemon's self-check passes, and with every client gone each block is free or cached."""
    with kvpool.Connection(socket) as conn:
        ok, detail = conn.check()
        assert ok, detail
        st_ = conn.stats()
    assert st_.sequences == 0 and st_.clients == 0, st_
    for cls in st_.classes:
        assert cls.used_blocks == 0 and cls.reserved_blocks == 0, cls
        assert cls.cached_blocks + cls.free_blocks == cls.total_blocks, cls
        assert cls.swapped_sequences == 0, cls
    for tier in st_.tiers:
        assert tier.pinned_bytes == 0, tier


def play_together(runs: list[tuple[object, tuple[Req, ...]]]) -> list[dict[int, object]]:
    """Several engines in one thread, a step of each in turn, each playing its own requests; their outputs."""
    streams = [{} for _ in runs]
    for step in range(MAX_STEPS):
        busy = False
        for k, (eng, reqs) in enumerate(runs):
            for i, r in enumerate(reqs):
                if r.arrival == step:
                    streams[k][i] = eng.add_request(list(r.prompt), ke.SamplingParams(max_tokens=r.max_tokens,
                                                                                        temperature=0),
                                                    request_id=f"e{k}r{i}")
                if r.abort_at == step and i in streams[k]:
                    eng.abort(f"e{k}r{i}")
            if len(streams[k]) < len(reqs) or any(s.last is None or not s.last.finished for s in streams[k].values()):
                busy = True
                eng.step()
        if not busy:
            return [{i: s.last for i, s in mine.items()} for mine in streams]
    raise AssertionError(f"requests still running after {MAX_STEPS} steps")


def check_scenario(model, oracle: Oracle, scenario: Scenario) -> None:
    """Play ``scenario`` on a daemon of its own with one engine; the outputs and the pool afterwards checked."""
    from daemonlib import Daemon

    with TempDaemon(Daemon, scenario) as d:
        outputs, max_blocks = run_engine(model, d.socket, scenario)
        check_pool_clean(d.socket)
    check_outputs(scenario, outputs, oracle, max_blocks)
