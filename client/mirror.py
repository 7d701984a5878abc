"""The client's mirror of its page tables and of its reserve: what ``block_tables`` reads without a call."""

from __future__ import annotations

from typing import Callable

import numpy as np

from .batch import slot_mapping
from .errors import FailedPrecondition, InvalidArgument, NotFound
from .protocol.sizes import cdiv
from .protocol.wire import I32, unpack
from .step_wire import StepReply

#: a queued token whose id is still on the device (``Client.extend_ahead``); never sent to the daemon
UNKNOWN_TOKEN = -1


class SeqState:
    """One sequence as this client knows it: its blocks and tokens, and what the daemon has not heard of yet."""

    __slots__ = ("blocks", "num_tokens", "num_cached", "shared_tail", "pending", "claims", "arriving")

    def __init__(self, blocks: list[int], num_tokens: int, num_cached: int) -> None:
        self.blocks = blocks
        self.num_tokens = num_tokens
        self.num_cached = num_cached
        self.shared_tail = False  # last block partly filled and maybe shared (after a fork)
        self.pending: list[int] = []  # tokens the daemon has not seen yet
        self.claims: list[int] = []  # reserve blocks assigned locally, not reported yet
        self.arriving: list[int] = []  # positions whose bytes are still arriving (wait=False); see Client.wait


class Mirror:
    """Each live sequence's block table and token count, the swapped-out ones, and the session's reserve.

    ``reserve`` is a stack of free blocks the daemon granted: ``extend``
    assigns from its top, returns go from its bottom.  Every block id a reply
    names goes through ``ensure_mapped`` before the mirror records it.

    Args:
        block_size: tokens per block.
        ensure_mapped: maps the chunks that hold the given block ids (``PoolMapping.ensure_mapped``).
    """

    def __init__(self, block_size: int, ensure_mapped: Callable[[np.ndarray], None]) -> None:
        self.block_size = block_size
        self._ensure_mapped = ensure_mapped
        self.seqs: dict[int, SeqState] = {}
        self.swapped: dict[int, SeqState] = {}  # swapped-out sequences (tiers): no blocks until swap_in
        self.reserve: list[int] = []

    # -- reading -------------------------------------------------------------------------------------
    def state(self, seq_id: int) -> SeqState:
        """A live or swapped-out sequence's state; ``NotFound`` for any other id."""
        st = self.seqs.get(seq_id)
        if st is None:
            st = self.swapped.get(seq_id)
            if st is None:
                raise NotFound(f"sequence {seq_id} is not one of this client's live sequences")
        return st

    def extendable(self, seq_id: int) -> SeqState:
        """A live sequence's state; swapped-out ones cannot grow (``FailedPrecondition``)."""
        st = self.seqs.get(seq_id)
        if st is None:
            if seq_id in self.swapped:
                raise FailedPrecondition(f"sequence {seq_id} is swapped out: swap it in before extending it")
            raise NotFound(f"sequence {seq_id} is not one of this client's live sequences")
        return st

    def block_tables(self, ids: list[int], *, pad: int) -> np.ndarray:
        """A padded ``int32 [len(ids), max blocks]`` block-table array."""
        states = [self.state(i) for i in ids]
        width = max((len(s.blocks) for s in states), default=0)
        out = np.full((len(states), width), pad, np.int32)
        for row, st in zip(out, states):
            row[: len(st.blocks)] = st.blocks
        return out

    def seq_lens(self, ids: list[int]) -> np.ndarray:
        return np.asarray([self.state(i).num_tokens for i in ids], np.int32)

    def slot_mapping(self, seq_id: int, start: int, count: int) -> np.ndarray:
        """Pool slots (block * block_size + offset) of tokens ``start .. start+count-1``."""
        st = self.state(seq_id)
        if start < 0 or count < 0 or start + count > st.num_tokens:
            raise InvalidArgument(f"tokens {start}..{start + count} are outside the sequence's {st.num_tokens}")
        return slot_mapping(np.asarray(st.blocks, np.int64), np.arange(start, start + count), self.block_size)

    def pending(self) -> list[tuple[int, SeqState]]:
        """The sequences with tokens the daemon has not heard of yet."""
        return [(sid, st) for sid, st in self.seqs.items() if st.pending]

    # -- sequences the daemon made or gave back --------------------------------------------------------
    def add(self, table) -> int:
        """Record a sequence a reply made (``SequenceTable``); returns its id."""
        blocks = unpack(table.block_table, I32)
        self._ensure_mapped(blocks)
        st = self.seqs[table.seq_id] = SeqState(blocks.tolist(), table.num_tokens, table.num_cached_tokens)
        if table.arriving:
            st.arriving = unpack(table.arriving, I32).tolist()
        return table.seq_id

    def swapped_out(self, ids: list[int]) -> None:
        """These sequences' blocks went to another tier: they keep their tokens, not their table."""
        for sid in ids:
            st = self.seqs.pop(sid)
            st.blocks, st.arriving, st.shared_tail = [], [], False
            self.swapped[sid] = st

    def swapped_in(self, table) -> np.ndarray:
        """A swapped-out sequence is back in the blocks of ``table``; returns its block table (int32)."""
        st = self.swapped.pop(table.seq_id)
        blocks = unpack(table.block_table, I32)
        self._ensure_mapped(blocks)
        st.blocks = blocks.tolist()
        st.num_cached = table.num_cached_tokens
        st.arriving = unpack(table.arriving, I32).tolist() if table.arriving else []
        self.seqs[table.seq_id] = st
        return np.asarray(st.blocks, np.int32)

    def arrived(self, table) -> int:
        """The bytes of live ``table``'s sequence are in: how many of its tokens' KV is there."""
        st = self.seqs[table.seq_id]
        st.num_cached = min(st.num_cached, table.num_cached_tokens)
        st.arriving = []
        return st.num_cached

    # -- the reserve and the tokens not reported yet -------------------------------------------------------
    def assign_locally(self, st: SeqState, toks: list[int], grow: int) -> None:
        """Queue ``toks`` on ``st``, with ``grow`` blocks from the top of the reserve."""
        if grow:
            reserve = self.reserve
            taken = reserve[-grow:]
            del reserve[-grow:]
            st.blocks.extend(taken)
            st.claims.extend(taken)
        st.pending.extend(toks)
        st.num_tokens += len(toks)

    def fill(self, st: SeqState, position: int, token: int) -> None:
        """Give the queued ``UNKNOWN_TOKEN`` at ``position`` its id."""
        index = position - (st.num_tokens - len(st.pending))
        if not 0 <= index < len(st.pending) or st.pending[index] != UNKNOWN_TOKEN:
            raise InvalidArgument(f"position {position} holds no token of unknown id")
        st.pending[index] = token

    def drop_unknown(self, st: SeqState) -> int:
        """Take back the trailing ``UNKNOWN_TOKEN`` positions and the reserve blocks only they needed; how many."""
        count = 0
        while count < len(st.pending) and st.pending[-1 - count] == UNKNOWN_TOKEN:
            count += 1
        if count:
            keep = cdiv(st.num_tokens - count, self.block_size)
            self.unassign(st, count, min(max(len(st.blocks) - keep, 0), len(st.claims)))
        return count

    def unassign(self, st: SeqState, num_tokens: int, num_blocks: int) -> None:
        """Undo the last ``assign_locally`` of ``num_tokens`` tokens and ``num_blocks`` blocks."""
        del st.pending[len(st.pending) - num_tokens:]
        st.num_tokens -= num_tokens
        if num_blocks:
            back = st.blocks[-num_blocks:]
            del st.blocks[-num_blocks:]
            del st.claims[-num_blocks:]
            self.reserve.extend(back)

    def apply_step(self, reply: StepReply, *, reported: list[SeqState], remote, free_ids: list[int],
                   reserve_return: list[int]) -> None:
        """What a ``Step`` reply changed: the daemon knows every queued token, tables grew, frees went.

        Args:
            reply: the unpacked reply.
            reported: the states whose queued tokens the step sent.
            remote: ``(seq id, SeqState, tokens)`` sent without local blocks.
            free_ids, reserve_return: what the step freed and gave back.
        """
        if reserve_return:
            returned = set(reserve_return)
            self.reserve = [b for b in self.reserve if b not in returned]
        for st in reported:
            st.pending.clear()
            st.claims.clear()
        for sid, st, toks in remote:
            st.num_tokens += len(toks)
            st.shared_tail = False
        self._ensure_mapped(reply.blocks)
        self._ensure_mapped(reply.reserve_added)
        blocks = reply.blocks.tolist()
        pos = 0
        for sid, first, n in reply.changes:
            self.seqs[sid].blocks[first:] = blocks[pos:pos + n]
            pos += n
        for sid in free_ids:
            self.seqs.pop(sid, None)
            self.swapped.pop(sid, None)
        self.reserve.extend(reversed(reply.reserve_added.tolist()))  # handed out lowest first
