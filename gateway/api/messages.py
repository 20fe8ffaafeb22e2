"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: the Anthropic Messages API, which Claude Code
speaks.

Two ways to serve it. A model on a chat backend (the embedded model, SGLang, vLLM, any OpenAI-compatible upstream)
gets the request translated to chat completions (``gateway/protocol/anthropic/``, pure) and run through the same
exchange as ``/v1/chat/completions``; what a chat backend cannot take is dropped and named in the call's record. A
model on an Anthropic-native upstream (``kind = "anthropic"``) gets the request's bytes as they came, and the
client gets the upstream's bytes as they come (thinking signatures and unknown blocks intact), while the gateway
reads along to record the call. Either way the call is recorded in the chat format every reader of the store
knows, and errors leave in Anthropic's own shape.

Claude Code's side requests (titles, topic checks, summaries, quota probes) are recorded apart, each in a
trajectory of its own labelled with its purpose; the session's trajectory holds only the session's own turns,
stitched by the session id Claude Code sends.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from gateway.agent.service import AGENT_PREFIX
from gateway.api.common import json_response, parse_json, read_body
from gateway.api.exchange import (
    Exchange,
    Relay,
    account,
    as_api_error,
    choose_model,
    complete,
    open_exchange,
    open_stream,
    record_disconnect,
    save,
)
from gateway.auth import Principal
from gateway.backends.anthropic import AnthropicBackend, EventStream
from gateway.backends.base import BackendError
from gateway.context import RequestContext
from gateway.errors import APIError
from gateway.protocol.anthropic import (
    MessageAccumulator,
    MessageStream,
    chat_to_message,
    error_body,
    error_type_for,
    estimate_tokens,
    message_to_chat,
    messages_to_chat,
    parse_sse,
    session_id,
    side_request_kind,
    validate_messages_request,
)
from gateway.protocol.chat import ChatCompletionRequest, validate_chat_request
from gateway.protocol.sse import encode_named_event, encode_named_events
from gateway.streaming import EventStreamResponse, unless_disconnected
from replay.records import CallRecord, new_id

API = "anthropic"
MESSAGES_PATH = "/v1/messages"
COUNT_PATH = "/v1/messages/count_tokens"
ESTIMATE_HEADER = "x-harness-token-count"


def is_messages_path(path: str) -> bool:
    """Whether errors on ``path`` leave in Anthropic's shape."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


@dataclass
class _Request:
    """A Messages request read, checked and routed: what both ways of serving it start from."""

    raw: bytes
    body: dict[str, Any]
    principal: Principal
    model: str
    parsed: ChatCompletionRequest
    chat_body: dict[str, Any]
    dropped: list[str]


async def _read(ctx: RequestContext, *, counting: bool = False) -> _Request:
    request, gateway = ctx.request, ctx.gateway
    principal = await gateway.auth.authenticate(request.headers)
    raw = await read_body(request, gateway.settings.server.max_body_bytes)
    body = parse_json(raw)
    validate_messages_request(body, counting=counting)
    translated = messages_to_chat(body)
    chat_body = translated.body
    chat_body.pop("max_tokens", None) if counting else None
    # Routed before the chat checks: a request passed through is never refused by chat completions' rules.
    parsed = ChatCompletionRequest.model_construct(model=chat_body.get("model") or "", messages=chat_body["messages"],
                                                   stream=bool(body.get("stream")), n=1)
    model = choose_model(ctx, principal, parsed, chat_body)
    if model.startswith(AGENT_PREFIX):
        raise APIError(400, f"'{model}' is an agent profile; agent profiles are served on /v1/chat/completions "
                            "and /v1/responses, not on the Messages API.", param="model")
    return _Request(raw, body, principal, model, parsed, chat_body, translated.dropped)


async def create_message(ctx: RequestContext) -> Response:
    request, gateway = ctx.request, ctx.gateway
    asked = await _read(ctx)
    side = side_request_kind(asked.body)
    sid = session_id(asked.body, request.headers)
    labels: dict[str, Any] = {"api": API}
    if side:
        labels["purpose"] = side
        ctx.line.side_request = side
    backend = gateway.router.backend_for(asked.model)
    passthrough = isinstance(backend, AnthropicBackend)
    if not passthrough:
        stream = bool(asked.body.get("stream"))
        asked.chat_body["stream"] = stream
        if stream:
            asked.chat_body["stream_options"] = {"include_usage": True}
        asked.parsed = validate_chat_request(asked.chat_body)
        asked.parsed.model = asked.model
        if asked.dropped:
            labels["dropped"] = ctx.line.dropped = asked.dropped
    # Claude Code's session id: a session header, when sent, still comes first.
    exchange = await open_exchange(ctx, asked.principal, asked.chat_body, asked.parsed,
                                   session_body={}, session=f"claude:{sid}" if sid else None, side=bool(side))
    exchange.labels = labels
    exchange.max_tokens_ceiling = True
    if isinstance(exchange.backend, AnthropicBackend):
        return await _pass_through(ctx, exchange, asked, exchange.backend)
    return await _translated(ctx, exchange, asked)


# -- translated to a chat backend -------------------------------------------------------------------------------

async def _translated(ctx: RequestContext, exchange: Exchange, asked: _Request) -> Response:
    message_id = f"msg_{new_id().lower()}"
    model = str(asked.body["model"])
    stops = asked.body.get("stop_sequences")
    exchange.native = lambda completion: _native(asked.body, chat_to_message(
        completion, message_id=message_id, model=model, stop_sequences=stops) if completion else None)
    if not asked.parsed.stream:
        result = await complete(ctx, exchange)
        message = chat_to_message(result.response, message_id=message_id, model=model, stop_sequences=stops)
        return json_response(message, headers=exchange.headers)
    upstream = await open_stream(ctx, exchange)
    relay = Relay(ctx, exchange, upstream, include_usage=True)
    events = MessageStream(message_id=message_id, model=model, stop_sequences=stops)
    return EventStreamResponse(_stream(relay, events), headers=exchange.headers)


async def _stream(relay: Relay, events: MessageStream) -> AsyncIterator[bytes]:
    """Events as the chunks come; ``message_delta`` and ``message_stop`` only after the commit."""
    async for frames in relay.translated(events):
        yield frames
    tail = relay.held_events(events)
    if relay.status == "error":
        status = relay.error_status or 502
        tail += events.error(error_type_for(status), relay.error or "the backend failed")
    else:
        tail += events.finish()
    try:
        await relay.commit()
    except APIError as exc:  # not recorded: the finishing events are not sent
        yield encode_named_events(events.error(error_type_for(exc.status_code), exc.message))
        return
    yield encode_named_events(tail)


# -- passed through to an Anthropic-native upstream ----------------------------------------------------------------

def _upstream_failure(status: int, body: bytes) -> str:
    try:
        error = orjson.loads(body).get("error") or {}
        return f"upstream returned {status}: {error.get('type')}: {error.get('message')}"
    except (orjson.JSONDecodeError, AttributeError):
        return f"upstream returned {status}: {body[:200].decode('utf-8', 'replace')}"


async def _pass_through(ctx: RequestContext, exchange: Exchange, asked: _Request,
                        backend: AnthropicBackend) -> Response:
    request = ctx.request
    query = request.url.query
    exchange.native = lambda _: _native(asked.body, None)  # an answer passed through is kept as it came, below
    if not asked.body.get("stream"):
        try:
            reply = await unless_disconnected(request.receive, backend.send(MESSAGES_PATH, asked.raw, request.headers,
                                                                             query=query))
        except BackendError as exc:
            await save(ctx, exchange, [exchange.record(status="error", error=exc.message)])
            raise as_api_error(exc, exchange) from None
        except ClientDisconnect:
            record_disconnect(ctx, exchange, [exchange.record(
                status="client_disconnected", error="the client closed the connection before the answer")])
            raise
        record = _recorded(exchange, reply.status, reply.body)
        await save(ctx, exchange, [record])
        account(ctx, exchange, [record])
        return Response(reply.body, status_code=reply.status, headers={**reply.headers, **exchange.headers})
    try:
        upstream = await backend.open_stream(MESSAGES_PATH, asked.raw, request.headers, query=query)
    except BackendError as exc:
        await save(ctx, exchange, [exchange.record(status="error", error=exc.message)])
        raise as_api_error(exc, exchange) from None
    if upstream.status != 200:
        body = b"".join([part async for part in upstream])
        await save(ctx, exchange, [exchange.record(status="error", error=_upstream_failure(upstream.status, body))])
        return Response(body, status_code=upstream.status, headers={**upstream.headers, **exchange.headers})
    return EventStreamResponse(_relay_events(ctx, exchange, upstream),
                               headers={**upstream.headers, **exchange.headers})


def _recorded(exchange: Exchange, status: int, body: bytes) -> CallRecord:
    """The record of a whole upstream answer: the Message as a chat completion, or the upstream's error."""
    if status == 200:
        try:
            message = orjson.loads(body)
        except orjson.JSONDecodeError:
            return exchange.record(status="error", error="upstream answered 200 with a body that is not JSON")
        return _record_message(exchange, message)
    return exchange.record(status="error", error=_upstream_failure(status, body))


def _record_message(exchange: Exchange, message: dict[str, Any], *, status: str = "ok",
                    error: str | None = None) -> CallRecord:
    """The record of an upstream's Message: as a chat completion, and as it came."""
    native = {**exchange.native(None), "response": message} if exchange.native else None
    return exchange.record(status=status, response=message_to_chat(message), error=error, native=native)


def _native(request: dict[str, Any], message: dict[str, Any] | None) -> dict[str, Any]:
    return {"api": API, "request": request, "response": message}


async def _relay_events(ctx: RequestContext, exchange: Exchange, upstream: EventStream) -> AsyncIterator[bytes]:
    """The upstream's events, byte for byte, as they come; ``message_delta`` and what follows it only once the call
    is recorded."""
    started = time.perf_counter()
    acc = MessageAccumulator()
    held: list[bytes] = []
    buffer = b""
    failure: str | None = None
    finished = False
    ttft: float | None = None
    try:
        try:
            async for data in upstream:
                events, buffer = parse_sse(buffer + data)
                for raw, event in events:
                    kind = event.get("type") if isinstance(event, dict) else None
                    if event is not None:
                        acc.add(event)
                    if ttft is None and kind == "content_block_delta":
                        ttft = (time.perf_counter() - started) * 1000
                    if held or kind in ("message_delta", "message_stop", "error"):
                        held.append(raw)
                    else:
                        yield raw
        except BackendError as exc:
            failure = exc.message
            held.append(encode_named_event("error", error_body(exc.status_code, exc.message)))
        if buffer:
            held.append(buffer)
        finished = True
    finally:
        if not finished:
            await upstream.aclose()
            message = acc.message
            record_disconnect(ctx, exchange, [
                _record_message(exchange, message, status="client_disconnected",
                                error="the client closed the connection mid-stream") if message else
                exchange.record(status="client_disconnected", error="the client closed the connection mid-stream")])
    message = acc.message
    if acc.error is not None:
        failure = failure or f"upstream stream error: {acc.error.get('type')}: {acc.error.get('message')}"
    if failure is None and message is not None:
        record = _record_message(exchange, message)
    else:
        record = (_record_message(exchange, message, status="error", error=failure) if message is not None else
                  exchange.record(status="error", error=failure or "upstream stream ended before message_start"))
    record.ttft_ms = ttft
    record.stream = True
    try:
        await save(ctx, exchange, [record])
    except APIError as exc:  # not recorded: the finishing events are not sent
        yield encode_named_event("error", error_body(exc.status_code, exc.message))
        return
    account(ctx, exchange, [record])
    yield b"".join(held)


# -- counting ----------------------------------------------------------------------------------------------------

async def count_tokens(ctx: RequestContext) -> Response:
    """Exact where the backend has a tokenizer (or is an Anthropic upstream, which counts); otherwise an estimate,
    marked as one: ``"estimated": true`` and an ``x-harness-token-count: estimate`` header."""
    request, gateway = ctx.request, ctx.gateway
    asked = await _read(ctx, counting=True)
    backend = gateway.router.backend_for(asked.model)
    if isinstance(backend, AnthropicBackend):
        try:
            reply = await backend.send(COUNT_PATH, asked.raw, request.headers, query=request.url.query)
        except BackendError as exc:
            raise APIError(exc.status_code, exc.message, error_type=exc.error_type) from None
        return Response(reply.body, status_code=reply.status, headers=reply.headers)
    counter = getattr(backend, "count_tokens", None)
    if callable(counter):
        try:
            tokens = counter(asked.chat_body["messages"], asked.chat_body.get("tools"))
        except BackendError as exc:
            raise APIError(exc.status_code, exc.message, error_type=exc.error_type) from None
        return json_response({"input_tokens": tokens})
    return json_response({"input_tokens": estimate_tokens(asked.body), "estimated": True},
                         headers={ESTIMATE_HEADER: "estimate"})


def anthropic_error(exc: APIError) -> Response:
    """An ``APIError`` in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``."""
    return Response(orjson.dumps(error_body(exc.status_code, exc.message)), status_code=exc.status_code,
                    media_type="application/json", headers=exc.headers)

