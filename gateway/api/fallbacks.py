"""Fallback models: ``[routing.fallbacks]`` names the models tried in turn when a model's call fails before anything
reached the client.

A call falls back on a 5xx (an unreachable upstream is a 503, a timeout a 504) and on a prompt longer than the
model's context, which each server words its own way: OpenAI's code ``context_length_exceeded``, vLLM's "This
model's maximum context length is N tokens. However, you requested M tokens" and "... is longer than the maximum
model length of N", SGLang's "The input (N tokens) is longer than the model's context length (M tokens)". Only the
model the request was routed to has its fallbacks followed: a fallback's own are not, so a chain cannot loop.
Each fallback goes through routing (aliases, adapters, canaries) as a requested name would.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

from gateway.backends.base import Backend, BackendError, ChunkStream, StreamView
from gateway.context import RequestContext
from gateway.errors import APIError
from gateway.routing import Caller, Target

if TYPE_CHECKING:
    from gateway.api.exchange import Exchange

log = structlog.get_logger()

T = TypeVar("T")

CONTEXT_OVERFLOW = re.compile(r"maximum context length|longer than the maximum model length|longer than the model's "
                              r"context length|context length exceeded|context_length_exceeded", re.IGNORECASE)


def falls_back(exc: BackendError) -> bool:
    """Whether another model may answer what this one could not."""
    return (exc.status_code >= 500 or exc.code == "context_length_exceeded"
            or CONTEXT_OVERFLOW.search(exc.message) is not None)


async def with_fallbacks(ctx: RequestContext, exchange: Exchange, call: Callable[[], Awaitable[T]]) -> T:
    """``call()`` on the exchange's model, then on each fallback while the last attempt ``falls_back``. Each failed
    attempt is kept in ``exchange.failed`` (recorded with what follows), and the exchange is moved to the model that
    answered, its record's parameters marked ``fallback_from``. Once none is left, the last failure is raised."""
    requested = exchange.parsed.model
    remaining = list(ctx.gateway.settings.routing.fallbacks.get(requested, []))
    while True:
        try:
            return await call()
        except BackendError as exc:
            target = _next_target(ctx, requested, remaining) if falls_back(exc) else None
            if target is None:
                raise
            exchange.member = exc.backend
            exchange.failed.append(exchange.record(status="error", error=exc.message))
            log.warning("fallback", model=requested, fallback=target.model, status=exc.status_code, error=exc.message)
            exchange.target, exchange.member = target, None
            exchange.labels = {**exchange.labels, "fallback_from": requested}
            line = ctx.line
            line.fallback_from, line.model, line.backend = requested, target.model, target.backend.name


def _next_target(ctx: RequestContext, requested: str, remaining: list[str]) -> Target[Backend] | None:
    """The next fallback that routes; one that does not (never served, or an adapter retired) is passed over."""
    router = ctx.gateway.router
    while remaining:
        name = remaining.pop(0)
        try:
            return router.route(router.name_for(name, Caller()))
        except APIError as missing:
            log.warning("fallback.unroutable", model=requested, fallback=name, error=missing.message)
    return None


class Renamed(StreamView):
    """A fallback's chunk stream, each chunk naming the model that answered."""

    def __init__(self, stream: ChunkStream, model: str) -> None:
        super().__init__(stream)
        self._model = model

    async def _chunks(self) -> AsyncIterator[dict[str, Any]]:
        async for chunk in self._stream:
            yield {**chunk, "model": self._model}
