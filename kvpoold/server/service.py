"""The daemon's state: its pools (one per device), the sessions, drain and shutdown.

Everything here is called from the event loop only (the daemon's single
concurrency rule), so no locks are needed.  No gRPC types appear: the
servicer converts messages into these calls and results back.  The memory
of each device (core, arenas, tiers) lives in a ``pools.DevicePool``; a
session is bound to one pool at attach and each of its calls goes there.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from kvpoold import __version__
from kvpoold.config import Config
from kvpoold.core import Geometry, InvalidArgument, WrongState
from kvpoold.core.results import ExtendResult, LookupResult, PoolStats, SequenceInfo
from kvpool.protocol import ArenaDescriptor

from .access import Draining
from .pools import DevicePool, PoolSet
from .sessions import Session, SessionRegistry

log = logging.getLogger("kvpoold")


@dataclass(frozen=True)
class AttachResult:
    session: Session
    descriptor: ArenaDescriptor
    num_blocks: int
    block_bytes: int
    pool: DevicePool


@dataclass(frozen=True)
class StepResult:
    extend: ExtendResult
    reserve_added: tuple[int, ...]
    blocks_released: int


class PoolService:
    """The sessions and the pools; routes each session's calls to the pool it was bound to at attach.

    Pools are added by the start-up code (``add_pool``), one per device.
    """

    def __init__(self, config: Config) -> None:
        self._config = config
        self.pools = PoolSet()
        self.sessions = SessionRegistry(config.max_sessions)  # one registry: ids unique, max_sessions global
        self.started = time.time()
        self.rpcs = 0
        self.closing = False
        self.draining = False  # kvpoolctl drain: no new attaches or sequences; running ones go on

    @property
    def config(self) -> Config:
        return self._config

    @config.setter
    def config(self, config: Config) -> None:
        """SIGHUP: every pool reads the new live settings too (quotas, limits, reserves)."""
        self._config = config
        for pool in self.pools:
            pool.config = config
            pool.manager.max_reserve_blocks = config.max_reserve_blocks

    def add_pool(self, backend, pool_bytes: int, **kwargs) -> DevicePool:
        """A device's pool (``pools.DevicePool``'s arguments); on failure nothing of it stays."""
        try:
            pool = DevicePool(self._config, backend, pool_bytes, index=len(self.pools), **kwargs)
        except BaseException:
            backend.close()
            raise
        try:
            return self.pools.add(pool)
        except BaseException:
            pool.close()
            raise

    def pool_of(self, session: Session) -> DevicePool:
        return self.pools.of(session)

    # -- sessions -----------------------------------------------------------------
    def attach(self, name: str, layout: dict, pid: int, device_bus_id: str = "") -> AttachResult:
        if self.closing:
            raise WrongState("the daemon is shutting down")
        if self.draining:
            raise Draining("new attaches")
        model_id = layout.get("model_id", "")
        if not model_id:
            raise InvalidArgument("layout.model_id must be a non-empty string")
        geometry = Geometry(
            num_layers=layout["num_layers"], num_kv_heads=layout["num_kv_heads"],
            head_dim=layout["head_dim"], dtype=layout["dtype"], block_size=layout["block_size"] or 16,
        )
        revision = layout.get("revision", "")
        model_key = f"{model_id}@{revision}" if revision else model_id
        pool = self.pools.choose(device_bus_id)
        cid, descriptor, num_blocks, block_bytes = pool.open_class(geometry)
        session = self.sessions.add(name or "client", pid, model_key, cid)
        self.pools.bind(session.id, pool)
        pool.models.setdefault(cid, set()).add(model_key)
        log.info("attach: session %d (%s, pid %d) model %s on %s class %d %s", session.id, session.name,
                 session.pid, model_key, pool.name, cid, geometry.describe())
        return AttachResult(session, descriptor, num_blocks, block_bytes, pool)

    def session(self, token: bytes) -> Session:
        return self.sessions.get(token)

    def drop(self, session: Session, reason: str) -> int:
        pool = self.pools.of(session)
        released = pool.drop_owner(session.id)
        self.sessions.remove(session)
        self.pools.unbind(session.id)
        log.info("session %d (%s, pid %d) dropped: %s; %d blocks released on %s",
                 session.id, session.name, session.pid, reason, released, pool.name)
        return released

    def reap(self) -> int:
        """Drop every session whose lease ran out (a frozen client), then every one whose client is gone.

        Returns how many.
        """
        lapsed = self.sessions.lapsed(self.config.lease_seconds)
        for s, reason in lapsed:
            self.drop(s, reason)
        expired = self.sessions.expired(self.config.grace_seconds)  # of the sessions still here
        for s, reason in expired:
            self.drop(s, reason)
        return len(lapsed) + len(expired)

    # -- sequence calls: the session's pool -----------------------------------------
    def create(self, session: Session, prompts: list[tuple[np.ndarray, str]]) -> list[SequenceInfo]:
        """Create several sequences; on an error none of them remains."""
        if self.draining:
            raise Draining("new sequences")
        return self.pools.of(session).create(session, prompts)

    def step(
        self,
        session: Session,
        seq_ids: np.ndarray,
        counts: np.ndarray,
        tokens: np.ndarray,
        claim_counts: np.ndarray | None,
        claims: np.ndarray | None,
        free_ids: list[int],
        reserve_target: int,
        reserve_return: list[int],
    ) -> StepResult:
        """One scheduler step: extends, then frees, then reserve changes; validated first."""
        result, added, released = self.pools.of(session).step(
            session, seq_ids, counts, tokens, claim_counts, claims, free_ids, reserve_target, reserve_return)
        return StepResult(result, added, released)

    def fork(self, session: Session, seq_ids: list[int]) -> list[SequenceInfo]:
        if self.draining:
            raise Draining("new sequences (fork)")
        return self.pools.of(session).fork(session, seq_ids)

    # -- tiers (issue 6) ---------------------------------------------------------------
    def tiers_of(self, session: Session):
        """The tiers of the session's pool (arrivals, waits)."""
        return self.pools.of(session).tiers

    def swap_out(self, session: Session, seq_ids: list[int]) -> tuple[int, int]:
        """(blocks copied to host, to disk); the device reads are done when this returns.

        Callers first wait for bytes still arriving into these sequences' blocks
        (``tiers.arrivals_of``): a block is read only once it is whole.
        """
        return self.pools.of(session).swap_out(session, seq_ids)

    def swap_in(self, session: Session, seq_ids: list[int]) -> list[SequenceInfo]:
        """New page tables; the copies into them may still be arriving (``tiers.track``)."""
        return self.pools.of(session).swap_in(session, seq_ids)

    def lookup(self, session: Session, tokens: np.ndarray, extra_key: str) -> LookupResult:
        return self.pools.of(session).lookup(session, tokens, extra_key)

    def sequences(self, session: Session) -> list[SequenceInfo]:
        return self.pools.of(session).manager.sequences(session.id)

    def detach(self, session: Session) -> int:
        return self.drop(session, "detached")

    # -- operators: every pool ----------------------------------------------------------
    def stats(self) -> list[tuple[DevicePool, PoolStats]]:
        """Each pool with its figures, in ``--devices`` order."""
        return [(pool, pool.stats()) for pool in self.pools]

    def owners(self) -> dict[int, tuple[int, int]]:
        """Session id -> (sequences, reserved blocks), over every pool."""
        out: dict[int, tuple[int, int]] = {}
        for pool in self.pools:
            out.update(pool.manager.owners())
        return out

    @property
    def live_sequences(self) -> int:
        return sum(pool.manager.seqs.live for pool in self.pools)

    def evict(self, class_id: int | None, max_blocks: int | None) -> int:
        """Drop cached blocks, oldest first, pool by pool (``class_id``: that class in every pool that has it)."""
        pools = list(self.pools)
        if class_id is not None:
            having = [p for p in pools if 0 <= class_id < len(p.manager.classes)]
            pools = having or pools[:1]  # none has it: the core's error names the class
        evicted = 0
        for pool in pools:
            left = None if max_blocks is None else max_blocks - evicted
            if left is not None and left <= 0 and evicted:
                break
            evicted += pool.evict(class_id, left)
        return evicted

    def reset(self) -> tuple[int, int, int]:
        """Operator reset: drop every session and every cached block; returns (sessions, released, evicted).

        Dropped clients learn it at their next call (UNAUTHENTICATED: attach again).
        """
        sessions = list(self.sessions)
        released = sum(self.drop(s, "reset by an operator") for s in sessions)
        evicted = self.evict(None, None)
        return len(sessions), released, evicted

    def check(self) -> tuple[bool, str]:
        """Run every pool's invariant checks and the session cross-checks."""
        ids = {s.id for s in self.sessions}
        try:
            bound: set[int] = set()
            for pool in self.pools:
                mine = {s.id for s in self.sessions if self.pools.of(s) is pool}
                pool.check(mine)
                bound |= mine
            assert bound == ids, f"sessions bound to no pool: {sorted(ids - bound)}"
        except AssertionError as exc:
            return False, str(exc) or "invariant violated"
        where = f" in {len(self.pools)} pools" if len(self.pools) > 1 else ""
        return True, f"{len(ids)} sessions, {self.live_sequences} sequences{where}: all invariants hold"

    def close(self) -> None:
        """Flush every pool's tiers, then release its arenas and backend (device memory)."""
        self.pools.close()

    @property
    def version(self) -> str:
        return __version__

    @property
    def backend_name(self) -> str:
        """``cpu`` or ``cuda``: every pool has the same backend."""
        return self.pools.pools[0].backend.name if len(self.pools) else self._config.backend

