"""The hot path: ``extend`` assigns blocks from the reserve locally, and a ``Step`` call reports what it queued."""

from __future__ import annotations

from typing import Iterable, Mapping

from .errors import FailedPrecondition, InvalidArgument, KvpoolError
from .mapping import PoolMapping
from .mirror import UNKNOWN_TOKEN, Mirror
from .protocol.sizes import cdiv
from .sequence import ExtendResult, Sequence, token_list
from .session import Session
from .step_wire import step_reply, step_request


class Stepper:
    """Extends sequences, and makes the ``Step`` calls that report queued tokens, free, and top up the reserve.

    While the reserve lasts, ``extend`` assigns blocks itself and only queues
    the tokens; the queue goes to the daemon in the next call that needs it
    anyway (reserve empty, a copy-on-write, a free) or at the latest every
    ``flush_every`` steps.

    Args:
        session: the attached session.
        mirror: the page tables and reserve it updates.
        mapping: the pool's memory (synchronized before a Step; copy-on-write copies run on it).
        flush_every: the most ``extend`` steps between two calls.
        max_reserve_blocks: the largest reserve the daemon grants.
    """

    def __init__(self, session: Session, mirror: Mirror, mapping: PoolMapping, *, flush_every: int,
                 max_reserve_blocks: int) -> None:
        self._session, self._mirror, self._mapping = session, mirror, mapping
        self.flush_every = flush_every
        self._max_reserve_blocks = max_reserve_blocks
        self._steps_since_rpc = 0

    def extend(self, batch: Mapping[Sequence | int, Iterable[int]], *, run_copies: bool) -> ExtendResult:
        """``Client.extend``: local assignments while the reserve lasts, else a Step call."""
        mirror = self._mirror
        bs = mirror.block_size
        local, remote, want = [], [], 0
        for seq, toks in batch.items():
            sid = seq.id if type(seq) is Sequence else int(seq)
            st = mirror.extendable(sid)
            toks = token_list(toks)
            if not toks:
                continue
            nt = st.num_tokens
            if st.shared_tail and nt % bs:
                remote.append((sid, st, toks))  # copy-on-write is the daemon's call
            else:
                grow = cdiv(nt + len(toks), bs) - len(st.blocks)
                local.append((sid, st, toks, grow))
                want += grow
        named = len(local) + len(remote)
        if named > 1 and len({x[0] for x in local} | {x[0] for x in remote}) != named:
            raise InvalidArgument("a sequence appears twice in one extend")
        self._steps_since_rpc += 1
        if not remote and want <= len(mirror.reserve) and self._steps_since_rpc < self.flush_every:
            for sid, st, toks, grow in local:
                mirror.assign_locally(st, toks, grow)
            return ExtendResult((), False)
        return self.step(local=local, remote=remote, run_copies=run_copies)

    def can_extend_ahead(self, ids: list[int]) -> bool:
        """Whether ``extend_ahead`` of these sequences needs no call: no copy-on-write, the reserve covers their
        new blocks, and the next extend is not the one that must reach the daemon."""
        if self._steps_since_rpc + 1 >= self.flush_every:
            return False
        mirror, bs, want = self._mirror, self._mirror.block_size, 0
        for sid in ids:
            st = mirror.seqs.get(sid)
            if st is None or (st.shared_tail and st.num_tokens % bs):
                return False
            want += cdiv(st.num_tokens + 1, bs) - len(st.blocks)
        return want <= len(mirror.reserve)

    def extend_ahead(self, ids: list[int]) -> None:
        """``Client.extend_ahead``: one ``UNKNOWN_TOKEN`` per sequence, its block from the reserve."""
        if not self.can_extend_ahead(ids):
            raise InvalidArgument("extend_ahead needs a call to the daemon: check can_extend_ahead first")
        if len(set(ids)) != len(ids):
            raise InvalidArgument("a sequence appears twice in one extend_ahead")
        mirror, bs = self._mirror, self._mirror.block_size
        self._steps_since_rpc += 1
        for sid in ids:
            st = mirror.seqs[sid]
            mirror.assign_locally(st, [UNKNOWN_TOKEN], cdiv(st.num_tokens + 1, bs) - len(st.blocks))

    def step(self, *, local=(), remote=(), free_ids: list[int] = (), run_copies: bool = True,
             written: Iterable[int] = (), free_written: bool = True, reserve_return: list[int] = (),
             reserve_target: int | None = None) -> ExtendResult:
        """One Step call: queued tokens, this step's tokens, frees, reserve top-up.

        Every sequence named in a Step (``written`` names more, with no
        tokens) tells the daemon that the KV of the tokens it knew is written,
        and a free lets the daemon copy blocks out: on a GPU the writes this
        process queued are finished first, so no other process reads a block
        before they land.

        Args:
            local: ``(seq id, SeqState, tokens, blocks to grow)`` to assign through the reserve first.
            remote: ``(seq id, SeqState, tokens)`` whose copy-on-write is the daemon's call.
            free_ids: sequences to free; ``free_written=False``: their last tokens' KV may be missing.
            run_copies: run the reply's copy-on-write copies here.
            written: more sequences whose KV is written.
            reserve_return: reserve blocks to give back (default: the surplus).
            reserve_target: the reserve to keep (default: what the live sequences need).
        """
        mirror = self._mirror
        for sid, st in mirror.pending():
            if UNKNOWN_TOKEN in st.pending:
                raise FailedPrecondition(f"sequence {sid} has a queued token whose id is not known yet "
                                         "(Client.fill_token): the daemon must not hear of it")
        self._mapping.sync_device()
        # local assignments go through the reserve first (the daemon allocates what is missing)
        # (the table stays short by what the reserve could not cover until the reply fills it)
        sent_now = {}
        for sid, st, toks, grow in local:
            sent_now[sid] = (len(toks), min(grow, len(mirror.reserve)))
            mirror.assign_locally(st, toks, sent_now[sid][1])
        pending = mirror.pending()
        if reserve_target is None and not reserve_return:
            reserve_return = self._reserve_surplus(len(free_ids))
        if reserve_target is None:
            reserve_target = self._reserve_target(len(mirror.seqs) - len(free_ids))
        req = step_request(self._session.token, pending=pending, remote=remote, written=written,
                           free_ids=free_ids, free_written=free_written, reserve_target=reserve_target,
                           reserve_return=reserve_return)
        try:
            r = self._session.call("Step", req)
        except KvpoolError:
            self._rollback_unsent(local, sent_now)
            raise
        self._steps_since_rpc = 0
        reply = step_reply(r)
        mirror.apply_step(reply, reported=[st for _, st in pending], remote=remote, free_ids=free_ids,
                          reserve_return=reserve_return)
        if reply.copies and run_copies:
            self._mapping.run_copies(reply.copies)
        return ExtendResult(reply.copies, True)

    def _rollback_unsent(self, local, sent_now: dict) -> None:
        """Undo this step's local assignments after a failed call (older queued ones stay)."""
        for sid, st, toks, grow in reversed(local):
            self._mirror.unassign(st, *sent_now[sid])

    def _reserve_target(self, live: int) -> int:
        """The reserve to ask for with ``live`` sequences; none without any, since only extends draw on it."""
        if not live:
            return 0
        per_seq = cdiv(self.flush_every, self._mirror.block_size)
        return min(self._max_reserve_blocks, max(8, 2 * per_seq * live))

    def _reserve_surplus(self, freeing: int) -> list[int]:
        """Reserve blocks to give back with this call: all of them when no sequence is left, else what lies
        beyond the target once the reserve holds more than twice it.  A reserve is held memory: a model whose
        batch shrank or that went idle would otherwise keep slabs that other models need."""
        reserve = self._mirror.reserve
        target = self._reserve_target(len(self._mirror.seqs) - freeing)
        if len(reserve) <= 2 * target:
            return []
        return reserve[:len(reserve) - target]  # the stack's bottom: the last blocks it would use
