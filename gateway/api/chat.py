"""``POST /v1/chat/completions``: chat completions, plain or streamed, and agent profiles (``agent:<name>``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.responses import Response

from gateway.agent.service import AGENT_PREFIX
from gateway.api.agent import agent_chat
from gateway.api.common import json_response, read_json_body
from gateway.api.exchange import Relay, choose_model, complete, open_exchange, open_stream
from gateway.backends import token_capture
from gateway.context import RequestContext
from gateway.errors import APIError, error_body
from gateway.protocol.chat import validate_chat_request
from gateway.protocol.sse import DONE, encode_event
from gateway.streaming import EventStreamResponse


async def chat_completions(ctx: RequestContext) -> Response:
    request, gateway = ctx.request, ctx.gateway
    principal = await gateway.auth.authenticate(request.headers)
    body = await read_json_body(request, gateway.settings.server.max_body_bytes)
    parsed = validate_chat_request(body)
    if choose_model(ctx, principal, parsed, body).startswith(AGENT_PREFIX):
        return await agent_chat(ctx, principal, parsed, body)
    tokens = bool(body.pop(token_capture.GATEWAY_FIELD, None))
    if tokens and parsed.stream:
        raise APIError(400, "return_token_ids is answered only when stream is false", param="return_token_ids",
                       code="unsupported_parameter")
    exchange = await open_exchange(ctx, principal, body, parsed)
    exchange.tokens = tokens
    if not parsed.stream:
        result = await complete(ctx, exchange)
        if tokens:
            token_capture.attach(result.response, result.extras)
        return json_response(result.response, headers=exchange.headers)
    stream = await open_stream(ctx, exchange)
    wants_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
    relay = Relay(ctx, exchange, stream, include_usage=wants_usage)
    return EventStreamResponse(_frames(relay), headers=exchange.headers)


async def _frames(relay: Relay) -> AsyncIterator[bytes]:
    try:
        async for chunk in relay.chunks():
            yield encode_event(chunk)
    finally:
        await relay.close()
    try:
        await relay.commit()
    except APIError as exc:  # not recorded: the finishing chunks are not sent
        yield encode_event(exc.body())
        return
    tail = [encode_event(chunk) for chunk in relay.held]
    tail.append(encode_event(error_body(relay.error or "backend error", "backend_error", code=relay.error_code))
                if relay.status == "error" else DONE)
    yield b"".join(tail)
