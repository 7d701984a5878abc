"""The daemon's state: the core, the arenas that hold block bytes, the sessions.

Everything here is called from the event loop only (the daemon's single
concurrency rule), so no locks are needed.  No gRPC types appear: the
servicer converts messages into these calls and results back.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from kvpoold import __version__
from kvpoold.config import Config
from kvpoold.core import Geometry, InvalidArgument, KVCacheManager, WrongState
from kvpoold.core.results import ExtendResult, LookupResult, PoolStats, SequenceInfo
from kvpoold.memory.base import Arena, ArenaDescriptor, Backend

from .access import Draining, Limits, Quotas
from .sessions import Session, SessionRegistry
from .tiers import TIER_ALIGN, Tiers

log = logging.getLogger("kvpoold")


@dataclass(frozen=True)
class AttachResult:
    session: Session
    descriptor: ArenaDescriptor
    num_blocks: int
    block_bytes: int


@dataclass(frozen=True)
class StepResult:
    extend: ExtendResult
    reserve_added: tuple[int, ...]
    blocks_released: int


class PoolService:
    def __init__(self, config: Config, backend: Backend, pool_bytes: int) -> None:
        self.config = config
        self.backend = backend
        self.manager = KVCacheManager(
            pool_bytes,
            chunk_bytes=config.chunk_bytes,
            host_bytes=config.host_bytes,
            disk_bytes=config.disk_bytes,
            policy=config.eviction_policy,
            max_reserve_blocks=config.max_reserve_blocks,
            tier_align=TIER_ALIGN,
        )
        self.tiers = Tiers(config, self.manager, backend.name)  # issue 6: host and disk tiers, transfers
        self.sessions = SessionRegistry(config.max_sessions)
        self.arenas: dict[int, Arena] = {}
        self.models: dict[int, set[str]] = {}
        self.started = time.time()
        self.rpcs = 0
        self.closing = False
        self.draining = False  # kvpoolctl drain: no new attaches or sequences; running ones go on
        self.quotas = Quotas(self)  # per-session limits (access.py), checked before the core allocates
        self.limits = Limits(self)  # issue 9: sequences per session, tokens per call

    # -- memory -----------------------------------------------------------------
    def _sync_memory(self) -> list:
        """After every state change: run the planned tier copies and commit/release slabs.

        Device reads (demotions, swap-outs) finish first, then slabs are
        committed and released, then device writes (promotions, swap-ins)
        start; those still in flight are returned (``tiers.Tiers.sync``).
        """

        def apply_slabs():
            for kind, cls, offset, nbytes in self.manager.drain_slab_changes():
                arena = self.arenas[cls]
                if kind == "take":
                    arena.commit(offset, nbytes)
                else:
                    arena.release(offset, nbytes)

        return self.tiers.sync(apply_slabs)

    # -- sessions -----------------------------------------------------------------
    def attach(self, name: str, layout: dict, pid: int) -> AttachResult:
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
        known = self.manager.class_of(geometry) in self.arenas  # classes of the disk tier have no arena
        if not known and self.arenas and not self.backend.supports_many_classes:
            raise InvalidArgument(
                f"the {self.backend.name} backend serves one layout class; this daemon already serves "
                f"{self.manager.classes[next(iter(self.arenas))].geometry.describe()}"
            )
        cid = self.manager.register_class(geometry)
        pool = self.manager.classes[cid]
        if cid not in self.arenas:
            # if this fails, the class stays registered but owns nothing; a later attach retries
            self.arenas[cid] = self.backend.create_arena(f"c{cid}", pool.num_block_ids * pool.block_bytes)
            self.tiers.add_arena(cid, self.arenas[cid], pool)
        session = self.sessions.add(name or "client", pid, model_key, cid)
        self.models.setdefault(cid, set()).add(model_key)
        log.info("attach: session %d (%s, pid %d) model %s class %d %s",
                 session.id, session.name, session.pid, model_key, cid, geometry.describe())
        return AttachResult(session, self.arenas[cid].descriptor, pool.num_block_ids, pool.block_bytes)

    def session(self, token: bytes) -> Session:
        return self.sessions.get(token)

    def drop(self, session: Session, reason: str) -> int:
        released = self.manager.drop_owner(session.id)
        self.tiers.forget_owner(session.id)
        self.sessions.remove(session)
        self._sync_memory()
        log.info("session %d (%s, pid %d) dropped: %s; %d blocks released",
                 session.id, session.name, session.pid, reason, released)
        return released

    def reap(self) -> int:
        """Drop every session whose client is gone; returns how many."""
        expired = self.sessions.expired(self.config.grace_seconds)
        for s, reason in expired:
            self.drop(s, reason)
        return len(expired)

    # -- sequence calls -----------------------------------------------------------
    def create(self, session: Session, prompts: list[tuple[np.ndarray, str]]) -> list[SequenceInfo]:
        """Create several sequences; on an error none of them remains."""
        if self.draining:
            raise Draining("new sequences")
        self.limits.check_tokens(sum(len(t) for t, _ in prompts))
        self.limits.check_sequences(session, len(prompts))
        self.quotas.check_create(session, [len(t) for t, _ in prompts])
        self.tiers.take_recent()  # this call's arrivals start from here
        out: list[SequenceInfo] = []
        try:
            for tokens, extra_key in prompts:
                out.append(self.manager.create(session.id, session.class_id, session.model_key, tokens, extra_key))
                self._sync_memory()  # promotions start now and hold their blocks (a later failure frees safely)
        except BaseException:
            if out:
                self.manager.free(session.id, [s.seq_id for s in out])
            raise
        finally:
            self._sync_memory()
        return out

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
        m, owner, cls = self.manager, session.id, session.class_id
        self.limits.check_tokens(len(tokens))
        self.quotas.check_step(session, seq_ids, counts, len(tokens), free_ids)
        m.check_free(owner, free_ids)
        m.check_reserve_return(owner, cls, reserve_return)
        try:
            result = m.extend_columns(owner, seq_ids, counts, tokens, claim_counts, claims)
            released = m.free(owner, free_ids) if free_ids else 0
            if free_ids:
                self.tiers.forget(owner, free_ids)
            if reserve_return:
                released += m.return_reserve(owner, cls, reserve_return)
            added = m.grant_reserve(owner, cls, self.quotas.reserve_target(session, reserve_target)) \
                if reserve_target else ()
        finally:
            self._sync_memory()
        return StepResult(result, added, released)

    def fork(self, session: Session, seq_ids: list[int]) -> list[SequenceInfo]:
        if self.draining:
            raise Draining("new sequences (fork)")
        for i in seq_ids:  # validate all first: fork itself cannot fail afterwards
            self.manager.sequence(session.id, i)
        self.limits.check_sequences(session, len(seq_ids))
        self.quotas.check_fork(session, seq_ids)
        return [self.manager.fork(session.id, i) for i in seq_ids]

    # -- tiers (issue 6) ---------------------------------------------------------------
    def swap_out(self, session: Session, seq_ids: list[int]) -> tuple[int, int]:
        """(blocks copied to host, to disk); the device reads are done when this returns.

        Callers first wait for bytes still arriving into these sequences' blocks
        (``tiers.arrivals_of``): a block is read only once it is whole.
        """
        try:
            return self.manager.swap_out(session.id, seq_ids)
        finally:
            self._sync_memory()

    def swap_in(self, session: Session, seq_ids: list[int]) -> list[SequenceInfo]:
        """New page tables; the copies into them may still be arriving (``tiers.track``)."""
        self.quotas.check_swap_in(session, seq_ids)  # its blocks count against the quota again
        self.tiers.take_recent()
        try:
            return self.manager.swap_in(session.id, seq_ids)
        finally:
            self._sync_memory()

    def lookup(self, session: Session, tokens: np.ndarray, extra_key: str) -> LookupResult:
        self.limits.check_tokens(len(tokens))
        return self.manager.lookup(session.class_id, session.model_key, tokens, extra_key, owner=session.id)

    def sequences(self, session: Session) -> list[SequenceInfo]:
        return self.manager.sequences(session.id)

    def detach(self, session: Session) -> int:
        return self.drop(session, "detached")

    # -- operators ------------------------------------------------------------------
    def stats(self) -> PoolStats:
        self.tiers.poll()
        return self.tiers.decorate(self.manager.stats())

    def evict(self, class_id: int | None, max_blocks: int | None) -> int:
        try:
            return self.manager.evict_cached(class_id, max_blocks)
        finally:
            self._sync_memory()

    def reset(self) -> tuple[int, int, int]:
        """Operator reset: drop every session and every cached block; returns (sessions, released, evicted).

        Dropped clients learn it at their next call (UNAUTHENTICATED: attach again).
        """
        sessions = list(self.sessions)
        released = sum(self.drop(s, "reset by an operator") for s in sessions)
        evicted = self.evict(None, None)
        return len(sessions), released, evicted

    def check(self) -> tuple[bool, str]:
        """Run the core's invariant checks and the session cross-checks."""
        try:
            self.manager.check_invariants()
            owners = set(self.manager.owners())
            ids = {s.id for s in self.sessions}
            stray = owners - ids
            assert not stray, f"state held by ended sessions {sorted(stray)}"
        except AssertionError as exc:
            return False, str(exc) or "invariant violated"
        return True, f"{len(ids)} sessions, {self.manager.seqs.live} sequences: all invariants hold"

    def flush_tiers(self) -> None:
        """Shutdown hook: persist what must survive a restart (the disk tier's index).

        Called by ``close`` while the arenas are still mapped, after the clients
        were told and given ``shutdown_timeout`` to detach.
        """
        self.tiers.close()  # finishes the copies in flight, fsyncs the disk tier's data and index

    def close(self) -> None:
        try:
            self.flush_tiers()
        except Exception:  # noqa: BLE001 - the arenas must still be released
            log.exception("flushing the tiers at shutdown failed")
        for arena in self.arenas.values():
            arena.close()
        self.arenas.clear()
        self.backend.close()

    @property
    def version(self) -> str:
        return __version__
