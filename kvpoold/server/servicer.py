"""The gRPC servicer: convert the request, call the service, convert back.

Every unary method is wrapped by ``_unary`` which counts the call and turns
any exception into a status code through ``errors.status_for`` (the one
mapping); admin calls are marked ``_admin``.  The conversions are in
``convert.py``, the work in ``Service`` and, for a session's sequence calls,
its ``PoolSession`` (``Service.session_pool``).  No state lives here.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from typing import Awaitable, TypeVar

import grpc

from kvpool.protocol import kvpool_pb2 as pb
from kvpool.protocol import kvpool_pb2_grpc as pb_grpc
from kvpoold.core import InvalidArgument

from . import convert
from .errors import status_for
from .service import Service

T = TypeVar("T")


class Malformed:
    """A request whose bytes did not decode as the method's message; answered INVALID_ARGUMENT.

    grpc answers a deserializer that raises with UNKNOWN; ours never raises
    (``add_to_server``), it hands this to the method instead (found by fuzzing).
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
            if inspect.isawaitable(result):  # an async method: it waited for bytes in flight (tiers)
                result = await result
            return result
        except Exception as exc:  # noqa: BLE001 - mapped to a status, never swallowed
            code, message = status_for(exc)
        # Abort outside the except block and without the request: the abort's exception would
        # otherwise chain the failed call's traceback, whose frames hold the request and the arrays
        # unpacked from it (tens of MB for a huge call) until a garbage collection.
        request = None
        await context.abort(code, message)

    return wrapper


async def _settled(result: T | Awaitable[T]) -> T:
    """A service call's result, awaited when it waits for bytes in flight (tiers)."""
    return await result if inspect.isawaitable(result) else result


async def _first_of(*events: asyncio.Event) -> asyncio.Event:
    """The first of ``events`` to be set (the earliest in the list if several are)."""
    for event in events:
        if event.is_set():
            return event
    waits = {asyncio.ensure_future(e.wait()): e for e in events}
    try:
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()
    return next(e for e in events if e.is_set())


def _admin(what: str):
    """An admin call: refused (PERMISSION_DENIED) unless it arrived on the admin socket."""

    def mark(fn):
        @functools.wraps(fn)
        def checked(self, request):
            self.service.need_admin(what, admin=self.admin)
            return fn(self, request)

        return checked

    return mark


class KVPoolServicer(pb_grpc.KVPoolServicer):
    def __init__(self, service: Service, shutdown: asyncio.Event, *, admin: bool = False) -> None:
        self.service = service
        self._shutdown = shutdown
        self.admin = admin  # True on the admin socket's server: admin calls allowed

    # -- sessions ----------------------------------------------------------------------
    @_unary
    def Attach(self, request):
        name, model_key, geometry, pid, bus_id = convert.attach_request(request)
        creds = self.service.tickets.redeem(request.attach_ticket, pid)  # who it is, as the kernel said
        r = self.service.attach(name, model_key, geometry, pid, bus_id, creds=creds)
        return convert.attach_reply(r, self.service.config, self.service.version)

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
            session.remap = remap = session.remap or asyncio.Event()
            while await _first_of(self._shutdown, remap) is remap:
                remap.clear()
                yield pb.Event(kind="remap", message="chunks left this session's class: sync the mapping")
            yield pb.Event(kind="shutdown", message="kvpoold is shutting down")
            await asyncio.Event().wait()  # stay open: the session lives until it detaches or the server stops
        finally:
            registry.stream_closed(session)

    @_unary
    def Heartbeat(self, request):
        """The lease: looking the session up renews it (``SessionRegistry.get``)."""
        self.service.session(request.session)
        return pb.HeartbeatReply(lease_seconds=self.service.config.lease_seconds)

    @_unary
    def Detach(self, request):
        return pb.DetachReply(blocks_released=self.service.session_pool(request.session).detach())

    # -- sequences ------------------------------------------------------------------------
    @_unary
    async def Create(self, request):
        calls = self.service.session_pool(request.session)
        tracked = await _settled(calls.create(convert.prompts(request), no_wait=request.no_wait,
                                              counted=not request.uncounted))
        return pb.CreateReply(sequences=convert.tracked_tables(tracked))

    @_unary
    def Step(self, request):
        r = self.service.session_pool(request.session).step(convert.step_request(request))
        return convert.step_reply(r)

    @_unary
    def Fork(self, request):
        tables = self.service.session_pool(request.session).fork(list(request.seq_ids))
        return pb.ForkReply(sequences=convert.page_tables(tables))

    @_unary
    async def Lookup(self, request):
        calls = self.service.session_pool(request.session)
        found = await _settled(calls.lookup(convert.tokens(request.prompt.tokens), request.prompt.extra_key,
                                               known=request.known_tokens))
        return convert.lookup_reply(found)

    @_unary
    def Sequences(self, request):
        tables = self.service.sequences_of(request.session, request.session_id, admin=self.admin)
        return pb.SequencesReply(sequences=convert.page_tables(tables))

    # -- tiers ---------------------------------------------------------------------------------
    @_unary
    async def SwapOut(self, request):
        calls = self.service.session_pool(request.session)
        return convert.swap_out_reply(await _settled(calls.swap_out(list(request.seq_ids))))

    @_unary
    async def SwapIn(self, request):
        calls = self.service.session_pool(request.session)
        tracked = await _settled(calls.swap_in(list(request.seq_ids), no_wait=request.no_wait))
        return pb.SwapInReply(sequences=convert.tracked_tables(tracked))

    @_unary
    async def Wait(self, request):
        calls = self.service.session_pool(request.session)
        tracked = await _settled(calls.wait(list(request.seq_ids)))
        return pb.WaitReply(sequences=convert.tracked_tables(tracked))

    # -- KV events ----------------------------------------------------------------------------
    async def Events(self, request, context):
        try:
            if isinstance(request, Malformed):
                raise InvalidArgument(request.error)
            self.service.need_admin("events", admin=self.admin)
        except Exception as exc:  # noqa: BLE001
            code, message = status_for(exc)
            await context.abort(code, message)
        bus = self.service.events
        sub = bus.subscribe() if request.follow else None  # before the recent ones: nothing falls between
        try:
            recent = list(bus.recent)[-request.recent:] if request.recent else []
            for ev in recent:
                yield convert.kv_event(ev)
            while sub is not None:
                for ev in await sub.next_batch():
                    yield convert.kv_event(ev)
        finally:
            if sub is not None:
                sub.close()

    # -- operators ---------------------------------------------------------------------------
    @_unary
    def Ping(self, request):
        return pb.PingReply()

    @_unary
    def Stats(self, request):
        return convert.stats_reply(self.service.stats())

    @_unary
    def Clients(self, request):
        return convert.clients_reply(self.service.clients())

    @_unary
    @_admin("resize")
    def Resize(self, request):
        return convert.resize_reply(self.service.resize(*convert.resize_request(request)))

    @_unary
    @_admin("evict")
    def Evict(self, request):
        return pb.EvictReply(evicted=self.service.evict(*convert.evict_request(request)))

    @_unary
    def Check(self, request):
        ok, detail = self.service.check()
        return pb.CheckReply(ok=ok, detail=detail)

    @_unary
    @_admin("drain")
    def Drain(self, request):
        return convert.drain_reply(self.service.drain(resume=request.resume))

    @_unary
    @_admin("reset")
    def Reset(self, request):
        return convert.reset_reply(self.service.reset())

    @_unary
    def GetConfig(self, request):
        return convert.config_reply(self.service.config)
