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
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence as Seq

import numpy as np

from .connection import Connection
from .errors import FailedPrecondition, InvalidArgument, KvpoolError, NotFound, SessionExpired, Unavailable
from .handoff import arena_fd, attach_ticket, sync_chunks
from .ipc import DeviceMismatch, client_bus_id, open_arena
from .layout import Layout
from .protocol import kvpool_pb2 as pb
from .protocol.wire import I32, I64, U32, unpack

Tokens = Seq[int] | np.ndarray


@dataclass(frozen=True)
class ExtendResult:
    """What an ``extend`` did.

    ``copies`` are the copy-on-write (src, dst) block copies; with
    ``run_copies=True`` (the default) they were already run on the pool.
    ``rpc`` says whether the daemon was called.
    """

    copies: tuple[tuple[int, int], ...]
    rpc: bool


class _SeqState:
    __slots__ = ("blocks", "num_tokens", "num_cached", "shared_tail", "pending", "claims", "arriving")

    def __init__(self, blocks: list[int], num_tokens: int, num_cached: int) -> None:
        self.blocks = blocks
        self.num_tokens = num_tokens
        self.num_cached = num_cached
        self.shared_tail = False  # last block partly filled and maybe shared (after a fork)
        self.pending: list[int] = []  # tokens the daemon has not seen yet
        self.claims: list[int] = []  # reserve blocks assigned locally, not reported yet
        self.arriving: list[int] = []  # positions whose bytes are still arriving (wait=False); see Client.wait


class Sequence:
    """A handle on one of this client's sequences (reads the client's mirror)."""

    __slots__ = ("_client", "id")

    def __init__(self, client: "Client", seq_id: int) -> None:
        self._client = client
        self.id = seq_id

    def _state(self) -> _SeqState:
        return self._client._state(self.id)

    @property
    def block_table(self) -> np.ndarray:
        """Physical block ids, one per ``block_size`` tokens (a copy)."""
        return np.asarray(self._state().blocks, np.int32)

    @property
    def num_tokens(self) -> int:
        return self._state().num_tokens

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens that were already in the prefix cache at creation (their KV is present).

        After ``swap_in``: the tokens whose KV came back (all of them, unless
        bytes were lost, e.g. a bad checksum on disk: recompute from there).
        """
        return self._state().num_cached

    @property
    def swapped(self) -> bool:
        """Swapped out (``Client.swap_out``): no block table until ``Client.swap_in``."""
        return self.id in self._client._swapped

    @property
    def arriving(self) -> list[int]:
        """Block-table positions whose bytes are still on their way (``wait=False``); ``Client.wait`` them."""
        return list(self._state().arriving)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and other.id == self.id and other._client is self._client

    def __hash__(self) -> int:
        return hash(self.id)

    def __repr__(self) -> str:
        return f"Sequence(id={self.id}, num_tokens={self.num_tokens})"


def _ids(seqs) -> list[int]:
    if isinstance(seqs, (Sequence, int)):
        seqs = [seqs]
    return [s.id if isinstance(s, Sequence) else int(s) for s in seqs]


def _tokens(values, what: str = "token ids") -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise InvalidArgument(f"{what} must be a flat sequence of integers")
    if arr.size == 0:
        return np.zeros(0, U32)
    if arr.dtype.kind not in "iu":
        raise InvalidArgument(f"{what} must be integers, got {arr.dtype}")
    if arr.min() < 0 or arr.max() > 0xFFFFFFFF:
        raise InvalidArgument(f"{what} must be in [0, 2**32)")
    return arr.astype(U32, copy=False)


_MAX_TOKEN = 0xFFFFFFFF


def _token_list(values) -> list[int]:
    """Token ids as a list of Python ints, checked; cheap for the short lists of a decode step."""
    if type(values) is list:
        for t in values:
            if type(t) is not int or not 0 <= t <= _MAX_TOKEN:
                break
        else:
            return values
    return _tokens(values).tolist()


def _device_bus_id(device) -> str:
    """PCI bus id of this client's GPU: ``device``, else torch's current device once CUDA is in use; "" if none.

    The daemon binds the session to that GPU's pool (``kvpoold/server/pools.py``).
    """
    try:
        return client_bus_id(device)
    except DeviceMismatch as exc:
        raise FailedPrecondition(str(exc)) from None
    except ValueError as exc:  # not a device
        raise InvalidArgument(str(exc)) from None


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
        self.flush_every = flush_every
        self._conn = Connection(address, timeout=timeout)
        self._lock = threading.RLock()
        self._seqs: dict[int, _SeqState] = {}
        self._swapped: dict[int, _SeqState] = {}  # swapped-out sequences (tiers): no blocks until swap_in
        self._reserve: list[int] = []
        self._steps_since_rpc = 0
        self._arena = None
        self._kv = None
        self._closed = False
        self.rpcs = 0
        self.chunk_sync_seconds = 0.0  # CUDA VMM: time spent mapping the pool's chunks (kvpool.handoff)
        req = pb.AttachRequest(
            name=name, pid=os.getpid(),
            layout=pb.Layout(
                model_id=layout.model_id, revision=layout.revision, num_layers=layout.num_layers,
                num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim, dtype=layout.dtype,
                block_size=layout.block_size,
            ),
        )
        try:
            req.device_bus_id = _device_bus_id(device)  # a daemon serving several GPUs: this GPU's pool
            r = self._attach(req, timeout if reconnect else 0.0)
        except BaseException:
            self._conn.close()
            raise
        self._token = r.session
        self.session_id = r.session_id
        self.class_id = r.class_id
        self.num_blocks = r.num_blocks
        self.block_bytes = r.block_bytes
        self.backend = r.backend
        self.max_reserve_blocks = r.max_reserve_blocks
        self.max_blocks_per_session = r.max_blocks_per_session
        self.grace_seconds = r.grace_seconds
        # the lease: a background thread says "still here" when no call did for lease/3
        self.lease_seconds = r.lease_seconds
        self._last_call = time.monotonic()
        self.session_expired = threading.Event()  # set when the daemon dropped this session (lease, operator)
        self._stop_heartbeat = threading.Event()
        self._descriptor = {
            "kind": r.arena.kind, "nbytes": r.arena.nbytes, "handle": r.arena.handle,
            "device": r.arena.device, "device_id": r.arena.device_id, "chunk_bytes": r.arena.chunk_bytes,
        }
        self._device = device
        self._watch = self._conn._stub.Watch(pb.WatchRequest(session=self._token))
        self.daemon_shutting_down = threading.Event()
        first = next(self._watch)  # the stream is open once the daemon says "attached"
        assert first.kind == "attached", first
        threading.Thread(target=self._follow_watch, name="kvpool-watch", daemon=True).start()
        threading.Thread(target=self._heartbeat, name="kvpool-heartbeat", daemon=True).start()

    # -- plumbing ----------------------------------------------------------------------
    def _attach(self, req, retry_for: float):
        """Attach; with ``retry_for`` > 0, retry UNAVAILABLE with backoff for that many seconds."""
        deadline = time.monotonic() + retry_for
        delay = 0.05
        while True:
            try:
                req.attach_ticket = attach_ticket(self._conn.address)  # one-time: a retry needs a new one
                return self._conn.call("Attach", req)
            except Unavailable:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                time.sleep(min(delay, left))
                delay = min(delay * 2, 2.0)

    def _follow_watch(self) -> None:
        try:
            for event in self._watch:
                if event.kind == "shutdown":
                    self.daemon_shutting_down.set()
                elif event.kind == "remap":
                    self._let_go_of_chunks()
        except Exception:  # noqa: BLE001 - the stream ends when either side closes
            pass

    def _let_go_of_chunks(self) -> None:
        """Chunks left this class (CUDA VMM): sync, so that the daemon may reuse or free them."""
        try:
            self._sync_chunks()
        except Exception:  # noqa: BLE001 - the next reply that needs a chunk syncs again, and says why
            pass

    def _heartbeat(self) -> None:
        """Keep the session's lease while the process lives, busy or idle.

        Runs on its own thread and never takes ``self._lock``: a client whose
        main thread is busy (long GPU work, GIL-heavy Python, a lock held for
        seconds) still heartbeats, as Python threads take turns on the GIL.
        Only a process that does not run at all (SIGSTOP, a hang in native
        code holding the GIL) loses its lease.  With no lease (0) it asks
        every few seconds whether the daemon has started using one since.
        """
        while True:
            interval = self.lease_seconds / 3 if self.lease_seconds > 0 else 5.0
            due = self._last_call + interval
            if self._stop_heartbeat.wait(max(0.05, due - time.monotonic())):
                return
            if time.monotonic() < self._last_call + interval:
                continue  # another call renewed the lease meanwhile
            try:
                r = self._conn.call("Heartbeat", pb.HeartbeatRequest(session=self._token),
                                    timeout=max(1.0, interval))
                self._last_call = time.monotonic()
                self.lease_seconds = r.lease_seconds
            except SessionExpired:
                self.session_expired.set()
                return
            except KvpoolError as exc:
                if exc.code == "UNIMPLEMENTED":
                    return  # a daemon without leases
                self._last_call = time.monotonic()  # daemon away or slow: try again in an interval
            except Exception:  # noqa: BLE001 - e.g. the channel closed under us at exit
                if self._closed:
                    return
                self._last_call = time.monotonic()

    def _call(self, method: str, request):
        self.rpcs += 1
        self._last_call = time.monotonic()
        return self._conn.call(method, request)

    def _state(self, seq_id: int) -> _SeqState:
        st = self._seqs.get(seq_id)
        if st is None:
            st = self._swapped.get(seq_id)
            if st is None:
                raise NotFound(f"sequence {seq_id} is not one of this client's live sequences")
        return st

    def _add(self, t) -> Sequence:
        blocks = unpack(t.block_table, I32)
        self._ensure_mapped(blocks)
        st = self._seqs[t.seq_id] = _SeqState(blocks.tolist(), t.num_tokens, t.num_cached_tokens)
        if t.arriving:
            st.arriving = unpack(t.arriving, I32).tolist()
        return Sequence(self, t.seq_id)

    # -- the pool's memory ----------------------------------------------------------------
    def kv_cache(self):
        """A torch tensor over the whole pool of this layout, zero-copy.

        Shape ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``;
        axis 0 is the physical block id.  On the CPU backend ``numpy.asarray``
        of it (for numpy dtypes) is a writable view of the shared memory.
        """
        with self._lock:
            if self._kv is None:
                fd = arena_fd(self._conn.address, self._token) if self._descriptor["kind"] == "memfd" else None
                self._arena = open_arena(self._descriptor, device=self._device, fd=fd)
                if self._descriptor["kind"] == "cuda_vmm":
                    self._sync_chunks()
                self._kv = self._arena.as_tensor(self.layout.dtype, (self.num_blocks, *self.layout.block_shape))
            return self._kv

    def _sync_chunks(self) -> None:
        """Map the chunks the class has now and drop those it gave up (CUDA VMM; ``kvpool.handoff``)."""
        arena = self._arena
        if arena is None or not hasattr(arena, "chunk_of"):
            return
        t0 = time.perf_counter()
        with arena.lock:
            sync_chunks(self._conn.address, self._token, arena)
        self.chunk_sync_seconds += time.perf_counter() - t0

    def _ensure_mapped(self, blocks) -> None:
        """Before any of ``blocks`` is used here, every chunk they lie in is mapped (CUDA VMM).

        The daemon maps a chunk into its class before it hands out a block in
        it; this process maps it when a reply first names such a block.
        """
        arena = self._arena
        if arena is None or not hasattr(arena, "covers") or arena.covers(blocks, self.block_bytes):
            return
        self._sync_chunks()
        if not arena.covers(blocks, self.block_bytes):
            raise Unavailable("kvpoold handed out blocks in chunks it did not hand this process; attach again")

    def kv_cache_cupy(self):
        """The same pool as ``kv_cache()``, as a CuPy array (CUDA backend only).

        CuPy has no bfloat16 or float8: such pools come as their raw bits
        (``uint16`` / ``uint8``) with the same shape.
        """
        if self.backend != "cuda":
            raise FailedPrecondition(
                "CuPy views exist on the CUDA backend; on the CPU use numpy.asarray(client.kv_cache())"
            )
        self.kv_cache()  # maps the arena
        shape = (self.num_blocks, *self.layout.block_shape)
        if self.layout.dtype in ("float16", "float32"):
            return self._arena.as_cupy(self.layout.dtype, shape)
        raw = {"bfloat16": np.uint16, "float8_e4m3fn": np.uint8}[self.layout.dtype]
        flat = self._arena.as_cupy("uint8", (self.num_blocks * self.block_bytes,))
        return flat.view(raw).reshape(shape)

    def run_copies(self, copies: Iterable[tuple[int, int]]) -> None:
        """Run (src, dst) block copies on the pool (copy-on-write), in this process."""
        pairs = list(copies)
        if not pairs:
            return
        import torch

        from kvpool.kernels.block_copy import copy_blocks

        kv = self.kv_cache()
        copy_blocks(kv, torch.tensor(pairs, dtype=torch.int64, device=kv.device))

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
            prompts=[pb.Prompt(tokens=_tokens(p).tobytes(), extra_key=extra_key) for p in prompts],
            no_wait=not wait,
            uncounted=not counted,
        )
        with self._lock:
            r = self._call("Create", req)
            return [self._add(t) for t in r.sequences]

    def extend(self, batch: Mapping[Sequence | int, Tokens], *, run_copies: bool = True) -> ExtendResult:
        """Append tokens to many sequences: one scheduler step for the whole batch.

        The block tables (``block_tables``) are up to date when this returns;
        the KV of the new tokens is the caller's to write.
        """
        with self._lock:
            bs = self.layout.block_size
            seqs = self._seqs
            local, remote, want = [], [], 0
            for seq, toks in batch.items():
                sid = seq.id if type(seq) is Sequence else int(seq)
                st = seqs.get(sid)
                if st is None:
                    if sid in self._swapped:
                        raise FailedPrecondition(f"sequence {sid} is swapped out: swap it in before extending it")
                    raise NotFound(f"sequence {sid} is not one of this client's live sequences")
                toks = _token_list(toks)
                if not toks:
                    continue
                nt = st.num_tokens
                if st.shared_tail and nt % bs:
                    remote.append((sid, st, toks))  # copy-on-write is the daemon's call
                else:
                    grow = (nt + len(toks) + bs - 1) // bs - len(st.blocks)
                    local.append((sid, st, toks, grow))
                    want += grow
            if len(local) + len(remote) > 1 and len({x[0] for x in local} | {x[0] for x in remote}) != len(local) + len(remote):
                raise InvalidArgument("a sequence appears twice in one extend")
            self._steps_since_rpc += 1
            if not remote and want <= len(self._reserve) and self._steps_since_rpc < self.flush_every:
                for sid, st, toks, grow in local:
                    self._assign_locally(st, toks, grow)
                return ExtendResult((), False)
            return self._step(local, remote, [], run_copies)

    def _assign_locally(self, st: _SeqState, toks: list[int], grow: int) -> None:
        if grow:
            reserve = self._reserve
            taken = reserve[-grow:]
            del reserve[-grow:]
            st.blocks.extend(taken)
            st.claims.extend(taken)
        st.pending.extend(toks)
        st.num_tokens += len(toks)

    def _reserve_target(self, live: int) -> int:
        """The reserve to ask for with ``live`` sequences; none without any, since only extends draw on it."""
        if not live:
            return 0
        bs = self.layout.block_size
        per_seq = -(-self.flush_every // bs)
        return min(self.max_reserve_blocks, max(8, 2 * per_seq * live))

    def _reserve_surplus(self, freeing: int) -> list[int]:
        """Reserve blocks to give back with this call: all of them when no sequence is left, else what lies
        beyond the target once the reserve holds more than twice it.  A reserve is held memory: a model whose
        batch shrank or that went idle would otherwise keep slabs that other models need."""
        target = self._reserve_target(len(self._seqs) - freeing)
        if len(self._reserve) <= 2 * target:
            return []
        return self._reserve[:len(self._reserve) - target]  # the stack's bottom: the last blocks it would use

    def _step(self, local, remote, free_ids: list[int], run_copies: bool, written: Iterable[int] = (),
              free_written: bool = True, reserve_return: list[int] = (), reserve_target: int | None = None,
              ) -> ExtendResult:
        """One Step call: queued tokens, this step's tokens, frees, reserve top-up.

        Every sequence named in a Step (``written`` names more, with no
        tokens) tells the daemon that the KV of the tokens it knew is written,
        and a free lets the daemon copy blocks out: on a GPU the writes this
        process queued are finished first, so no other process reads a block
        before they land.
        """
        self._sync_device()
        ids, counts, toks_out, claim_counts, claims = [], [], [], [], []
        touched = []
        # local assignments go through the reserve first (the daemon allocates what is missing)
        # (the table stays short by what the reserve could not cover until the reply fills it)
        sent_now = {}
        for sid, st, toks, grow in local:
            sent_now[sid] = (len(toks), min(grow, len(self._reserve)))
            self._assign_locally(st, toks, sent_now[sid][1])
        for sid, st in self._seqs.items():
            if st.pending:
                ids.append(sid)
                counts.append(len(st.pending))
                toks_out.extend(st.pending)
                claim_counts.append(len(st.claims))
                claims.extend(st.claims)
                touched.append(st)
        for sid, st, toks in remote:
            ids.append(sid)
            counts.append(len(toks))
            toks_out.extend(toks)
            claim_counts.append(0)
        named = set(ids)
        for sid in written:
            if sid not in named:
                named.add(sid)
                ids.append(sid)
                counts.append(0)
                claim_counts.append(0)
        if reserve_target is None and not reserve_return:
            reserve_return = self._reserve_surplus(len(free_ids))
        req = pb.StepRequest(
            session=self._token,
            seq_ids=np.asarray(ids, I64).tobytes(),
            token_counts=b"" if all(c == 1 for c in counts) else np.asarray(counts, I32).tobytes(),
            tokens=np.array(toks_out, U32).tobytes(),
            claim_counts=np.asarray(claim_counts, I32).tobytes() if claims else b"",
            claims=np.asarray(claims, I32).tobytes(),
            free_seq_ids=free_ids,
            free_unwritten=not free_written,
            reserve_target=self._reserve_target(len(self._seqs) - len(free_ids)) if reserve_target is None
            else reserve_target,
            reserve_return=np.asarray(reserve_return, I32).tobytes(),
        )
        try:
            r = self._call("Step", req)
        except KvpoolError:
            self._rollback_unsent(local, sent_now)
            raise
        self._steps_since_rpc = 0
        if reserve_return:
            returned = set(reserve_return)
            self._reserve = [b for b in self._reserve if b not in returned]
        # the daemon now knows every queued token
        for st in touched:
            st.pending.clear()
            st.claims.clear()
        for sid, st, toks in remote:
            st.num_tokens += len(toks)
            st.shared_tail = False
        d_ids = unpack(r.delta_seq_ids, I64)
        d_first = unpack(r.delta_first, I32)
        d_counts = unpack(r.delta_counts, I32)
        d_blocks = unpack(r.delta_blocks, I32)
        added = unpack(r.reserve_added, I32)
        self._ensure_mapped(d_blocks)
        self._ensure_mapped(added)
        d_blocks = d_blocks.tolist()
        pos = 0
        for sid, first, n in zip(d_ids.tolist(), d_first.tolist(), d_counts.tolist()):
            st = self._seqs[sid]
            st.blocks[first:] = d_blocks[pos:pos + n]
            pos += n
        for sid in free_ids:
            self._seqs.pop(sid, None)
            self._swapped.pop(sid, None)
        self._reserve.extend(reversed(added.tolist()))  # handed out lowest first
        pairs = unpack(r.copies, I32).reshape(-1, 2)
        copies = tuple((int(a), int(b)) for a, b in pairs)
        if copies and run_copies:
            self.run_copies(copies)
        return ExtendResult(copies, True)

    def _rollback_unsent(self, local, sent_now: dict) -> None:
        """Undo this step's local assignments after a failed call (older queued ones stay)."""
        for sid, st, toks, grow in reversed(local):
            n, taken = sent_now[sid]
            del st.pending[len(st.pending) - n:]
            st.num_tokens -= n
            if taken:
                back = st.blocks[-taken:]
                del st.blocks[-taken:]
                del st.claims[-taken:]
                self._reserve.extend(back)

    def mark_written(self, seqs: Sequence | int | Iterable[Sequence | int]) -> None:
        """Say that the KV of these sequences' tokens is written (one call; two when some of their tokens are
        still queued locally, since a call confirms only the tokens the daemon knew before it).

        Until then their new full blocks are prefix hits for this client only:
        another process must not read KV that is not there yet.  Any later
        ``extend`` that reaches the daemon, or ``free``, says the same; call
        this after a prefill that other processes may be waiting to reuse.
        """
        ids = _ids(seqs)
        with self._lock:
            if any(self._state(sid).pending for sid in ids):
                self._step([], [], [], True)
            self._step([], [], [], True, written=ids)

    def flush(self) -> None:
        """Report every queued token to the daemon now (the prefix cache sees them)."""
        with self._lock:
            self._step([], [], [], True)

    def fork(self, seq: Sequence | int) -> Sequence:
        """A new sequence sharing every block of ``seq`` (two continuations of one prefix)."""
        (sid,) = _ids(seq)
        with self._lock:
            parent = self._state(sid)
            if parent.pending:
                self._step([], [], [], True)
            r = self._call("Fork", pb.ForkRequest(session=self._token, seq_ids=[sid]))
            child = self._add(r.sequences[0])
            if parent.num_tokens % self.layout.block_size:
                parent.shared_tail = self._seqs[child.id].shared_tail = True
            return child

    def free(self, seqs: Sequence | int | Iterable[Sequence | int], *, written: bool = True) -> None:
        """Free sequences; their full blocks stay in the prefix cache.

        ``written=False``: the K/V of the tokens the daemon was last told of may not be in the pool (the
        forward that was to write them failed), so their blocks are dropped rather than cached.
        """
        ids = _ids(seqs)
        with self._lock:
            for sid in ids:
                self._state(sid)
            self._step([], [], ids, True, free_written=written)

    # -- tiers -----------------------------------------------------------------------
    def swap_out(self, seqs: Sequence | int | Iterable[Sequence | int]) -> int:
        """Preempt sequences: the daemon copies their blocks to the host (or disk) tier and
        frees their device blocks.  Returns how many blocks were given back.

        Their KV must be written (on a GPU, this synchronizes the device first).
        Until ``swap_in`` they have no block table and cannot be extended
        (``FailedPrecondition``); ``free`` still works.
        """
        ids = _ids(seqs)
        with self._lock:
            for sid in ids:
                if sid in self._swapped:
                    raise FailedPrecondition(f"sequence {sid} is already swapped out")
                self._state(sid)
            if any(self._seqs[sid].pending for sid in ids):
                self._step([], [], [], True)  # the daemon knows every token before it copies the blocks
            self._sync_device()
            r = self._call("SwapOut", pb.SwapRequest(session=self._token, seq_ids=ids))
            for sid in ids:
                st = self._seqs.pop(sid)
                st.blocks, st.arriving, st.shared_tail = [], [], False
                self._swapped[sid] = st
            return r.blocks

    def swap_in(self, seqs: Sequence | int | Iterable[Sequence | int], *, wait: bool = True) -> list[np.ndarray]:
        """Bring swapped-out sequences back (possibly into other blocks); returns their new
        block tables (int32), in order, and updates the mirror.

        ``wait=False``: return before the bytes are there (``Sequence.arriving``;
        ``wait`` before reading them).
        """
        ids = _ids(seqs)
        with self._lock:
            for sid in ids:
                if sid not in self._swapped:
                    self._state(sid)
                    raise FailedPrecondition(f"sequence {sid} is not swapped out")
            r = self._call("SwapIn", pb.SwapRequest(session=self._token, seq_ids=ids, no_wait=not wait))
            out = []
            for t in r.sequences:
                st = self._swapped.pop(t.seq_id)
                blocks = unpack(t.block_table, I32)
                self._ensure_mapped(blocks)
                st.blocks = blocks.tolist()
                st.num_cached = t.num_cached_tokens
                st.arriving = unpack(t.arriving, I32).tolist() if t.arriving else []
                self._seqs[t.seq_id] = st
                out.append(np.asarray(st.blocks, np.int32))
            return out

    def wait(self, seqs: Sequence | int | Iterable[Sequence | int] | None = None) -> dict[int, int]:
        """Until the bytes still arriving for these sequences (default: all) are in the pool.

        Returns {sequence id: tokens whose KV is there}: less than
        ``num_cached_tokens`` promised only if bytes were lost (a bad checksum
        on disk); the caller recomputes from there.
        """
        with self._lock:
            ids = [sid for sid, st in self._seqs.items() if st.arriving] if seqs is None else _ids(seqs)
            if not ids:
                return {}
            r = self._call("Wait", pb.WaitRequest(session=self._token, seq_ids=ids))
            out = {}
            for t in r.sequences:
                st = self._seqs.get(t.seq_id)
                if st is not None:
                    st.num_cached = min(st.num_cached, t.num_cached_tokens)
                    st.arriving = []
                    out[t.seq_id] = st.num_cached
            return out

    def _sync_device(self) -> None:
        """Make this process's pool writes visible to the daemon's copies (GPU: synchronize).

        The ordering rule between a client and the daemon, which needs no CUDA
        event shared between the processes:

        * The daemon reads pool blocks on a client's behalf (swap-out; demotion
          of cached blocks to the host or disk tier) only after a call that
          says their KV is written: a ``Step`` (``extend`` reaching the daemon,
          ``flush``, ``mark_written``, ``free``) or ``SwapOut``.  This method
          runs first in each of those calls, so every kernel this process
          queued on the pool has finished before the daemon can copy a block
          out.  Blocks of a session that ends without such a call lose their
          hash and are never copied out.
        * The daemon's own copies complete before the reply that lets a client
          use the blocks involved: device reads (demotions, swap-outs) before
          it replies to the call that planned them, so a block is handed out
          again only after its bytes are copied; device writes (promotions,
          swap-ins) before ``Create``/``SwapIn`` reply, or with ``wait=False``
          before ``Wait`` replies for the positions listed in
          ``Sequence.arriving`` (the daemon holds those blocks meanwhile).  A
          reply therefore means the bytes are in place; the client launches
          nothing on them before it.
        * Copy-on-write copies are run by this process on its own stream
          (``run_copies``), ordered after its own writes by stream order.
        """
        if self._kv is not None and getattr(self._kv, "is_cuda", False):
            import torch

            torch.cuda.synchronize(self._kv.device)

    def lookup(self, token_ids: Tokens, *, extra_key: str = "", known_tokens: int = 0) -> int:
        """How many leading tokens of ``token_ids`` are cached (any tier); allocates nothing.

        ``known_tokens``: leading tokens the caller holds itself (its own prefix cache); the
        daemon's statistics count the query and its hit from there.
        """
        r = self._call("Lookup", pb.LookupRequest(
            session=self._token, prompt=pb.Prompt(tokens=_tokens(token_ids).tobytes(), extra_key=extra_key),
            known_tokens=known_tokens))
        return r.num_cached_tokens

    def block_tables(self, seqs: Iterable[Sequence | int], *, pad: int = 0) -> np.ndarray:
        """A padded ``int32 [len(seqs), max blocks]`` block-table array for a batch."""
        states = [self._state(i) for i in _ids(list(seqs))]
        width = max((len(s.blocks) for s in states), default=0)
        out = np.full((len(states), width), pad, np.int32)
        for row, st in zip(out, states):
            row[: len(st.blocks)] = st.blocks
        return out

    def block_ids(self, seq: Sequence | int, start: int = 0) -> list[int]:
        """The physical block ids of ``seq`` from table position ``start`` on (the mirror; no call).

        Args:
            seq: a live sequence of this client.
            start: the first table position wanted.

        Returns:
            A new list of block ids.
        """
        return self._state(_ids(seq)[0]).blocks[start:]

    def seq_lens(self, seqs: Iterable[Sequence | int]) -> np.ndarray:
        """``int32 [len(seqs)]`` token counts, matching ``block_tables``."""
        return np.asarray([self._state(i).num_tokens for i in _ids(list(seqs))], np.int32)

    def slot_mapping(self, seq: Sequence | int, start: int, count: int) -> np.ndarray:
        """Pool slots (block * block_size + offset) of tokens ``start .. start+count-1``."""
        st = self._state(_ids(seq)[0])
        if start < 0 or count < 0 or start + count > st.num_tokens:
            raise InvalidArgument(f"tokens {start}..{start + count} are outside the sequence's {st.num_tokens}")
        bs = self.layout.block_size
        pos = np.arange(start, start + count)
        return np.asarray(st.blocks, np.int64)[pos // bs] * bs + pos % bs

    def sequences(self) -> list[Sequence]:
        return [Sequence(self, i) for i in self._seqs]

    @property
    def reserve_size(self) -> int:
        return len(self._reserve)

    @property
    def max_blocks(self) -> int:
        """The most device blocks this session could ever hold: the class's id space, or the session's quota."""
        quota = self.max_blocks_per_session
        return min(self.num_blocks, quota) if quota else self.num_blocks

    def return_reserve(self) -> int:
        """Give the session's unassigned reserve back to the pool (a create that needs every free block);
        returns how many blocks went back.  The next ``extend`` that reaches the daemon tops it up again."""
        with self._lock:
            if not self._reserve:
                return 0
            given = len(self._reserve)
            self._step([], [], [], True, reserve_return=self._reserve, reserve_target=0)
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
        self._stop_heartbeat.set()
        try:
            self._conn.call("Detach", pb.DetachRequest(session=self._token), timeout=5.0)
        except KvpoolError:
            pass  # the daemon is gone or already dropped us: nothing left to free
        finally:
            self._watch.cancel()
            self._kv = None
            if self._arena is not None:
                self._arena.close()
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
