"""The gRPC servicer: convert the request, call the service, convert back.

Every unary method is wrapped by ``_unary`` which counts the call and turns
any exception into a status code through ``errors.status_for`` (the one
mapping).  No state lives here.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import time
from dataclasses import asdict

import grpc
import numpy as np

from kvpool.protocol import kvpool_pb2 as pb
from kvpool.protocol import kvpool_pb2_grpc as pb_grpc
from kvpool.protocol.wire import I32, I64, U32, unpack
from kvpoold.config import LIVE_KEYS, config_as_dict
from kvpoold.core import InvalidArgument
from kvpoold.core.results import SequenceInfo

from .access import AdminOnly
from .errors import status_for
from .service import PoolService

log = logging.getLogger("kvpoold")


class Malformed:
    """A request whose bytes did not decode as the method's message; answered INVALID_ARGUMENT.

    grpc answers a deserializer that raises with UNKNOWN; ours never raises
    (``add_to_server``), it hands this to the method instead (issue 9, found by fuzzing).
    """

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


def _safe(deserialize):
    def parse(data: bytes):
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError and the like: the caller's fault
            return Malformed(f"malformed request: {exc}")

    return parse


def add_to_server(servicer, server) -> None:
    """The generated registration, with deserializers that turn undecodable bytes into ``Malformed``."""

    class _Capture:
        def add_generic_rpc_handlers(self, handlers):
            pass

        def add_registered_method_handlers(self, name, handlers):
            self.name, self.handlers = name, handlers

    cap = _Capture()
    pb_grpc.add_KVPoolServicer_to_server(servicer, cap)
    handlers = {k: h._replace(request_deserializer=_safe(h.request_deserializer)) for k, h in cap.handlers.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(cap.name, handlers),))
    server.add_registered_method_handlers(cap.name, handlers)


def _unary(fn):
    @functools.wraps(fn)
    async def wrapper(self, request, context):
        self.service.rpcs += 1
        try:
            if isinstance(request, Malformed):
                raise InvalidArgument(request.error)
            result = fn(self, request)
            if inspect.isawaitable(result):  # a call that waits for bytes in flight (tiers)
                result = await result
            return result
        except Exception as exc:  # noqa: BLE001 - mapped to a status, never swallowed
            code, message = status_for(exc)
            await context.abort(code, message)

    return wrapper


def _table(info: SequenceInfo) -> pb.SequenceTable:
    return pb.SequenceTable(
        seq_id=info.seq_id,
        block_table=np.asarray(info.block_table, I32).tobytes(),
        num_tokens=info.num_tokens,
        num_cached_tokens=info.num_cached_tokens,
        swapped=info.swapped,
    )


def _tracked_table(t) -> pb.SequenceTable:
    """A sequence with the tokens whose KV is there (or arriving) and the positions still arriving."""
    table = _table(t.info)
    table.num_cached_tokens = t.valid_tokens
    arriving = t.arriving
    if arriving:
        table.arriving = np.asarray(arriving, I32).tobytes()
    return table


def _tokens(data: bytes) -> np.ndarray:
    return unpack(data, U32, "tokens")


def _device_stats(pool, st) -> pb.DeviceStats:
    """One pool's figures (issue 4: one pool per GPU)."""
    return pb.DeviceStats(
        index=pool.index, device=pool.device, bus_id=pool.bus_id, pool_bytes=st.pool_bytes,
        free_bytes=st.free_chunks * st.chunk_bytes, sequences=st.sequences, clients=pool.sessions,
        classes=[pb.ClassStats(models=sorted(pool.models.get(c.class_id, ())), **asdict(c)) for c in st.classes],
        tiers=[pb.TierStats(**asdict(t)) for t in st.tiers],
    )


class KVPoolServicer(pb_grpc.KVPoolServicer):
    def __init__(self, service: PoolService, shutdown: asyncio.Event, admin: bool = False) -> None:
        self.service = service
        self._shutdown = shutdown
        self.admin = admin  # True on the admin socket's server: admin calls allowed

    def _need_admin(self, what: str) -> None:
        if not self.admin:
            raise AdminOnly(what, self.service.config.admin_socket_path())

    # -- sessions ----------------------------------------------------------------------
    @_unary
    def Attach(self, request):
        if not request.HasField("layout"):
            raise InvalidArgument("attach needs a layout")
        lay = request.layout
        layout = {
            "model_id": lay.model_id, "revision": lay.revision, "num_layers": lay.num_layers,
            "num_kv_heads": lay.num_kv_heads, "head_dim": lay.head_dim, "dtype": lay.dtype,
            "block_size": lay.block_size,
        }
        r = self.service.attach(request.name, layout, request.pid, request.device_bus_id)
        d = r.descriptor
        return pb.AttachReply(
            session=r.session.token,
            session_id=r.session.id,
            class_id=r.session.class_id,
            arena=pb.Arena(kind=d.kind, nbytes=d.nbytes, handle=d.handle, device=d.device,
                           device_id=d.device_id),
            num_blocks=r.num_blocks,
            block_bytes=r.block_bytes,
            max_reserve_blocks=self.service.config.max_reserve_blocks,
            grace_seconds=self.service.config.grace_seconds,
            daemon_version=self.service.version,
            backend=r.pool.backend.name,
            max_blocks_per_session=self.service.config.max_blocks_per_session,
            lease_seconds=self.service.config.lease_seconds,
        )

    async def Watch(self, request, context):
        try:
            if isinstance(request, Malformed):
                raise InvalidArgument(request.error)
            session = self.service.session(request.session)
        except Exception as exc:  # noqa: BLE001
            code, message = status_for(exc)
            await context.abort(code, message)
        registry = self.service.sessions
        registry.stream_opened(session)
        try:
            yield pb.Event(kind="attached", message=f"session {session.id}")
            await self._shutdown.wait()
            yield pb.Event(kind="shutdown", message="kvpoold is shutting down")
            await asyncio.Event().wait()  # stay open: the session lives until it detaches or the server stops
        finally:
            registry.stream_closed(session)

    @_unary
    def Heartbeat(self, request):
        """Lease (issue 9): looking the session up renews it (``SessionRegistry.get``)."""
        self.service.session(request.session)
        return pb.HeartbeatReply(lease_seconds=self.service.config.lease_seconds)

    @_unary
    def Detach(self, request):
        return pb.DetachReply(blocks_released=self.service.detach(self.service.session(request.session)))

    # -- sequences ------------------------------------------------------------------------
    @_unary
    def Create(self, request):
        session = self.service.session(request.session)
        prompts = [(_tokens(p.tokens), p.extra_key) for p in request.prompts]
        infos = self.service.create(session, prompts)
        return self._arrivals_reply(session, infos, request.no_wait, pb.CreateReply, swap_in=False)

    @_unary
    def Step(self, request):
        session = self.service.session(request.session)
        claims_given = bool(request.claim_counts) or bool(request.claims)
        r = self.service.step(
            session,
            unpack(request.seq_ids, I64, "seq_ids"),
            unpack(request.token_counts, I32, "token_counts").astype(np.int64) if request.token_counts else None,
            _tokens(request.tokens),
            unpack(request.claim_counts, I32, "claim_counts").astype(np.int64) if claims_given else None,
            unpack(request.claims, I32, "claims").astype(np.int64) if claims_given else None,
            list(request.free_seq_ids),
            request.reserve_target,
            unpack(request.reserve_return, I32, "reserve_return").tolist(),
        )
        e = r.extend
        pairs = [x for c in e.copies for x in (c.src, c.dst)]
        return pb.StepReply(
            delta_seq_ids=e.delta_seq_ids.astype(I64).tobytes(),
            delta_first=e.delta_first.astype(I32).tobytes(),
            delta_counts=e.delta_counts.astype(I32).tobytes(),
            delta_blocks=e.delta_blocks.astype(I32).tobytes(),
            copies=np.asarray(pairs, I32).tobytes(),
            reserve_added=np.asarray(r.reserve_added, I32).tobytes(),
            blocks_released=r.blocks_released,
        )

    @_unary
    def Fork(self, request):
        session = self.service.session(request.session)
        return pb.ForkReply(sequences=[_table(i) for i in self.service.fork(session, list(request.seq_ids))])

    @_unary
    def Lookup(self, request):
        session = self.service.session(request.session)
        r = self.service.lookup(session, _tokens(request.prompt.tokens), request.prompt.extra_key)
        return pb.LookupReply(num_cached_tokens=r.num_cached_tokens, device_tokens=r.device_tokens,
                              host_tokens=r.host_tokens, disk_tokens=r.disk_tokens)

    @_unary
    def Sequences(self, request):
        if request.session_id:
            mine = request.session and self.service.session(request.session).id == request.session_id
            if not mine:
                self._need_admin("another session's sequences")
            session = self.service.sessions.by_id(request.session_id)
        else:
            session = self.service.session(request.session)
        return pb.SequencesReply(sequences=[_table(i) for i in self.service.sequences(session)])

    # -- operators ---------------------------------------------------------------------------
    @_unary
    def Ping(self, request):
        return pb.PingReply()

    @_unary
    def Stats(self, request):
        svc = self.service
        devices = [_device_stats(pool, st) for pool, st in svc.stats()]  # one per pool (issue 4)
        return pb.StatsReply(
            backend=svc.backend_name,
            pool_bytes=sum(d.pool_bytes for d in devices),
            chunk_bytes=svc.config.chunk_bytes,
            free_bytes=sum(d.free_bytes for d in devices),
            sequences=sum(d.sequences for d in devices),
            clients=len(svc.sessions),
            uptime_seconds=time.time() - svc.started,
            classes=[c for d in devices for c in d.classes],
            tiers=[t for d in devices for t in d.tiers],
            version=svc.version,
            rpcs=svc.rpcs,
            draining=svc.draining,
            devices=devices,
        )

    @_unary
    def Clients(self, request):
        owners = self.service.owners()
        now = time.time()
        out = []
        for s in self.service.sessions:
            nseq, reserved = owners.get(s.id, (0, 0))
            out.append(pb.ClientInfo(
                session_id=s.id, name=s.name, pid=s.pid, model_id=s.model_key, class_id=s.class_id,
                sequences=nseq, reserved_blocks=reserved, connected=s.connected,
                attached_seconds=now - s.attached_at, device=self.service.pool_of(s).name,
            ))
        return pb.ClientsReply(clients=out)

    @_unary
    def Evict(self, request):
        self._need_admin("evict")
        cls = None if request.class_id < 0 else request.class_id
        return pb.EvictReply(evicted=self.service.evict(cls, request.max_blocks or None))

    @_unary
    def Check(self, request):
        ok, detail = self.service.check()
        return pb.CheckReply(ok=ok, detail=detail)

    # -- operations (issue 8) ---------------------------------------------------------------
    @_unary
    def Drain(self, request):
        self._need_admin("drain")
        svc = self.service
        if svc.draining == request.resume:
            svc.draining = not request.resume
            log.info("%s: %d sessions, %d sequences", "draining" if svc.draining else "drain ended",
                     len(svc.sessions), svc.live_sequences)
        return pb.DrainReply(draining=svc.draining, sessions=len(svc.sessions), sequences=svc.live_sequences)

    @_unary
    def Reset(self, request):
        self._need_admin("reset")
        sessions, released, evicted = self.service.reset()
        return pb.ResetReply(sessions_dropped=sessions, blocks_released=released, cached_evicted=evicted)

    @_unary
    def GetConfig(self, request):
        cfg = self.service.config
        return pb.GetConfigReply(config_json=json.dumps(config_as_dict(cfg)), live_keys=sorted(LIVE_KEYS),
                                 admin_socket=cfg.admin_socket_path())

    # -- tiers (issue 6) -------------------------------------------------------------------------
    def _once_arrived(self, tiers, inflight: list, token: bytes, then):
        """``then()`` now if nothing is in flight, else a coroutine that runs it once the bytes arrived.

        After the wait the session is looked up again: one dropped meanwhile (its lease ran
        out while it was frozen) gets UNAUTHENTICATED, never block tables it no longer holds.
        """
        if not inflight:
            return then()

        async def when_arrived():
            await tiers.wait(inflight)
            self.service.session(token)
            return then()

        return when_arrived()

    def _arrivals_reply(self, session, infos, no_wait: bool, reply, swap_in: bool):
        """Reply now (``no_wait``, or nothing in flight), or once the sequences' bytes arrived."""
        tiers = self.service.tiers_of(session)
        tracked = tiers.track(session.id, infos, swap_in=swap_in, recent=tiers.take_recent())
        inflight = [a for t in tracked for _, a in t.arrivals if not a.done]
        if no_wait or not inflight:
            if not no_wait:
                tiers.forget(session.id, [t.info.seq_id for t in tracked])
            return reply(sequences=[_tracked_table(t) for t in tracked])
        return self._once_arrived(tiers, inflight, session.token, lambda: reply(
            sequences=[_tracked_table(t) for t in tiers.settled(session.id, tracked)]))

    @_unary
    def SwapOut(self, request):
        session = self.service.session(request.session)
        ids = list(request.seq_ids)
        tiers = self.service.tiers_of(session)

        def swap():
            host, disk = self.service.swap_out(session, ids)
            tiers.forget(session.id, ids)
            return pb.SwapOutReply(blocks=host + disk, host_blocks=host, disk_blocks=disk)

        # a block is copied out only once its own bytes are complete
        return self._once_arrived(tiers, tiers.arrivals_of(session.id, ids), session.token, swap)

    @_unary
    def SwapIn(self, request):
        session = self.service.session(request.session)
        infos = self.service.swap_in(session, list(request.seq_ids))
        return self._arrivals_reply(session, infos, request.no_wait, pb.SwapInReply, swap_in=True)

    @_unary
    def Wait(self, request):
        session = self.service.session(request.session)
        ids = list(request.seq_ids)
        tiers = self.service.tiers_of(session)

        def reply():
            return pb.WaitReply(sequences=[_tracked_table(t) for t in tiers.finish(session.id, ids)])

        return self._once_arrived(tiers, tiers.arrivals_of(session.id, ids), session.token, reply)
