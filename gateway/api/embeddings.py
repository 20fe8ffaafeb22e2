"""``POST /v1/embeddings``: passed through to the ``/embeddings`` of an OpenAI-compatible backend that serves them
(``[[backends]] apis``; the embedded model does not). The client gets the vectors; the store keeps the call without
them (``gateway/api/native.py``)."""

from __future__ import annotations

from starlette.responses import Response

from gateway.api.common import json_response, read_json_body
from gateway.api.native import answer, open_native
from gateway.backends.base import ChatRequest, ChatResult, EmbeddingsHost
from gateway.context import RequestContext
from gateway.protocol.embeddings import validate_embedding_request
from replay.model import EMBEDDINGS


async def create_embeddings(ctx: RequestContext) -> Response:
    request, gateway = ctx.request, ctx.gateway
    principal = await gateway.auth.authenticate(request.headers)
    body = await read_json_body(request, gateway.settings.server.max_body_bytes)
    validate_embedding_request(body)
    exchange = await open_native(ctx, principal, body, EMBEDDINGS)
    backend: EmbeddingsHost = exchange.backend  # type: ignore[assignment]  # open_native checked its apis
    result = await answer(ctx, exchange, EMBEDDINGS, _embedded(backend, exchange.chat_request()))
    return json_response(result.response, headers=exchange.headers)


async def _embedded(backend: EmbeddingsHost, request: ChatRequest) -> ChatResult:
    return ChatResult(response=await backend.embeddings(request))
