"""The request body size limit, an ASGI middleware in front of the app."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from .protocol import error_body


class BodyLimit:
    """ASGI middleware: reads each request's body, at most ``max_bytes`` of it, before the app runs.

    A body whose Content-Length is over the limit is refused without reading it; a chunked one is refused
    as soon as what arrived passes the limit, so no body larger than the limit is ever held in memory.
    The app then gets the body in one message and, after it, the server's own ``receive`` (which reports
    the client's disconnect).
    """

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if declared_length(scope) > self.max_bytes:
            return await self.too_large()(scope, receive, send)
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                return await self.too_large()(scope, receive, send)
            more = message.get("more_body", False)
        await self.app(scope, replay(bytes(body), receive), send)

    def too_large(self) -> JSONResponse:
        message = f"the request body is larger than this server's limit of {self.max_bytes} bytes"
        return JSONResponse(error_body(message, code="request_too_large"), status_code=413)


def declared_length(scope) -> int:
    """The request's Content-Length, 0 when it has none (chunked) or none that parses (the server checks it)."""
    try:
        return int(Headers(scope=scope).get("content-length", 0))
    except ValueError:
        return 0


def replay(body: bytes, receive):
    """A ``receive`` that gives ``body`` whole first, then hands over to ``receive``."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive_replayed():
        return pending.pop() if pending else await receive()

    return receive_replayed
