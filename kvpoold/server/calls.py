"""The service's call and result types: what ``convert.py`` makes of a request and turns into a reply.

They sit below the servicer and the service, so the converters know them
without knowing who makes or takes them.  A call that needs nothing more than
a few plain values (a list of ids, a flag) takes those directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvpoold.core.results import ExtendDeltas
from kvpool.protocol import ArenaDescriptor

from .sessions import Session


@dataclass(frozen=True)
class AttachResult:
    """A new session, bound to the pool of its GPU, and the arena its class's blocks live in."""

    session: Session
    descriptor: ArenaDescriptor
    num_blocks: int
    block_bytes: int
    backend: str  # the pool's backend: "cpu" or "cuda"


@dataclass(frozen=True)
class StepCall:
    """One scheduler step of a session, as the core takes it (``convert.step_request``)."""

    seq_ids: np.ndarray
    counts: np.ndarray | None  # None: one token each
    tokens: np.ndarray
    claim_counts: np.ndarray | None  # None: no blocks claimed from the reserve
    claims: np.ndarray | None
    free_ids: list[int]
    free_written: bool  # False: drop the freed sequences' unconfirmed hashes (their K/V was never written)
    reserve_target: int
    reserve_return: list[int]


@dataclass(frozen=True)
class StepResult:
    extend: ExtendDeltas
    reserve_added: tuple[int, ...]
    blocks_released: int


@dataclass(frozen=True)
class DrainState:
    draining: bool
    sessions: int
    sequences: int


@dataclass(frozen=True)
class PoolResize:
    """What a resize did to one pool."""

    device: int
    before_bytes: int
    target_bytes: int
    pool_bytes: int
    met: bool
    freed_bytes: int
    evicted_blocks: int
    max_pool_bytes: int


__all__ = ["AttachResult", "DrainState", "PoolResize", "StepCall", "StepResult"]
