"""Noticing a client going away: for a plain answer while it is computed, and for a stream while it is sent
(Starlette's ``StreamingResponse`` watches for that itself).

While the work runs, a watcher waits for ``http.disconnect``; when it comes, the work is cancelled so the
upstream request (or the embedded engine's job) stops at once instead of running to completion for nobody.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import Receive, Send

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


class EventStreamResponse(StreamingResponse):
    """A server-sent-events stream. Starlette watches for the client going away and cancels the stream then; the
    frames' generator is always closed here, at once, so what it does on the way out (recording a stream the client
    left) never waits for garbage collection."""

    def __init__(self, frames: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> None:
        super().__init__(frames, media_type="text/event-stream",
                         headers={"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})})

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
