"""``POST /v1/completions``: OpenAI's legacy text completions, plain or streamed, passed through to a backend that
serves them (``[[backends]] apis``): an OpenAI-compatible upstream's ``/completions``, or the embedded model
completing the raw prompt (no chat template). Recorded as ``gateway/api/native.py`` records calls."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.responses import Response

from gateway.api.common import json_response, read_json_body
from gateway.api.exchange import Exchange, account, answered_by, as_api_error, record_disconnect, save
from gateway.api.native import answer, native_record, open_native
from gateway.backends.base import BackendError, ChunkStream, CompletionsHost
from gateway.context import RequestContext
from gateway.errors import APIError, error_body
from gateway.protocol.completions import CompletionAccumulator, holds, validate_completion_request, without_usage
from gateway.protocol.sse import DONE, encode_event
from gateway.streaming import EventStreamResponse
from replay.model import COMPLETIONS


async def create_completion(ctx: RequestContext) -> Response:
    request, gateway = ctx.request, ctx.gateway
    principal = await gateway.auth.authenticate(request.headers)
    body = await read_json_body(request, gateway.settings.server.max_body_bytes)
    parsed = validate_completion_request(body)
    exchange = await open_native(ctx, principal, body, COMPLETIONS, stream=parsed.stream)
    backend: CompletionsHost = exchange.backend  # type: ignore[assignment]  # open_native checked its apis
    if not parsed.stream:
        result = await answer(ctx, exchange, COMPLETIONS, backend.completions(exchange.chat_request()))
        return json_response(result.response, headers=exchange.headers)
    try:
        stream = await backend.stream_completions(exchange.chat_request())
    except BackendError as exc:
        answered_by(ctx, exchange, exc.backend)
        await save(ctx, exchange, [native_record(exchange, COMPLETIONS, status="error", error=exc.message)])
        raise as_api_error(exc, exchange) from None
    answered_by(ctx, exchange, getattr(stream, "backend", None))
    include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
    return EventStreamResponse(_frames(ctx, exchange, stream, include_usage), headers=exchange.headers)


async def _frames(ctx: RequestContext, exchange: Exchange, stream: ChunkStream,
                  include_usage: bool) -> AsyncIterator[bytes]:
    """Chunks as they come; those that finish a choice or carry usage, and ``[DONE]``, only once the call is
    recorded."""
    acc = CompletionAccumulator()
    held: list[bytes] = []
    failure: BackendError | None = None
    ttft_ms: float | None = None
    finished = False
    try:
        try:
            async for chunk in stream:
                acc.add(chunk)
                if ttft_ms is None and any(c.get("text") for c in chunk.get("choices") or ()):
                    ttft_ms = (time.perf_counter() - exchange.started) * 1000
                    ctx.gateway.metrics.ttft.labels(exchange.parsed.model).observe(ttft_ms / 1000)
                out = chunk if include_usage else without_usage(chunk)
                if out is None:
                    continue
                if holds(out):
                    held.append(encode_event(out))
                else:
                    yield encode_event(out)
        except BackendError as exc:
            failure = exc
        finished = True
    finally:
        if not finished:  # the client went away mid-stream: stop the backend, keep what was streamed
            await stream.aclose()
            record_disconnect(ctx, exchange, [native_record(
                exchange, COMPLETIONS, status="client_disconnected", answer=acc.completion() if acc.chunks else None,
                error="the client closed the connection mid-stream", extras=stream.extras, ttft_ms=ttft_ms)])
    record = native_record(exchange, COMPLETIONS, status="error" if failure else "ok",
                           answer=acc.completion() if acc.chunks else None,
                           error=failure.message if failure else None, extras=stream.extras, ttft_ms=ttft_ms)
    if failure is not None:
        ctx.gateway.metrics.errors.labels("backend_error").inc()
    try:
        await save(ctx, exchange, [record])
    except APIError as exc:  # not recorded: the finishing chunks are not sent
        yield encode_event(exc.body())
        return
    account(ctx, exchange, [record])
    held.append(encode_event(error_body(failure.message, "backend_error", code=failure.code)) if failure else DONE)
    yield b"".join(held)
