"""One session's calls on the device pool it was bound to at attach.

A ``PoolSession`` is made at attach and kept with the binding
(``devices.DevicePools.calls``); the servicer gets it from the session's token
(``Service.session_pool``) and makes one call on it.  Each call runs the
checks that come before the core touches anything (drain, limits, quotas),
then the core call, then the tier copies it planned (``DevicePool.sync_memory``).
Of the daemon's sessions it needs only what ``SessionKeeper`` names.

Calls that hand out page tables whose bytes may still be arriving from a
lower tier (create, swap-in, wait) and swap-out (which must not read a block
still being written) return either their result or, when something is in
flight, an awaitable of it: the caller awaits it on the event loop while the
daemon goes on serving other calls.  The batches a call started are returned
by ``sync_memory`` and handed to ``Pending.track`` directly.
"""

from __future__ import annotations

import inspect
from typing import Awaitable, Callable, Protocol, TypeVar

import numpy as np

from kvpoold.core.results import LookupResult, PageTable

from .access import Draining
from .calls import StepCall, StepResult
from .pools import DevicePool
from .sessions import Session
from .tier_pending import Tracked

T = TypeVar("T")


class SessionKeeper(Protocol):
    """What a session's calls need of the daemon's sessions (``Service`` is one)."""

    @property
    def draining(self) -> bool:
        """``kvpoolctl drain``: no new sequences."""

    def session(self, token: bytes) -> Session:
        """The live session of ``token`` (renews its lease); UNAUTHENTICATED once it was dropped."""

    def drop(self, session: Session, reason: str) -> int:
        """End ``session`` everywhere; returns the blocks released."""


class PoolSession:
    """A session bound to its pool: every sequence call of the session."""

    __slots__ = ("keeper", "session", "pool")

    def __init__(self, keeper: SessionKeeper, session: Session, pool: DevicePool) -> None:
        self.keeper = keeper
        self.session = session
        self.pool = pool

    def _refuse_if_draining(self, what: str) -> None:
        if self.keeper.draining:
            raise Draining(what)

    # -- sequences ---------------------------------------------------------------------
    def create(self, prompts: list[tuple[np.ndarray, str]], *, no_wait: bool,
               counted: bool = True) -> list[Tracked] | Awaitable[list[Tracked]]:
        """Several sequences (all or none): their tables, once the bytes of cached prefixes arrived
        (``no_wait``: at once, with the positions still arriving).

        A prompt whose prefix goes past the local tiers first asks the remote tier for the rest of its
        chain (on a worker thread, within ``--remote-timeout``); the blocks it answers are promoted
        like a lower tier's.
        """
        self._refuse_if_draining("new sequences")
        pool, session = self.pool, self.session
        pool.limits.check_tokens(sum(len(t) for t, _ in prompts))
        for _, extra_key in prompts:
            pool.limits.check_extra_key(extra_key)
        pool.limits.check_sequences(session, len(prompts))
        pool.quotas.check_create(session, [len(t) for t, _ in prompts])
        chains = pool.remote.chains(session.class_id, session.model_key, prompts, session.id)
        if chains is None:
            return self._create(prompts, no_wait=no_wait, remote=None, counted=counted)

        async def after_fetch() -> list[Tracked]:
            payloads = await pool.remote.fetch(session.class_id, chains)
            self.keeper.session(self.session.token)  # still there (its lease may have run out meanwhile)
            self._refuse_if_draining("new sequences")
            pool.quotas.check_create(session, [len(t) for t, _ in prompts])  # other calls ran meanwhile
            result = self._create(prompts, no_wait=no_wait, remote=payloads, counted=counted)
            return await result if inspect.isawaitable(result) else result

        return after_fetch()

    def _create(self, prompts: list[tuple[np.ndarray, str]], *, no_wait: bool, remote: dict | None,
                counted: bool) -> list[Tracked] | Awaitable[list[Tracked]]:
        pool, session = self.pool, self.session
        out: list[PageTable] = []
        started: list = []  # the tier copies this call started
        with pool.remote.staging(remote):  # the engine copies these payloads into the blocks promoted from tier 3
            try:
                for tokens, extra_key in prompts:
                    out.append(pool.manager.create(session.id, session.class_id, session.model_key, tokens,
                                                   extra_key, remote=remote, counted=counted))
                    # promotions start now and hold their blocks (a later failure frees safely)
                    started += pool.sync_memory()
            except BaseException:
                if out:  # nothing was written into them: their hashes must not become prefix hits
                    pool.manager.free(session.id, [s.seq_id for s in out], written=False)
                raise
            finally:
                started += pool.sync_memory()
        return self._tracked(out, started, no_wait=no_wait, swap_in=False)

    def step(self, call: StepCall) -> StepResult:
        """One scheduler step: extends, then frees, then reserve changes; validated first."""
        pool, session = self.pool, self.session
        m, owner, cls = pool.manager, session.id, session.class_id
        pool.limits.check_tokens(len(call.tokens))
        admit = pool.quotas.step_admission(session, call.free_ids,
                                           claimed=0 if call.claims is None else len(call.claims))
        m.check_free(owner, call.free_ids)
        m.check_reserve_return(owner, cls, call.reserve_return)
        try:
            extend = m.extend_columns(owner, call.seq_ids, call.counts, call.tokens, call.claim_counts, call.claims,
                                      admit=admit)
            released = m.free(owner, call.free_ids, written=call.free_written) if call.free_ids else 0
            if call.free_ids:
                pool.pending.forget(owner, call.free_ids)
            if call.reserve_return:
                released += m.return_reserve(owner, cls, call.reserve_return)
            added = m.grant_reserve(owner, cls, pool.quotas.reserve_target(session, call.reserve_target)) \
                if call.reserve_target else ()
        finally:
            pool.sync_memory()
        return StepResult(extend, added, released)

    def fork(self, seq_ids: list[int]) -> list[PageTable]:
        self._refuse_if_draining("new sequences (fork)")
        pool, session = self.pool, self.session
        for i in seq_ids:  # validate all first: fork itself cannot fail afterwards
            pool.manager.sequence(session.id, i)
        pool.limits.check_sequences(session, len(seq_ids))
        pool.quotas.check_fork(session, seq_ids)
        return [pool.manager.fork(session.id, i) for i in seq_ids]

    def lookup(self, tokens: np.ndarray, extra_key: str, known: int = 0) -> LookupResult | Awaitable[LookupResult]:
        """The longest cached prefix; past the local tiers the remote tier is asked which blocks it holds.

        ``known``: leading tokens the caller holds itself (the statistics count from there).
        """
        self.pool.limits.check_tokens(len(tokens))
        self.pool.limits.check_extra_key(extra_key)
        s, remote = self.session, self.pool.remote
        chains = remote.chains(s.class_id, s.model_key, [(tokens, extra_key)], s.id)
        if chains is None:
            return self.pool.manager.lookup(s.class_id, s.model_key, tokens, extra_key, owner=s.id, known=known)

        async def after_exists() -> LookupResult:
            held = await remote.fetch(s.class_id, chains, read=False)
            return self.pool.manager.lookup(s.class_id, s.model_key, tokens, extra_key, owner=s.id, remote=held,
                                            known=known)

        return after_exists()

    def sequences(self) -> list[PageTable]:
        return self.pool.manager.sequences(self.session.id)

    def detach(self) -> int:
        """End the session; returns the blocks released."""
        return self.keeper.drop(self.session, "detached")

    # -- tiers ------------------------------------------------------------------------------
    def swap_out(self, seq_ids: list[int]) -> tuple[int, int] | Awaitable[tuple[int, int]]:
        """(blocks copied to host, to disk), once the bytes still arriving into these blocks are whole."""
        pool, owner = self.pool, self.session.id

        def swap() -> tuple[int, int]:
            try:
                host, disk = pool.manager.swap_out(owner, seq_ids)
            finally:
                pool.sync_memory()  # the device reads are done when this returns
            pool.pending.forget(owner, seq_ids)
            return host, disk

        return self._once_arrived(pool.pending.arrivals_of(owner, seq_ids), swap)

    def swap_in(self, seq_ids: list[int], *, no_wait: bool) -> list[Tracked] | Awaitable[list[Tracked]]:
        """New page tables, once their bytes arrived (``no_wait``: at once, with the positions arriving)."""
        pool, owner = self.pool, self.session.id
        pool.quotas.check_swap_in(self.session, seq_ids)  # its blocks count against the quota again
        try:
            tables = pool.manager.swap_in(owner, seq_ids)
        finally:
            started = pool.sync_memory()
        return self._tracked(tables, started, no_wait=no_wait, swap_in=True)

    def wait(self, seq_ids: list[int]) -> list[Tracked] | Awaitable[list[Tracked]]:
        """The sequences' tables once the bytes they wait for arrived."""
        pending, owner = self.pool.pending, self.session.id
        return self._once_arrived(pending.arrivals_of(owner, seq_ids), lambda: pending.finish(owner, seq_ids))

    def _tracked(self, tables: list[PageTable], started: list, *, no_wait: bool,
                 swap_in: bool) -> list[Tracked] | Awaitable[list[Tracked]]:
        """What each table still waits for: now (``no_wait``, or nothing in flight), or once it arrived."""
        pending, owner = self.pool.pending, self.session.id
        tracked = pending.track(owner, tables, swap_in=swap_in, recent=started)
        inflight = [a for t in tracked for _, a in t.arrivals if not a.done]
        if no_wait or not inflight:
            if not no_wait:
                pending.forget(owner, [t.info.seq_id for t in tracked])
            return tracked
        return self._once_arrived(inflight, lambda: pending.settled(owner, tracked))

    def _once_arrived(self, inflight: list, then: Callable[[], T]) -> T | Awaitable[T]:
        """``then()`` now if nothing is in flight, else a coroutine that runs it once the bytes arrived.

        After the wait the session is looked up again: one dropped meanwhile (its lease ran
        out while it was frozen) gets UNAUTHENTICATED, never block tables it no longer holds.
        """
        if not inflight:
            return then()

        async def when_arrived() -> T:
            await self.pool.tiers.wait(inflight)
            self.keeper.session(self.session.token)
            return then()

        return when_arrived()


__all__ = ["PoolSession", "SessionKeeper"]
