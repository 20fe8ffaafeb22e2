"""Compaction for models on chat backends (``protocol/responses/compaction.py`` has the items): the history is
summarized by the agent loop's summarizer, as one call recorded in the session's trajectory with the purpose
``summary``, and handed back as one ``compaction`` item, so that a long Codex session goes on after its context
filled up on the embedded model, SGLang or vLLM as it does on OpenAI's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import Response

from gateway.agent import context
from gateway.api.common import json_response
from gateway.api.exchange import Exchange, complete, open_exchange
from gateway.auth import Principal
from gateway.backends.base import ChatResult
from gateway.context import RequestContext
from gateway.errors import APIError
from gateway.protocol.chat import validate_chat_request
from gateway.protocol.responses import ResponseStream, ToolMap, chat_to_response, response_usage
from gateway.protocol.responses.compaction import compacted_response, compaction_item, kept_user_messages
from gateway.protocol.sse import encode_named_events
from gateway.streaming import EventStreamResponse

# The newest part of the history the summarizer reads (about 6,000 tokens: room for it and its answer in the
# embedded model's 8,192), and the summary's length.
SOURCE_CHARS = 24_000
SUMMARY_TOKENS = 512


async def summarize(ctx: RequestContext, principal: Principal, body: dict[str, Any],
                    chat_body: dict[str, Any]) -> tuple[str, ChatResult, Exchange]:
    """The summary of a translated history (the model's, or an extractive one when it answers nothing), the call
    that made it, and its exchange: in the session's trajectory, which goes on past the compaction."""
    history = [m for m in chat_body["messages"] if m.get("role") != "system"]
    if not history:
        raise APIError(400, "The input has no conversation to compact.", param="input", code="invalid_value")
    request = {"model": chat_body["model"], "max_tokens": SUMMARY_TOKENS,
               "messages": context.summary_request(history, SOURCE_CHARS)}
    exchange = await open_exchange(ctx, principal, request, validate_chat_request(request), session_body=body,
                                   compacted=True)
    exchange.labels = {"api": "responses", "purpose": "summary"}
    result = await complete(ctx, exchange)
    text = (result.message.get("content") or "").strip() or context.extractive_summary(history)
    return text, result, exchange


def _item_id(response_id: str) -> str:
    return f"cmp_{response_id.removeprefix('resp_')}"


async def answer_trigger(ctx: RequestContext, principal: Principal, body: dict[str, Any], chat_body: dict[str, Any],
                         tool_map: ToolMap, response_id: str, created_at: int) -> Response:
    """A ``/v1/responses`` request whose input ends with a ``compaction_trigger``: a response holding exactly one
    ``compaction`` item (streamed when asked: the item added and done at once), as Codex requires."""
    text, result, exchange = await summarize(ctx, principal, body, chat_body)
    item = compaction_item(_item_id(response_id), text)
    if not body.get("stream"):
        completion = {**result.response, "choices": [{"index": 0, "finish_reason": "stop",
                                                      "message": {"role": "assistant", "content": None}}]}
        response = chat_to_response(completion, response_id=response_id, request=body, tool_map=tool_map,
                                    created_at=created_at)
        response["output"] = [item]
        return json_response(response, headers=exchange.headers)
    events = ResponseStream(response_id=response_id, request=body, tool_map=tool_map, created_at=created_at)
    out = events.add_item(item) + events.feed({"choices": [], "usage": result.response.get("usage")}) + events.finish()

    async def once() -> AsyncIterator[bytes]:
        yield encode_named_events(out)

    return EventStreamResponse(once(), headers=exchange.headers)


async def answer_compact(ctx: RequestContext, principal: Principal, body: dict[str, Any], chat_body: dict[str, Any],
                         response_id: str, created_at: int) -> Response:
    """``POST /v1/responses/compact``: the history's user messages as they were, then one ``compaction`` item."""
    text, result, exchange = await summarize(ctx, principal, body, chat_body)
    output = [{**m, "type": "message"} for m in kept_user_messages(body)]
    output.append(compaction_item(_item_id(response_id), text))
    return json_response(compacted_response(response_id, created_at, output,
                                            response_usage(result.response.get("usage"))), headers=exchange.headers)
