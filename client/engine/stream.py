"""A request's outputs as they are made: an iterator, an async iterator or a callback."""

from __future__ import annotations

import asyncio
import queue
from typing import Callable

_END_OF_STREAM = object()


class RequestStream:
    """Carries one request's ``RequestOutput`` updates from the engine thread to its caller.

    Made with ``loop`` (``Engine.add_request_async``) it is an async
    iterator; otherwise a blocking iterator.  ``callback`` (optional) is
    called on the engine thread with each update as well: keep it short.
    """

    def __init__(self, request_id: str, *, loop: asyncio.AbstractEventLoop | None = None,
                 callback: Callable | None = None) -> None:
        self.request_id = request_id
        self._loop = loop
        self._callback = callback
        self._queue: queue.SimpleQueue | asyncio.Queue = asyncio.Queue() if loop else queue.SimpleQueue()
        self.last = None  # the latest update (the final one once finished)
        self._drained = False  # the end was read: iterating again returns at once

    def put(self, output) -> None:
        """Hand an update over (engine thread)."""
        self.last = output
        if self._callback is not None:
            self._callback(output)
        self._deliver(output)
        if output.finished:
            self._deliver(_END_OF_STREAM)

    def _deliver(self, item) -> None:
        if self._loop is None:
            self._queue.put(item)
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def __iter__(self):
        if self._loop is not None:
            raise TypeError("this stream was made for asyncio: use 'async for'")
        while not self._drained:
            item = self._queue.get()
            if item is _END_OF_STREAM:
                self._drained = True
                return
            yield item

    async def __aiter__(self):
        if self._loop is None:
            raise TypeError("this stream is a blocking iterator: use 'for'")
        while not self._drained:
            item = await self._queue.get()
            if item is _END_OF_STREAM:
                self._drained = True
                return
            yield item

    def result(self):
        """Block until the request finishes; its final ``RequestOutput``."""
        for _ in self:
            pass
        return self.last

    async def aresult(self):
        """Await the request's end; its final ``RequestOutput``."""
        async for _ in self:
            pass
        return self.last
