"""Where a step's time goes: scheduling, daemon calls, the forward, sampling."""

from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, fields


@dataclass
class StepTimings:
    """Seconds spent in one step's phases, and its shape.

    ``daemon``: calls to kvpoold (create, extend, swap, free); ``prepare``:
    filling the step buffers and their host-to-device copy; ``forward``: the
    model; ``sample``: sampling, stop checks and handing outputs over.
    ``gpu_wait`` is not a phase of its own but the part of the step's daemon
    calls spent waiting for this process's queued GPU work (a call that says
    blocks are written synchronizes the device first); ``chunk_sync`` the
    part spent mapping pool chunks (CUDA VMM); ``daemon_calls`` counts the
    calls the step made.
    """

    schedule: float = 0.0
    daemon: float = 0.0
    gpu_wait: float = 0.0
    chunk_sync: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    total: float = 0.0
    num_tokens: int = 0
    num_seqs: int = 0
    num_prefill_tokens: int = 0
    daemon_calls: int = 0

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, name, getattr(self, name) + time.perf_counter() - t0)


PHASES = ("schedule", "daemon", "prepare", "forward", "sample", "total")


class TimingLog:
    """The last ``keep`` steps' timings since the last ``reset``, and their sums for profiling.

    To profile one stretch of work: ``engine.timings.reset()``, run it, then
    ``engine.timings.summary()``.
    """

    def __init__(self, keep: int = 4096) -> None:
        self.steps: deque[StepTimings] = deque(maxlen=keep)

    def add(self, t: StepTimings) -> None:
        self.steps.append(t)

    def reset(self) -> None:
        """Forget the kept steps (safe while the engine thread runs: a step in flight is kept when it ends)."""
        self.steps.clear()

    def summary(self) -> dict:
        """Per phase: total seconds and share of the steps' time over the kept steps; plus counts."""
        total = sum(s.total for s in self.steps) or 1e-12
        out = {"steps": len(self.steps)}
        for f in fields(StepTimings):
            value = sum(getattr(s, f.name) for s in self.steps)
            out[f.name] = value
            if f.name in PHASES:
                out[f"{f.name}_share"] = value / total
        return out
