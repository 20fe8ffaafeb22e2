"""A request passed through to an upstream that speaks the client's own API (``kind = "anthropic"`` for the
Messages API, ``kind = "openai-responses"`` for the Responses API): its bytes go on as they came, the upstream's
answer comes back byte for byte, and the gateway reads along to record the call.

What each API adds is a ``Reader``: how its stream's events build the answer, which of them mark output, how an
answer is recorded, and what its error events look like. The rest is shared: a whole answer is sent only once
its record is committed; a stream's events go out as they come, but those that end it wait for the commit; an
upstream's refusal goes back as it came, recorded as an error; a client that leaves mid-way has what it was sent
recorded in the background.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import orjson
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from gateway.api.exchange import Exchange, account, as_api_error, record_disconnect, save
from gateway.backends.base import BackendError
from gateway.backends.passthrough import EventStream, PassThroughBackend
from gateway.context import RequestContext
from gateway.errors import APIError
from gateway.protocol.sse import json_object, parse_events
from gateway.streaming import EventStreamResponse, unless_disconnected
from replay.records import CallRecord, Statement

DISCONNECTED = "the client closed the connection mid-stream"


class Reader(Protocol):
    """One API's side of a pass-through: fed the stream's events as they come, it gathers the answer."""

    held: frozenset[str]  # the event types that end a stream: sent only once the call is recorded

    def add(self, event: dict[str, Any]) -> None: ...

    def is_output(self, kind: str | None) -> bool: ...

    @property
    def answer(self) -> dict[str, Any] | None: ...

    def failure(self) -> str | None:
        """What the stream's own error event said, if it sent one."""

    def record(self, exchange: Exchange, answer: dict[str, Any] | None, *, status: str,
               error: str | None) -> CallRecord:
        """The record of the call, with the answer (whole or as far as it came; None when none began)."""

    def statements(self, answer: dict[str, Any]) -> list[Statement]:
        """What the store keeps with a finished answer's record besides it."""

    def error_event(self, status: int, message: str) -> bytes:
        """An error event in the API's own shape, to end a stream that cannot go on."""


def upstream_failure(status: int, body: bytes) -> str:
    """An upstream's refusal, for the record: its error's type and message, as both APIs shape them."""
    try:
        error = orjson.loads(body).get("error") or {}
        return f"upstream returned {status}: {error.get('type') or error.get('code')}: {error.get('message')}"
    except (orjson.JSONDecodeError, AttributeError):
        return f"upstream returned {status}: {body[:200].decode('utf-8', 'replace')}"


async def pass_through(ctx: RequestContext, exchange: Exchange, backend: PassThroughBackend, path: str, raw: bytes,
                       reader: Reader, *, stream: bool, headers: dict[str, str] | None = None) -> Response:
    """Send ``raw`` to ``path`` on the upstream and answer the client as the upstream answers, once recorded."""
    request = ctx.request
    query = request.url.query
    headers = {**exchange.headers, **(headers or {})}
    if not stream:
        try:
            reply = await unless_disconnected(request.receive, backend.send(path, raw, request.headers, query=query))
        except BackendError as exc:
            await save(ctx, exchange, [exchange.record(status="error", error=exc.message)])
            raise as_api_error(exc, exchange) from None
        except ClientDisconnect:
            record_disconnect(ctx, exchange, [exchange.record(
                status="client_disconnected", error="the client closed the connection before the answer")])
            raise
        answer = json_object(reply.body) if reply.status == 200 else None
        if answer is not None:
            record, statements = reader.record(exchange, answer, status="ok", error=None), reader.statements(answer)
        else:
            error = (upstream_failure(reply.status, reply.body) if reply.status != 200
                     else "upstream answered 200 with a body that is not a JSON object")
            record, statements = exchange.record(status="error", error=error), []
        await save(ctx, exchange, [record], statements)
        account(ctx, exchange, [record])
        return Response(reply.body, status_code=reply.status, headers={**reply.headers, **headers})
    try:
        upstream = await backend.open_stream(path, raw, request.headers, query=query)
    except BackendError as exc:
        await save(ctx, exchange, [exchange.record(status="error", error=exc.message)])
        raise as_api_error(exc, exchange) from None
    if upstream.status != 200:
        body = b"".join([part async for part in upstream])
        await save(ctx, exchange, [exchange.record(status="error", error=upstream_failure(upstream.status, body))])
        return Response(body, status_code=upstream.status, headers={**upstream.headers, **headers})
    return EventStreamResponse(_relay(ctx, exchange, upstream, reader), headers={**upstream.headers, **headers})


async def _relay(ctx: RequestContext, exchange: Exchange, upstream: EventStream,
                 reader: Reader) -> AsyncIterator[bytes]:
    """The upstream's events, byte for byte, as they come; those that end the stream only once it is recorded."""
    started = time.perf_counter()
    held: list[bytes] = []
    buffer = b""
    failure: str | None = None
    finished = False
    ttft: float | None = None
    try:
        try:
            async for data in upstream:
                events, buffer = parse_events(buffer + data)
                for raw, event in events:
                    kind = event.get("type") if event is not None else None
                    if event is not None:
                        reader.add(event)
                    if ttft is None and reader.is_output(kind):
                        ttft = (time.perf_counter() - started) * 1000
                    if held or kind in reader.held:
                        held.append(raw)
                    else:
                        yield raw
        except BackendError as exc:
            failure = exc.message
            held.append(reader.error_event(exc.status_code, exc.message))
        if buffer:
            held.append(buffer)
        finished = True
    finally:
        if not finished:
            await upstream.aclose()
            record_disconnect(ctx, exchange, [reader.record(exchange, reader.answer, status="client_disconnected",
                                                            error=DISCONNECTED)])
    failure = failure or reader.failure()
    answer = reader.answer
    record = reader.record(exchange, answer, status="error" if failure else "ok", error=failure)
    record.ttft_ms = ttft
    record.stream = True
    try:
        await save(ctx, exchange, [record], reader.statements(answer) if answer is not None and not failure else [])
    except APIError as exc:  # not recorded: the finishing events are not sent
        yield reader.error_event(exc.status_code, exc.message)
        return
    account(ctx, exchange, [record])
    yield b"".join(held)
