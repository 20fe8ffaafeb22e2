"""A run followed live: server-sent events telling the trajectory page that a step was stored (``step``) and that
the run is over (``end``). The store is what is watched, not this process's runs, so a run carried on by another
replica sharing the store is followed the same way."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from starlette.responses import Response, StreamingResponse

from gateway.console.app import Page
from gateway.errors import APIError
from replay import queries
from replay.filters import Filters
from replay.runs import UNFINISHED
from replay.store import TrajectoryStore

POLL_SECONDS = 0.5
HEARTBEAT_SECONDS = 15.0
MAX_SECONDS = 3600.0  # a page left open is asked to reconnect, so no stream lives for ever
# Each stream asks the store twice a second: past this many at once in one process, a page falls back to its
# last state (and the reload a person makes) rather than load the store without bound.
MAX_STREAMS = 200


async def follow(page: Page) -> Response:
    trajectory_id = page.request.path_params["trajectory_id"]
    store = page.gateway.store
    if not await store.list_trajectories(tenant=page.viewer.tenant, all_tenants=page.viewer.admin, limit=1,
                                         filters=Filters(ids=(trajectory_id,))):
        raise APIError(404, f"No trajectory '{trajectory_id}'.", code="not_found")

    console = page.console
    if console.live_streams >= MAX_STREAMS:
        raise APIError(503, "Too many pages are following runs live just now; reload this one in a while.",
                       code="too_many_streams")

    async def frames() -> AsyncIterator[bytes]:
        console.live_streams += 1
        try:
            async for frame in _frames(store, trajectory_id):
                yield frame
        finally:
            console.live_streams -= 1

    return StreamingResponse(frames(), media_type="text/event-stream",
                             headers={"cache-control": "no-store", "x-accel-buffering": "no"})


async def _frames(store: TrajectoryStore, trajectory_id: str) -> AsyncIterator[bytes]:
    yield b"retry: 2000\n\n"
    seen = await queries.progress(store.db, trajectory_id)
    started = quiet_since = time.monotonic()
    while seen is not None and seen[0] in UNFINISHED and time.monotonic() - started < MAX_SECONDS:
        await asyncio.sleep(POLL_SECONDS)
        now_seen = await queries.progress(store.db, trajectory_id)
        if now_seen != seen:
            seen = now_seen
            quiet_since = time.monotonic()
            yield b"event: step\ndata: {}\n\n"
        elif time.monotonic() - quiet_since > HEARTBEAT_SECONDS:
            quiet_since = time.monotonic()
            yield b": still running\n\n"
    if seen is None or seen[0] not in UNFINISHED:
        yield b"event: end\ndata: {}\n\n"
