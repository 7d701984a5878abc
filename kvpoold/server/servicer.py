"""The gRPC servicer: convert the request, call the service, convert back.

Every unary method is wrapped by ``_unary`` which counts the call and turns
any exception into a status code through ``errors.status_for`` (the one
mapping).  No state lives here.
"""

from __future__ import annotations

import asyncio
import functools
import time
from dataclasses import asdict

import numpy as np

from kvpool._generated import kvpool_pb2 as pb
from kvpool._generated import kvpool_pb2_grpc as pb_grpc
from kvpool._wire import I32, I64, U32, unpack
from kvpoold.core import InvalidArgument
from kvpoold.core.results import SequenceInfo

from .errors import status_for
from .service import PoolService


def _unary(fn):
    @functools.wraps(fn)
    async def wrapper(self, request, context):
        self.service.rpcs += 1
        try:
            return fn(self, request)
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
    )


def _tokens(data: bytes) -> np.ndarray:
    return unpack(data, U32, "tokens")


class KVPoolServicer(pb_grpc.KVPoolServicer):
    def __init__(self, service: PoolService, shutdown: asyncio.Event) -> None:
        self.service = service
        self._shutdown = shutdown

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
        r = self.service.attach(request.name, layout, request.pid)
        d = r.descriptor
        return pb.AttachReply(
            session=r.session.token,
            session_id=r.session.id,
            class_id=r.session.class_id,
            arena=pb.Arena(kind=d.kind, nbytes=d.nbytes, handle=d.handle, device=d.device,
                           device_id=d.device_id, fence=d.fence),
            num_blocks=r.num_blocks,
            block_bytes=r.block_bytes,
            max_reserve_blocks=self.service.config.max_reserve_blocks,
            grace_seconds=self.service.config.grace_seconds,
            daemon_version=self.service.version,
            backend=self.service.backend.name,
        )

    async def Watch(self, request, context):
        try:
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
        finally:
            registry.stream_closed(session)

    @_unary
    def Detach(self, request):
        return pb.DetachReply(blocks_released=self.service.detach(self.service.session(request.session)))

    # -- sequences ------------------------------------------------------------------------
    @_unary
    def Create(self, request):
        session = self.service.session(request.session)
        prompts = [(_tokens(p.tokens), p.extra_key) for p in request.prompts]
        infos = self.service.create(session, prompts)
        return pb.CreateReply(sequences=[_table(i) for i in infos])

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
        st = self.service.stats()
        svc = self.service
        return pb.StatsReply(
            backend=svc.backend.name,
            pool_bytes=st.pool_bytes,
            chunk_bytes=st.chunk_bytes,
            free_bytes=st.free_chunks * st.chunk_bytes,
            sequences=st.sequences,
            clients=len(svc.sessions),
            uptime_seconds=time.time() - svc.started,
            classes=[
                pb.ClassStats(models=sorted(svc.models.get(c.class_id, ())), **asdict(c)) for c in st.classes
            ],
            tiers=[pb.TierStats(tier=t.tier, capacity_bytes=t.capacity_bytes, used_bytes=t.used_bytes,
                                blocks=t.blocks) for t in st.tiers],
            version=svc.version,
            rpcs=svc.rpcs,
        )

    @_unary
    def Clients(self, request):
        owners = self.service.manager.owners()
        now = time.time()
        out = []
        for s in self.service.sessions:
            nseq, reserved = owners.get(s.id, (0, 0))
            out.append(pb.ClientInfo(
                session_id=s.id, name=s.name, pid=s.pid, model_id=s.model_key, class_id=s.class_id,
                sequences=nseq, reserved_blocks=reserved, connected=s.connected,
                attached_seconds=now - s.attached_at,
            ))
        return pb.ClientsReply(clients=out)

    @_unary
    def Evict(self, request):
        cls = None if request.class_id < 0 else request.class_id
        return pb.EvictReply(evicted=self.service.evict(cls, request.max_blocks or None))

    @_unary
    def Check(self, request):
        ok, detail = self.service.check()
        return pb.CheckReply(ok=ok, detail=detail)

