"""Tier 3: a remote block store on Redis or Valkey, shared by the daemons of several machines.

Blocks are content-addressed: a block's key is
``<prefix>:<layout tag>:<block name>``.  The hash chain already names the
model id, revision and extra key; the layout tag names the block's geometry
and its tenant, so layouts never collide and tenants never see each other's
blocks.  A value is a header (magic, version, check, payload bytes, the
layout it was written with) and the block's bytes; a value whose header,
layout or check does not match is dropped, counted, deleted and treated as
missing.

Everyone who can reach the server is trusted unless the operator gives a
secret (``--remote-key-file``).  Without one, the block name is the block
hash in hex and the check an xxh3-64 checksum: whoever reaches the server can
compute a prompt's keys from its tokens (and learn whether it is cached,
and read its KV) and write values that pass.  With one, the layout tag, the
block name (HMAC-SHA256 of the block hash) and the check (an HMAC-SHA256 tag
over the value's key and payload) are keyed with keys derived from the
secret and the layout, so per tenant: keys cannot be told from a prompt, and
a value that nobody holding the secret wrote for that very key is refused
(counted as forged) before any byte of it reaches a pool.  Daemons with the
same secret share blocks (per tenant and model, as without one); values are
not encrypted.

Nothing here runs on the daemon's event loop except the cheap calls that
queue work (``put``) and hand a fetch to the worker pool (``submit_fetch``):

* writes go through one writer thread that drains a bounded queue in
  pipelined batches (``batch_blocks`` per round trip); when the queue is full
  the oldest blocks are dropped and counted, so a slow or absent Redis never
  holds the daemon back;
* a fetch (``EXISTS`` to find where each chain stops, then one ``MGET`` of the
  prefix that exists) runs on a worker thread; the caller awaits it with a
  deadline and counts the blocks as missing past it.

On one server both paths skip redis-py's per-command work: a write batch is
packed here into the wire protocol with each payload sent from the pool's copy
as it is (no value is assembled), and its answers are read on one connection;
a fetch counts keys per chain (``EXISTS k1 k2 ...``) instead of asking key by
key.  A Redis Cluster goes through the client's pipeline, which routes each key
to its node.

Faults put the store in *backoff*: fetches are skipped (a local miss, counted)
until the retry time, writes wait in the queue; the backoff doubles up to
``MAX_BACKOFF`` and resets on the first success.

Parts: ``remote_values`` (keys, headers, checks, the packed write commands),
``remote_settings`` (``RemoteSettings``, fault messages); ``RemoteStore``
and ``RemoteLink`` here.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass

from kvpoold.config import redact

from .remote_settings import RemoteSettings, describe
from .remote_values import Namespace, decode, encode, layout_string, pack_sets

log = logging.getLogger("kvpoold")

# The store's API; the settings and the value format live in their own modules.
__all__ = ["Fetched", "Namespace", "RemoteLink", "RemoteSettings", "RemoteStore", "decode", "encode", "layout_string"]

EVENT_QUEUE = 10000  # KV events waiting for the stream; beyond, the oldest are dropped
STREAM_MAXLEN = 100000  # the stream is capped (approximately) at this many entries
MIN_BACKOFF = 0.2
MAX_BACKOFF = 5.0


def redis_exceptions():
    """``redis.exceptions`` (redis-py is imported only when a remote tier is configured)."""
    import redis.exceptions

    return redis.exceptions


def _first_false(flags) -> int:
    """The index of the first false flag (their number if none is)."""
    return next((i for i, f in enumerate(flags) if not f), len(flags))


@dataclass(frozen=True)
class Fetched:
    """A fetch's answer: the payload of each hash found (a prefix of the chain asked for)."""

    payloads: dict
    asked: int
    refused: int = 0  # values that failed their check (counted as corrupt, or with a secret as forged)


class RemoteStore:
    """The connection, the writer thread, the fetch workers and the counters of the remote tier."""

    def __init__(self, settings: RemoteSettings, client=None) -> None:
        """``client``: a redis-py client to use (tests); default one made from ``settings``."""
        self.settings = settings
        self._client = client
        self._lock = threading.Lock()  # the counters, the backoff and the write queue
        self._queue: collections.deque = collections.deque()  # (key, value)
        self._queued_bytes = 0
        self._in_flight = 0  # blocks of the batch being written
        self._events: collections.deque = collections.deque()  # (stream, fields) for XADD
        self._wake = threading.Condition(self._lock)
        self._closing = False
        self._backoff = 0.0
        self.retry_at = 0.0  # monotonic: no fetch before this (backoff)
        self.state = "connecting"
        self.last_error = ""
        # counters
        self.lookups = 0
        self.hit_blocks = 0
        self.miss_blocks = 0
        self.skipped_lookups = 0  # not asked: backoff
        self.timeouts = 0
        self.failures = 0
        self.corrupt_blocks = 0
        self.forged_blocks = 0  # with a secret: values whose tag did not verify (nobody holding it wrote them)
        self.blocks_written = 0
        self.bytes_written = 0
        self.bytes_read = 0
        self.write_dropped = 0
        self.events_dropped = 0
        self.fetch_seconds = 0.0
        self.write_seconds = 0.0
        self._fetches = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kvpool-remote-fetch")
        self._writer = threading.Thread(target=self._write_forever, name="kvpool-remote-write", daemon=True)
        self._writer.start()
        self._fetches.submit(self._probe)  # operators see "connected" (or why not) at start
        if settings.secret is None:
            log.warning("remote tier without --remote-key-file: anyone who can reach %s can read and forge "
                        "cached KV and tell which prompts are cached", redact(settings.url))

    def _probe(self) -> None:
        try:
            self.client.ping()
        except Exception as exc:  # noqa: BLE001 - counted and logged; serving goes on locally
            self._failed(exc, "connect")
        else:
            self._succeeded()

    # -- the connection --------------------------------------------------------------------------------
    @property
    def client(self):
        if self._client is None:
            s = self.settings
            kw = s.client_options()
            if s.cluster:
                from redis.cluster import RedisCluster

                self._client = RedisCluster.from_url(s.url, **kw)
            else:
                import redis

                self._client = redis.Redis.from_url(s.url, **kw)
        return self._client

    def _failed(self, exc: BaseException, what: str) -> None:
        with self._lock:
            self.failures += 1
            self._backoff = min(MAX_BACKOFF, self._backoff * 2 or MIN_BACKOFF)
            self.retry_at = time.monotonic() + self._backoff
            was, self.state = self.state, "backoff"
            self.last_error = f"{what}: {describe(exc, self.settings)}"[:400]
        if was != "backoff":
            log.warning("remote tier %s: %s; serving from the local tiers, retrying in %.1f s",
                        redact(self.settings.url), self.last_error, self._backoff)

    def _succeeded(self) -> None:
        if self.state != "connected":
            with self._lock:
                was, self.state, self._backoff = self.state, "connected", 0.0
            if was == "backoff":
                log.info("remote tier %s: reachable again", redact(self.settings.url))

    def slow(self) -> None:
        """A fetch ran past its deadline: back off (the server is stalled or far)."""
        with self._lock:
            self.timeouts += 1
        self._failed(TimeoutError(f"no answer within {self.settings.timeout * 1000:.0f} ms"), "fetch")

    def available(self) -> bool:
        """Whether a fetch may be tried now (not in backoff)."""
        if time.monotonic() >= self.retry_at:
            return True
        with self._lock:
            self.skipped_lookups += 1
        return False

    # -- fetches (worker threads) -------------------------------------------------------------------------
    def submit_fetch(self, ns: Namespace, chains: list[list[bytes]], read: bool = True
                     ) -> concurrent.futures.Future:
        """Start ``fetch`` on a worker thread; returns its future."""
        return self._fetches.submit(self.fetch, ns, chains, read)

    def fetch(self, ns: Namespace, chains: list[list[bytes]], read: bool = True) -> Fetched:
        """The longest prefix of each chain the store holds: which blocks exist, then their values.

        Args:
            ns: the layout's namespace.
            chains: block hashes in chain order, one list per prompt.
            read: False: only find out which exist (the payloads are None).
        Returns:
            ``Fetched``: hash -> verified payload (or None) of every block of the prefixes found; a chain
            stops at its first missing or refused block (a refused value is deleted and counted: corrupt,
            or with a secret forged).
        """
        t0 = time.perf_counter()
        asked = sum(map(len, chains))
        try:
            keyed = [[(d, ns.key(d)) for d in chain] for chain in chains]
            lengths = self._prefix_lengths([[k for _, k in chain] for chain in keyed])
            prefixes = [chain[:n] for chain, n in zip(keyed, lengths)]
            payloads: dict = {}
            refused = 0
            if not read:
                payloads = {d: None for prefix in prefixes for d, _ in prefix}
            elif any(prefixes):
                keys = list(dict.fromkeys(k for prefix in prefixes for _, k in prefix))  # once each
                values = dict(zip(keys, self._values(keys)))
                bad = set()
                nread = 0
                for prefix in prefixes:
                    for d, k in prefix:
                        if d in payloads:
                            continue  # another chain's block, read and checked already
                        v = values[k]
                        payload = decode(ns, k, v) if v is not None and k not in bad else None
                        if payload is None:
                            if v is not None:
                                bad.add(k)
                            break  # the chain stops at its first missing or bad block
                        nread += len(v)
                        payloads[d] = payload
                if bad:
                    refused = len(bad)
                    pipe = self.client.pipeline(transaction=False)
                    for k in bad:  # nobody else trips on them; a writer puts good ones back
                        pipe.delete(k)  # one key per command: the keys of a cluster live on several nodes
                    pipe.execute()
                    if ns.authenticated:
                        log.warning("remote tier: %d values without a valid tag of --remote-key-file's secret "
                                    "(forged, or altered in the store): dropped", refused)
                    else:
                        log.warning("remote tier: %d blocks failed their checksum or layout check: dropped", refused)
                with self._lock:
                    self.bytes_read += nread
        except Exception as exc:  # noqa: BLE001 - any fault of the store is a miss, never an error
            self._failed(exc, "fetch")
            return Fetched({}, asked)
        self._succeeded()
        with self._lock:
            self.fetch_seconds += time.perf_counter() - t0
            if ns.authenticated:
                self.forged_blocks += refused
            else:
                self.corrupt_blocks += refused
        return Fetched(payloads, asked, refused)

    def _prefix_lengths(self, chains: list[list[bytes]]) -> list[int]:
        """How many keys of each chain exist before its first missing one.

        On one server, by counts, so that a whole chain costs one answer, not one per key: one ``EXISTS`` of
        each chain's keys (all there, or none: done); for a chain with some, one ``EXISTS`` of as many keys
        from its start (all there: they are its prefix); only a chain with a hole in that start is asked key
        by key.  On a cluster (keys on several nodes), key by key.
        """
        if self.settings.cluster:
            return [_first_false(flags) for flags in self._each("exists", chains)]
        counts = self._counts(chains)
        partial = [i for i, (c, chain) in enumerate(zip(counts, chains)) if 0 < c < len(chain)]
        if partial:
            starts = self._counts([chains[i][:counts[i]] for i in partial])
            holes = [i for i, n in zip(partial, starts) if n != counts[i]]
            for i, flags in zip(holes, self._each("exists", [chains[i] for i in holes])):
                counts[i] = _first_false(flags)
        return [min(c, len(chain)) for c, chain in zip(counts, chains)]

    def _counts(self, chains: list[list[bytes]]) -> list[int]:
        """``EXISTS`` of each chain's keys (one command per chain, one round trip): how many exist."""
        pipe = self.client.pipeline(transaction=False)
        for chain in chains:
            if chain:
                pipe.exists(*chain)
        answers = iter(pipe.execute())
        return [next(answers) if chain else 0 for chain in chains]

    def _values(self, keys: list[bytes]) -> list:
        """The values of ``keys`` (None where missing), in one round trip: ``MGET`` on one server, a pipelined
        ``GET`` per key on a cluster."""
        if not self.settings.cluster:
            return self.client.mget(keys)
        pipe = self.client.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        return pipe.execute()

    def _each(self, command: str, chains: list[list[bytes]]) -> list[list]:
        """One pipelined round trip of ``command key`` for every key of every chain; answers per chain."""
        pipe = self.client.pipeline(transaction=False)
        for chain in chains:
            for k in chain:
                getattr(pipe, command)(k)
        answers = iter(pipe.execute())
        return [[next(answers) for _ in chain] for chain in chains]

    def count_lookup(self, asked: int, found: int) -> None:
        with self._lock:
            self.lookups += 1
            self.hit_blocks += found
            self.miss_blocks += asked - found

    # -- writes (the writer thread) ----------------------------------------------------------------------
    def put_many(self, ns: Namespace, digests: list[bytes], rows) -> None:
        """Queue blocks for writing: ``rows[i]`` holds the bytes of ``digests[i]`` and is the store's now.

        Never blocks (the writer thread encodes and sends them): beyond ``queue_bytes`` the oldest queued
        blocks are dropped (counted).
        """
        with self._lock:
            for d, row in zip(digests, rows):
                self._queue.append((ns.key(d), ns, row))
                self._queued_bytes += row.nbytes
            while self._queued_bytes > self.settings.queue_bytes and self._queue:
                self._queued_bytes -= self._queue.popleft()[2].nbytes
                self.write_dropped += 1
            self._wake.notify()

    def add_event(self, stream: str, event) -> None:
        """Queue a KV event (``events.KvEvent``) for ``XADD`` to ``stream``; never blocks."""
        fields = {"seq": event.seq, "kind": event.kind, "tier": event.tier, "from_tier": event.from_tier,
                  "model_ids": ",".join(event.model_ids), "layout": event.layout,
                  "block_hashes": ",".join(h.hex() for h in event.block_hashes), "time": event.time,
                  "device": event.device}
        with self._lock:
            self._events.append((stream, fields))
            if len(self._events) > EVENT_QUEUE:
                self._events.popleft()
                self.events_dropped += 1
            self._wake.notify()

    def _next_batch(self) -> tuple[list, list] | None:
        """(blocks, events) to send in the next round trip; None when closing."""
        with self._lock:
            while not self._queue and not self._events and not self._closing:
                self._wake.wait()
            if self._closing:
                return None
            n = min(len(self._queue), self.settings.batch_blocks)
            batch = [self._queue.popleft() for _ in range(n)]
            events = list(self._events)
            self._events.clear()
            self._queued_bytes -= sum(row.nbytes for _, _, row in batch)
            self._in_flight = len(batch) + len(events)
            return batch, events

    def _requeue(self, batch: list) -> None:
        with self._lock:
            for item in reversed(batch):
                self._queue.appendleft(item)
                self._queued_bytes += item[2].nbytes
            while self._queued_bytes > self.settings.queue_bytes and self._queue:
                self._queued_bytes -= self._queue.popleft()[2].nbytes
                self.write_dropped += 1

    def write_batch(self, batch: list, events: list = ()) -> int:
        """One pipelined round trip of ``SET key value [EX ttl]`` for (key, namespace, bytes) items, and
        ``XADD`` for (stream, fields) events.

        On one server the commands are packed here (``pack_sets``: no copy of a payload) and sent on one
        connection of the client's pool; on a cluster through the client's pipeline, which routes each key
        to its node.

        Returns:
            The value bytes sent (raises the client's errors).
        """
        ttl = max(1, int(self.settings.ttl)) if self.settings.ttl > 0 else 0
        xadds = [("XADD", stream, "MAXLEN", "~", STREAM_MAXLEN, "*", *(x for kv in fields.items() for x in kv))
                 for stream, fields in events]
        if self.settings.cluster:
            pipe = self.client.pipeline(transaction=False)
            sent = 0
            for k, ns, row in batch:
                v = encode(ns, k, row)
                sent += len(v)
                if ttl:
                    pipe.set(k, v, ex=ttl)
                else:
                    pipe.set(k, v)
            for args in xadds:
                pipe.execute_command(*args)
            pipe.execute()
            return sent
        buffers, sent = pack_sets(batch, ttl)
        for attempt in (1, 2):  # a connection the server closed (a restart) is found on use: once more, anew
            try:
                self._send_all(buffers, len(batch), xadds)
            except redis_exceptions().ConnectionError:
                if attempt == 2:
                    raise
            else:
                break
        return sent

    def _send_all(self, buffers: list, commands: int, more: list) -> None:
        """Send packed commands (``buffers``, holding ``commands``) and the commands ``more`` (argument
        tuples) on one connection of the pool, and read every answer; raises the first error answer."""
        pool = self.client.connection_pool
        conn = pool.get_connection()
        error = None
        try:
            if more:
                buffers = buffers + conn.pack_commands(more)
            conn.send_packed_command(buffers)
            for _ in range(commands + len(more)):  # every answer is read: the connection stays in step
                try:
                    conn.read_response()
                except redis_exceptions().ResponseError as exc:  # e.g. OOM: raised once all are read
                    error = error or exc
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)
        if error is not None:
            raise error

    def _write_forever(self) -> None:
        while True:
            wait = self.retry_at - time.monotonic()
            if wait > 0 and not self._closing:
                time.sleep(min(wait, 0.5))
                continue
            got = self._next_batch()
            if got is None:
                return
            batch, events = got
            t0 = time.perf_counter()
            try:
                sent = self.write_batch(batch, events)
            except Exception as exc:  # noqa: BLE001 - blocks kept queued, retried after the backoff
                if self._closing:
                    return
                self._requeue(batch)
                with self._lock:
                    self.events_dropped += len(events)
                self._in_flight = 0
                self._failed(exc, "write")
                continue
            self._succeeded()
            with self._lock:
                self.write_seconds += time.perf_counter() - t0
                self.blocks_written += len(batch)
                self.bytes_written += sent
                self._in_flight = 0

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until the write queue is empty (tests, shutdown); False if it is not within ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._queue and not self._events and not self._in_flight:
                    return True
            time.sleep(0.01)
        return False

    @property
    def queued_blocks(self) -> int:
        return len(self._queue)

    # -- operators ---------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """The remote tier's figures (``RemoteStats``' fields)."""
        with self._lock:
            state = self.state
            if state == "backoff" and time.monotonic() >= self.retry_at:
                state = "retrying"
            return dict(
                url=redact(self.settings.url), state=state, lookups=self.lookups, hit_blocks=self.hit_blocks,
                miss_blocks=self.miss_blocks, skipped_lookups=self.skipped_lookups, timeouts=self.timeouts,
                failures=self.failures, corrupt_blocks=self.corrupt_blocks, forged_blocks=self.forged_blocks,
                blocks_written=self.blocks_written, bytes_written=self.bytes_written, bytes_read=self.bytes_read,
                write_dropped=self.write_dropped, write_queue_blocks=len(self._queue),
                fetch_seconds=self.fetch_seconds, write_seconds=self.write_seconds, last_error=self.last_error,
            )

    def close(self, flush_timeout: float = 2.0) -> None:
        """Write what is queued (for at most ``flush_timeout``), then stop the threads."""
        if self.state == "connected":
            self.flush(flush_timeout)
        with self._lock:
            self._closing = True
            self._queue.clear()
            self._queued_bytes = 0
            self._wake.notify_all()
        self._fetches.shutdown(wait=False, cancel_futures=True)
        self._writer.join(timeout=1.0)
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - shutting down
                pass


class RemoteLink:
    """One device pool's view of the store: its layout classes' namespaces, and the payloads a fetch
    brought for the call running now (``staged``; the transfer engine copies them into device blocks)."""

    def __init__(self, store: RemoteStore) -> None:
        self.store = store
        self.namespaces: dict[int, Namespace] = {}
        self.staged: dict = {}  # block hash -> payload

    def bind(self, class_id: int, geometry: dict) -> Namespace:
        """Class ``class_id`` has this geometry (its tenant included): its namespace in the store."""
        s = self.store.settings
        ns = Namespace(s.prefix, layout_string(geometry), geometry["block_bytes"], s.secret)
        self.namespaces[class_id] = ns
        return ns
