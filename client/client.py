"""A model process's handle on the pool: attach, map, and run sequences.

The daemon owns the page tables; the client keeps a mirror (each sequence's
block ids and token count) so that ``block_tables`` needs no call.  The hot
path is ``extend``: the daemon grants a *reserve* of free blocks, and while
the reserve lasts the client assigns blocks to its sequences itself and only
queues the tokens.  The queue goes to the daemon, with the blocks it used, in
the next call that needs the daemon anyway (reserve empty, a copy-on-write,
a free) or at the latest every ``flush_every`` steps, so that a steady decode
calls the daemon about once every ``flush_every`` steps and the prefix cache
learns the new full blocks soon after.

``Client`` composes the parts that do this: the ``Session`` (attach, calls),
its ``Liveness`` (event stream, heartbeat), the ``PoolMapping`` (the arena and
its chunks), the ``Mirror`` (page tables, reserve), the ``Stepper`` (``extend``
and the ``Step`` call) and ``Swaps`` (tiers).
"""

from __future__ import annotations

import threading
from typing import Iterable, Mapping

import numpy as np

from .errors import InvalidArgument, KvpoolError
from .layout import Layout
from .liveness import Liveness
from .mapping import PoolMapping
from .mirror import Mirror
from .protocol import kvpool_pb2 as pb
from .sequence import ExtendResult, Sequence, Tokens, seq_ids, token_array, token_list
from .session import Session
from .steps import Stepper
from .swaps import Swaps

__all__ = ["Client", "ExtendResult", "Sequence", "connect"]

Seqs = Sequence | int | Iterable[Sequence | int]


class Client:
    """One attached model process.  Use ``kvpool.connect`` to make one."""

    def __init__(
        self,
        address: str | None,
        *,
        name: str,
        layout: Layout,
        timeout: float = 30.0,
        flush_every: int = 32,
        device: int | None = None,
        reconnect: bool = False,
    ) -> None:
        if not isinstance(layout, Layout):
            raise InvalidArgument("layout must be a kvpool.Layout")
        if flush_every < 1:
            raise InvalidArgument("flush_every must be >= 1")
        self.layout = layout
        self._lock = threading.RLock()
        self._closed = False
        self._session = session = Session(address, name=name, layout=layout, timeout=timeout, device=device,
                                          reconnect=reconnect)
        r = session.attach_reply
        self.session_id = r.session_id
        self.class_id = r.class_id
        self.num_blocks = r.num_blocks
        self.block_bytes = r.block_bytes
        self.backend = r.backend
        self.max_reserve_blocks = r.max_reserve_blocks
        self.max_blocks_per_session = r.max_blocks_per_session
        self.grace_seconds = r.grace_seconds
        self._mapping = PoolMapping(session.conn.address, session.token, r.arena, layout=layout,
                                    num_blocks=r.num_blocks, block_bytes=r.block_bytes, backend=r.backend,
                                    device=device)
        self._mirror = Mirror(layout.block_size, self._mapping.ensure_mapped)
        self._stepper = Stepper(session, self._mirror, self._mapping, flush_every=flush_every,
                                max_reserve_blocks=r.max_reserve_blocks)
        self._swaps = Swaps(session, self._mirror, self._mapping, self._stepper)
        # the lease: a background thread says "still here" when no call did for lease/3
        self._liveness = Liveness(session, r.lease_seconds, on_remap=self._let_go_of_chunks)

    def _let_go_of_chunks(self) -> None:
        # Between two calls only: every reply is then applied, so the daemon's answer lists every chunk this
        # process has blocks in. A sync during a call could answer from before the call's reply handed out blocks
        # in a chunk that had left and came back, and unmap it under kernels about to use it.
        with self._lock:
            self._mapping.let_go_of_chunks()

    # -- what the parts keep -------------------------------------------------------------------
    @property
    def flush_every(self) -> int:
        return self._stepper.flush_every

    @property
    def rpcs(self) -> int:
        """Calls this client made to the daemon (heartbeats not counted)."""
        return self._session.rpcs

    @property
    def chunk_sync_seconds(self) -> float:
        """CUDA VMM: time spent mapping the pool's chunks (``kvpool.handoff``)."""
        return self._mapping.chunk_sync_seconds

    @property
    def device_wait_seconds(self) -> float:
        """GPU: time calls waited for this process's queued device work before telling the daemon it is written."""
        return self._mapping.device_wait_seconds

    @property
    def lease_seconds(self) -> float:
        """The session's lease, as the daemon last told it (0: none)."""
        return self._liveness.lease_seconds

    @property
    def session_expired(self) -> threading.Event:
        """Set when the daemon dropped this session (lease, operator)."""
        return self._liveness.session_expired

    @property
    def daemon_shutting_down(self) -> threading.Event:
        """Set when the daemon says it is stopping."""
        return self._liveness.daemon_shutting_down

    @property
    def _conn(self):
        return self._session.conn

    @property
    def _token(self) -> bytes:
        return self._session.token

    def _add(self, table) -> Sequence:
        return Sequence(self, self._mirror.add(table))

    # -- the pool's memory ----------------------------------------------------------------
    def kv_cache(self):
        """A torch tensor over the whole pool of this layout, zero-copy.

        Shape ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``;
        axis 0 is the physical block id.  On the CPU backend ``numpy.asarray``
        of it (for numpy dtypes) is a writable view of the shared memory.
        """
        with self._lock:
            return self._mapping.kv_cache()

    def kv_cache_cupy(self):
        """The same pool as ``kv_cache()``, as a CuPy array (CUDA backend only).

        CuPy has no bfloat16 or float8: such pools come as their raw bits
        (``uint16`` / ``uint8``) with the same shape.
        """
        with self._lock:
            return self._mapping.kv_cache_cupy()

    def run_copies(self, copies: Iterable[tuple[int, int]]) -> None:
        """Run (src, dst) block copies on the pool (copy-on-write), in this process."""
        with self._lock:
            self._mapping.run_copies(copies)

    # -- sequences --------------------------------------------------------------------------
    def create_sequence(self, token_ids: Tokens, *, extra_key: str = "", wait: bool = True,
                        counted: bool = True) -> Sequence:
        """A new sequence holding ``token_ids``, reusing cached prefix blocks.

        ``num_cached_tokens`` of the result says how many leading tokens are
        already in the pool; the caller computes KV for the rest.  Cached
        blocks found in the host or disk tier are copied back first: with
        ``wait=True`` the call returns once they are there; with
        ``wait=False`` it returns at once and ``Sequence.arriving`` lists the
        positions still on their way (compute the uncached part meanwhile,
        then ``wait`` before reading them).
        """
        return self.create_sequences([token_ids], extra_key=extra_key, wait=wait, counted=counted)[0]

    def create_sequences(self, prompts: Iterable[Tokens], *, extra_key: str = "", wait: bool = True,
                         counted: bool = True) -> list[Sequence]:
        """Several sequences in one call (all or none).

        ``counted=False``: not prefix queries in the daemon's statistics (the caller counted these
        prompts with ``lookup`` already).
        """
        req = pb.CreateRequest(
            session=self._token,
            prompts=[pb.Prompt(tokens=token_array(p).tobytes(), extra_key=extra_key) for p in prompts],
            no_wait=not wait,
            uncounted=not counted,
        )
        with self._lock:
            r = self._session.call("Create", req)
            return [self._add(t) for t in r.sequences]

    def extend(self, batch: Mapping[Sequence | int, Tokens], *, run_copies: bool = True) -> ExtendResult:
        """Append tokens to many sequences: one scheduler step for the whole batch.

        The block tables (``block_tables``) are up to date when this returns;
        the KV of the new tokens is the caller's to write.
        """
        with self._lock:
            return self._stepper.extend(batch, run_copies=run_copies)

    def can_extend_ahead(self, seqs: Seqs) -> bool:
        """Whether ``extend_ahead(seqs)`` can run: it would need no call to the daemon."""
        ids = seq_ids(seqs)
        with self._lock:
            return self._stepper.can_extend_ahead(ids)

    def extend_ahead(self, seqs: Seqs) -> None:
        """Append one token whose id is not known yet to each sequence, without a call.

        For a step loop that runs step n+1 before it reads step n's sampled
        tokens back: the new position gets its block (from the reserve) and
        its slot now, and ``fill_token`` gives it its id once read.  No call
        to the daemon may carry a token of unknown id: until every one is
        filled, a call that would (``extend`` reaching the daemon, ``free``,
        ``flush``, ...) raises ``FailedPrecondition`` and changes nothing;
        ``drop_unknown`` takes them back.

        Raises:
            InvalidArgument: it would need a call (check ``can_extend_ahead``), or a sequence appears twice.
        """
        ids = seq_ids(seqs)
        with self._lock:
            self._stepper.extend_ahead(ids)

    def fill_token(self, seq: Sequence | int, position: int, token: int) -> None:
        """Give the token ``extend_ahead`` queued at ``position`` of ``seq`` its id."""
        (sid,) = seq_ids(seq)
        (tok,) = token_list([token])
        with self._lock:
            self._mirror.fill(self._mirror.extendable(sid), position, tok)

    def drop_unknown(self, seqs: Seqs) -> int:
        """Take back every token of unknown id at the end of these sequences (a step that will not be read);
        returns how many.  Sequences that are not live are skipped."""
        ids = seq_ids(seqs)
        with self._lock:
            return sum(self._mirror.drop_unknown(self._mirror.seqs[sid]) for sid in ids if sid in self._mirror.seqs)

    def mark_written(self, seqs: Seqs) -> None:
        """Say that the KV of these sequences' tokens is written (one call; two when some of their tokens are
        still queued locally, since a call confirms only the tokens the daemon knew before it).

        Until then their new full blocks are prefix hits for this client only:
        another process must not read KV that is not there yet.  Any later
        ``extend`` that reaches the daemon, or ``free``, says the same; call
        this after a prefill that other processes may be waiting to reuse.
        """
        ids = seq_ids(seqs)
        with self._lock:
            if any(self._mirror.state(sid).pending for sid in ids):
                self._stepper.step()
            self._stepper.step(written=ids)

    def flush(self) -> None:
        """Report every queued token to the daemon now (the prefix cache sees them)."""
        with self._lock:
            self._stepper.step()

    def fork(self, seq: Sequence | int) -> Sequence:
        """A new sequence sharing every block of ``seq`` (two continuations of one prefix)."""
        (sid,) = seq_ids(seq)
        with self._lock:
            parent = self._mirror.state(sid)
            if parent.pending:
                self._stepper.step()
            r = self._session.call("Fork", pb.ForkRequest(session=self._token, seq_ids=[sid]))
            child = self._add(r.sequences[0])
            if parent.num_tokens % self.layout.block_size:
                parent.shared_tail = self._mirror.seqs[child.id].shared_tail = True
            return child

    def free(self, seqs: Seqs, *, written: bool = True) -> None:
        """Free sequences; their full blocks stay in the prefix cache.

        ``written=False``: the K/V of the tokens the daemon was last told of may not be in the pool (the
        forward that was to write them failed), so their blocks are dropped rather than cached.
        """
        ids = seq_ids(seqs)
        with self._lock:
            for sid in ids:
                self._mirror.state(sid)
            self._stepper.step(free_ids=ids, free_written=written)

    # -- tiers -----------------------------------------------------------------------
    def swap_out(self, seqs: Seqs) -> int:
        """Preempt sequences: the daemon copies their blocks to the host (or disk) tier and
        frees their device blocks.  Returns how many blocks were given back.

        Their KV must be written (on a GPU, this synchronizes the device first).
        Until ``swap_in`` they have no block table and cannot be extended
        (``FailedPrecondition``); ``free`` still works.
        """
        ids = seq_ids(seqs)
        with self._lock:
            return self._swaps.swap_out(ids)

    def swap_in(self, seqs: Seqs, *, wait: bool = True) -> list[np.ndarray]:
        """Bring swapped-out sequences back (possibly into other blocks); returns their new
        block tables (int32), in order, and updates the mirror.

        ``wait=False``: return before the bytes are there (``Sequence.arriving``;
        ``wait`` before reading them).
        """
        ids = seq_ids(seqs)
        with self._lock:
            return self._swaps.swap_in(ids, wait=wait)

    def wait(self, seqs: Seqs | None = None) -> dict[int, int]:
        """Until the bytes still arriving for these sequences (default: all) are in the pool.

        Returns {sequence id: tokens whose KV is there}: less than
        ``num_cached_tokens`` promised only if bytes were lost (a bad checksum
        on disk); the caller recomputes from there.
        """
        with self._lock:
            return self._swaps.wait(None if seqs is None else seq_ids(seqs))

    def lookup(self, token_ids: Tokens, *, extra_key: str = "", known_tokens: int = 0) -> int:
        """How many leading tokens of ``token_ids`` are cached (any tier); allocates nothing.

        ``known_tokens``: leading tokens the caller holds itself (its own prefix cache); the
        daemon's statistics count the query and its hit from there.
        """
        r = self._session.call("Lookup", pb.LookupRequest(
            session=self._token, prompt=pb.Prompt(tokens=token_array(token_ids).tobytes(), extra_key=extra_key),
            known_tokens=known_tokens))
        return r.num_cached_tokens

    # -- the mirror (no call) -------------------------------------------------------------------
    def block_tables(self, seqs: Iterable[Sequence | int], *, pad: int = 0) -> np.ndarray:
        """A padded ``int32 [len(seqs), max blocks]`` block-table array for a batch."""
        return self._mirror.block_tables(seq_ids(list(seqs)), pad=pad)

    def block_ids(self, seq: Sequence | int, start: int = 0) -> list[int]:
        """The physical block ids of ``seq`` from table position ``start`` on (the mirror; no call).

        Args:
            seq: a live sequence of this client.
            start: the first table position wanted.

        Returns:
            A new list of block ids.
        """
        return self._mirror.state(seq_ids(seq)[0]).blocks[start:]

    def unmapped_blocks(self, blocks: Iterable[int]) -> list[int]:
        """The ids among ``blocks`` with a byte in memory this process does not map now (CUDA VMM; else none).

        A kernel that reads such a block faults: a step's blocks must all be mapped.
        """
        with self._lock:
            return self._mapping.unmapped_blocks(blocks)

    def seq_lens(self, seqs: Iterable[Sequence | int]) -> np.ndarray:
        """``int32 [len(seqs)]`` token counts, matching ``block_tables``."""
        return self._mirror.seq_lens(seq_ids(list(seqs)))

    def slot_mapping(self, seq: Sequence | int, start: int, count: int) -> np.ndarray:
        """Pool slots (block * block_size + offset) of tokens ``start .. start+count-1``."""
        return self._mirror.slot_mapping(seq_ids(seq)[0], start, count)

    def sequences(self) -> list[Sequence]:
        return [Sequence(self, i) for i in self._mirror.seqs]

    @property
    def reserve_size(self) -> int:
        return len(self._mirror.reserve)

    @property
    def max_blocks(self) -> int:
        """The most device blocks this session could ever hold: the class's id space, or the session's quota."""
        quota = self.max_blocks_per_session
        return min(self.num_blocks, quota) if quota else self.num_blocks

    def return_reserve(self) -> int:
        """Give the session's unassigned reserve back to the pool (a create that needs every free block);
        returns how many blocks went back.  The next ``extend`` that reaches the daemon tops it up again."""
        with self._lock:
            given = len(self._mirror.reserve)
            if not given:
                return 0
            self._stepper.step(reserve_return=self._mirror.reserve, reserve_target=0)
            return given

    # -- operator views through this connection ----------------------------------------------
    def stats(self):
        return self._conn.stats()

    # -- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        """Detach: the daemon frees this client's sequences (cached blocks stay cached)."""
        if self._closed:
            return
        self._closed = True
        self._liveness.stop_heartbeat()
        try:
            self._conn.call("Detach", pb.DetachRequest(session=self._token), timeout=5.0)
        except KvpoolError:
            pass  # the daemon is gone or already dropped us: nothing left to free
        finally:
            self._liveness.close_watch()
            self._mapping.close()
            self._conn.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

def connect(
    address: str | None = None,
    *,
    name: str,
    layout: Layout,
    timeout: float = 30.0,
    flush_every: int = 32,
    device: int | None = None,
    reconnect: bool = False,
) -> Client:
    """Attach to kvpoold (``address``: a socket path, default $KVPOOL_SOCKET or /run/kvpoold/kvpoold.sock).

    ``reconnect=True``: while the daemon is not there (UNAVAILABLE: not started yet, or
    restarting), retry the attach with exponential backoff (50 ms doubling to 2 s) for up
    to ``timeout`` seconds instead of failing at once.  A session does not survive a
    daemon restart: after one, calls answer ``SessionExpired``; connect again.

    ``device``: the GPU this process runs on (``1``, ``"cuda:1"``, a ``torch.device``);
    by default torch's current device once this process uses CUDA.  A daemon serving
    several GPUs (``--devices 0,1``) gives the client the pool on that GPU (matched by
    PCI bus id, so ``CUDA_VISIBLE_DEVICES`` may differ); a GPU it does not serve, or
    none named while it serves several, is ``FailedPrecondition``.

    Lease: while the process runs, a background thread keeps the session alive
    (``lease_seconds``, told by the daemon).  A process that was frozen (SIGSTOP)
    for longer than that has lost its session and its sequences: its next call
    raises ``SessionExpired`` saying why, and ``client.session_expired`` is set.
    ``reconnect=True`` does not hide this (the sequences and block tables the
    process holds are gone); connect again and recompute.
    """
    return Client(address, name=name, layout=layout, timeout=timeout, flush_every=flush_every, device=device,
                  reconnect=reconnect)
