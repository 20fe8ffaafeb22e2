"""Noticing a client going away: for a stream while it is sent, and for a plain answer while it is computed.

While the work runs, a watcher waits for ``http.disconnect``; when it comes, the work is cancelled so the
upstream request (or the embedded engine's job) stops at once instead of running to completion for nobody.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from starlette.requests import ClientDisconnect
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """``work``'s result, computed in this task; if the client disconnects first, the work is cancelled and
    Starlette's ``ClientDisconnect`` raised, as a read of the body raises it. Call it once the request body has
    been read: ``receive`` then only ever answers ``http.disconnect``."""
    task = asyncio.current_task()
    assert task is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        while (await receive())["type"] != "http.disconnect":
            pass
        gone = True
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if gone and task.uncancel() == 0:
            raise ClientDisconnect() from None
        raise
    finally:
        watcher.cancel()


class EventStreamResponse:
    def __init__(self, frames: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> None:
        self.frames = frames
        self.headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                        (b"x-accel-buffering", b"no")]
        self.headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.create_task(self._pump(send))
        watch = asyncio.create_task(self._watch(receive))
        try:
            done, _ = await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not pump.done():
                pump.cancel()
            watch.cancel()
            await asyncio.gather(pump, watch, return_exceptions=True)
        if pump in done and not pump.cancelled() and pump.exception() is not None:
            exc = pump.exception()
            if not isinstance(exc, OSError):  # the client vanished while we were writing
                raise exc  # type: ignore[misc]

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.headers})
        try:
            async for frame in self.frames:
                await send({"type": "http.response.body", "body": frame, "more_body": True})
        finally:
            await self.frames.aclose()  # type: ignore[attr-defined]
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _watch(receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
