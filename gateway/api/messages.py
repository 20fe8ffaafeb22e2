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

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.responses import Response

from gateway.agent.service import AGENT_PREFIX
from gateway.api.common import json_response, parse_json, read_body
from gateway.api.exchange import Exchange, Relay, choose_model, complete, open_exchange, open_stream
from gateway.api.passthrough import pass_through
from gateway.auth import Principal
from gateway.backends.anthropic import AnthropicBackend
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
    session_id,
    side_request_kind,
    validate_messages_request,
)
from gateway.protocol.chat import ChatCompletionRequest, validate_chat_request
from gateway.protocol.sse import encode_named_event, encode_named_events
from gateway.streaming import EventStreamResponse
from replay.records import CallRecord, Statement, new_id

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

class _MessagesReader:
    """The Messages API's side of a pass-through: the Message recorded in the chat format, and as it came."""

    held = frozenset({"message_delta", "message_stop", "error"})

    def __init__(self, request: dict[str, Any]) -> None:
        self.request = request
        self.acc = MessageAccumulator()

    def add(self, event: dict[str, Any]) -> None:
        self.acc.add(event)

    def is_output(self, kind: str | None) -> bool:
        return kind == "content_block_delta"

    @property
    def answer(self) -> dict[str, Any] | None:
        return self.acc.message

    def failure(self) -> str | None:
        error = self.acc.error
        return None if error is None else f"upstream stream error: {error.get('type')}: {error.get('message')}"

    def record(self, exchange: Exchange, answer: dict[str, Any] | None, *, status: str,
               error: str | None) -> CallRecord:
        if answer is None:
            return exchange.record(status="error" if status == "ok" else status,
                                   error=error or "upstream stream ended before message_start")
        return exchange.record(status=status, response=message_to_chat(answer), error=error,
                               native=_native(self.request, answer))

    def statements(self, answer: dict[str, Any]) -> list[Statement]:
        return []

    def error_event(self, status: int, message: str) -> bytes:
        return encode_named_event("error", error_body(status, message))


async def _pass_through(ctx: RequestContext, exchange: Exchange, asked: _Request,
                        backend: AnthropicBackend) -> Response:
    exchange.native = lambda _: _native(asked.body, None)  # an answer passed through is kept as it came
    return await pass_through(ctx, exchange, backend, MESSAGES_PATH, asked.raw, _MessagesReader(asked.body),
                              stream=bool(asked.body.get("stream")))


def _native(request: dict[str, Any], message: dict[str, Any] | None) -> dict[str, Any]:
    return {"api": API, "request": request, "response": message}


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

