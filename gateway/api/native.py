"""What OpenAI's APIs besides chat (legacy text completions, embeddings) share on their way through: routing to a
backend that serves the API, and a record of each call as it came.

These calls are passed through, not translated: nothing of them is a chat message, so each is recorded with no
messages (chat exports and training, which read messages and replies, pass them by) and its exchange whole in
``CallRecord.native`` (``model_calls.native_api`` names the API), each in a trajectory of its own: a prompt without
messages has no conversation to stitch into. Usage, latency, backend, model, key and tenant are recorded as for
chat, through the same ``save``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import ClientDisconnect

from gateway.agent.service import AGENT_PREFIX
from gateway.api.exchange import (
    Exchange,
    account,
    answered_by,
    as_api_error,
    choose_model,
    record_disconnect,
    save,
)
from gateway.api.limits import admit
from gateway.auth import Principal
from gateway.backends.base import BackendError, CallExtras, ChatResult, serves_api
from gateway.context import RequestContext
from gateway.errors import APIError
from gateway.protocol.chat import ChatCompletionRequest
from gateway.protocol.completions import prompts
from gateway.protocol.embeddings import without_vectors
from gateway.streaming import unless_disconnected
from replay.model import COMPLETIONS, EMBEDDINGS
from replay.records import CallRecord, TrajectoryRef, new_id

# What the store keeps of an answer: an embedding's vectors are left out (their count and dimensions stay).
_KEPT = {COMPLETIONS: lambda answer: answer, EMBEDDINGS: without_vectors}
_BODIES = ("choices", "data")  # an answer's parts kept in the native record alone


def _unsupported(model: str, api: str, why: str) -> APIError:
    return APIError(404, f"The model '{model}' is not served on /v1/{api}: {why}.", param="model",
                    code="unsupported_api")


async def open_native(ctx: RequestContext, principal: Principal, body: dict[str, Any], api: str, *,
                      stream: bool = False) -> Exchange:
    """Route the request (aliases, defaults and the override header as for chat) to a backend whose ``apis`` list
    ``api``, and count it against its caller's limits as chat is counted; a model nobody serves is chat's 404, one
    whose backend does not serve ``api`` a 404 ``unsupported_api``."""
    parsed = ChatCompletionRequest.model_construct(model=body.get("model") or "", messages=[], stream=stream, n=1)
    name = choose_model(ctx, principal, parsed, body)
    if name.startswith(AGENT_PREFIX):
        raise _unsupported(name, api, "agent profiles are served on /v1/chat/completions and /v1/responses")
    target = ctx.gateway.router.route(name)
    if target.adapter is not None:
        raise _unsupported(name, api, "it is a LoRA adapter, and adapters are served on chat alone")
    if not serves_api(target.backend, api):
        raise _unsupported(name, api, f"its backend {target.backend.name!r} does not serve this API")
    # Embeddings generate nothing: no completion to hold room for.
    await admit(ctx, principal, target.base, body if api == COMPLETIONS else None,
                _prompt_tokens(body.get("prompt") if api == COMPLETIONS else body.get("input")))
    line = ctx.line
    line.model, line.backend, line.stream = name, target.backend.name, stream
    if target.canary:
        line.canary = target.model
    ref = TrajectoryRef(id=new_id(), seq=0, is_new=True)
    line.trajectory_id = ref.id
    return Exchange(principal, body, parsed, target, ctx.requested_model, ref, [], time.perf_counter())


def _prompt_tokens(texts: Any) -> Callable[[], int]:
    """Token ids counted; text at four characters a token, as ``approximate_tokens`` counts without a tokenizer."""
    return lambda: sum(len(p) if isinstance(p, list) else len(p) // 4 + 1 for p in prompts(texts))


def native_record(exchange: Exchange, api: str, *, status: str, answer: dict[str, Any] | None = None,
                  error: str | None = None, extras: CallExtras | None = None,
                  ttft_ms: float | None = None) -> CallRecord:
    """The record of one call: no chat messages, its answer's header and usage as the response, and the exchange
    as it came (without vectors) as ``native``."""
    kept = _KEPT[api](answer) if answer is not None else None
    header = {k: v for k, v in kept.items() if k not in _BODIES} if kept is not None else None
    return exchange.record(status=status, response=header, error=error, result_extras=extras, ttft_ms=ttft_ms,
                           messages=[], native={"api": api, "request": exchange.body, "response": kept})


async def answer(ctx: RequestContext, exchange: Exchange, api: str, call: Awaitable[ChatResult]) -> ChatResult:
    """A whole answer, committed before it returns; the backend's work is cancelled if the client goes first."""
    try:
        result = await unless_disconnected(ctx.request.receive, call)
    except BackendError as exc:
        answered_by(ctx, exchange, exc.backend)
        await save(ctx, exchange, [native_record(exchange, api, status="error", error=exc.message)])
        raise as_api_error(exc, exchange) from None
    except ClientDisconnect:
        record_disconnect(ctx, exchange, [native_record(
            exchange, api, status="client_disconnected",
            error="the client closed the connection before the answer")])
        raise
    answered_by(ctx, exchange, result.backend)
    records = [native_record(exchange, api, status="ok", answer=result.response, extras=result.extras)]
    await save(ctx, exchange, records)
    account(ctx, exchange, records)
    return result
