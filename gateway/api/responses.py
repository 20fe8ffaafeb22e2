"""``POST /v1/responses`` (the Responses API, which Codex CLI speaks), ``POST /v1/responses/compact`` and
``GET /v1/responses/{id}``.

A model on a chat backend gets its requests translated to chat completions (``gateway/protocol/responses/``, pure)
and run through the same exchange as ``/v1/chat/completions``: routing, stitching, the proxy guard and capture;
compaction is answered by the summarizer (``compaction.py``). A model on a Responses-native upstream
(``kind = "openai-responses"``) gets them passed through as they came (``responses_native.py``). ``store`` decides
only whether a response can be fetched or continued with ``previous_response_id``; capture follows the gateway's
own settings whatever ``store`` says.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from gateway.agent.service import AGENT_PREFIX
from gateway.api import compaction
from gateway.api.common import json_response, parse_json, read_body
from gateway.api.exchange import (
    TRAJECTORY_HEADER,
    Exchange,
    Relay,
    choose_model,
    complete,
    open_exchange,
    open_stream,
)
from gateway.api.responses_native import pass_through_response
from gateway.auth import Principal
from gateway.backends.base import ChatResult
from gateway.backends.openai_responses import ResponsesBackend
from gateway.context import RequestContext
from gateway.errors import APIError
from gateway.protocol.chat import ChatCompletionRequest, validate_chat_request
from gateway.protocol.responses import (
    ResponseStream,
    ToolMap,
    chat_to_response,
    conversation_messages,
    failure_code,
    output_to_chat_messages,
    responses_to_chat,
    validate_responses_request,
)
from gateway.protocol.responses.compaction import asks_compaction, compacts, is_compacted
from gateway.protocol.sse import encode_named_events
from gateway.streaming import EventStreamResponse
from replay import stored_responses
from replay.records import Statement, WriteOp, new_id
from replay.store import TrajectoryStore


class _Kept:
    """Where a ``store: true`` response goes: with its exchange's commit, or alone when capture is off."""

    def __init__(self, body: dict[str, Any], chat_body: dict[str, Any], tool_map: ToolMap,
                 trajectory_id: str, principal: Principal) -> None:
        self.wanted = body.get("store", True) is not False
        self.body = body
        self.chat_body = chat_body
        self.tool_map = tool_map
        self.trajectory_id = trajectory_id
        self.principal = principal

    def _statement(self, response: dict[str, Any], trajectory_id: str | None) -> Statement:
        # The history a continuation starts from: without this request's instructions, which do not carry over.
        messages = conversation_messages(self.chat_body, self.body) + output_to_chat_messages(response, self.tool_map)
        return stored_responses.statement(response, trajectory_id=trajectory_id,
                                                  tenant=self.principal.tenant, messages=messages)

    def statements(self, response: dict[str, Any]) -> list[Statement]:
        if not self.wanted or not self.principal.capture:
            return []
        return [self._statement(response, self.trajectory_id)]

    async def without_capture(self, store: TrajectoryStore, response: dict[str, Any]) -> None:
        """A key that is not recorded may still ask to keep a response it wants to continue."""
        if self.wanted and not self.principal.capture:
            await store.write(WriteOp(statements=[self._statement(response, None)]))


@dataclass
class _Asked:
    """A Responses request read, checked and routed; its history translated for the record (and, on a chat
    backend, for the model)."""

    principal: Principal
    raw: bytes
    body: dict[str, Any]
    asked_model: Any  # as the client named it
    parsed: ChatCompletionRequest
    chat_body: dict[str, Any]
    tool_map: ToolMap
    backend: ResponsesBackend | None  # set when the model's upstream speaks the Responses API itself


async def _read(ctx: RequestContext) -> _Asked:
    request, gateway = ctx.request, ctx.gateway
    principal = await gateway.auth.authenticate(request.headers)
    raw = await read_body(request, gateway.settings.server.max_body_bytes)
    body = parse_json(raw)
    validate_responses_request(body)
    asked_model = body.get("model")
    parsed = ChatCompletionRequest.model_construct(model=asked_model or "", messages=[],
                                                   stream=bool(body.get("stream")), n=1)
    name = choose_model(ctx, principal, parsed, body)
    backend = None if name.startswith(AGENT_PREFIX) else gateway.router.backend_for(name)
    native = backend if isinstance(backend, ResponsesBackend) else None
    history = None
    previous = body.get("previous_response_id")
    if previous:
        found = await stored_responses.get(gateway.store, previous, tenant=principal.tenant,
                                           all_tenants=principal.admin)
        if found is None and native is None:  # a native upstream may hold what this gateway did not keep
            raise APIError(404, f"Previous response with id '{previous}' not found.", param="previous_response_id",
                           code="previous_response_not_found")
        history = found["messages"] if found else None
    chat_body, tool_map = responses_to_chat(body, history, lenient=native is not None)
    if tool_map.dropped and native is None:
        ctx.line.dropped_tools = [t.get("type") for t in tool_map.dropped]
    return _Asked(principal, raw, body, asked_model, parsed, chat_body, tool_map, native)


async def create_response(ctx: RequestContext) -> Response:
    gateway = ctx.gateway
    asked = await _read(ctx)
    principal, body, chat_body, tool_map = asked.principal, asked.body, asked.chat_body, asked.tool_map
    if asked.backend is not None:
        return await _pass_through(ctx, asked, compact=False)
    stream = bool(body.get("stream"))
    chat_body["stream"] = stream
    if stream:
        chat_body["stream_options"] = {"include_usage": True}
    parsed = validate_chat_request(chat_body)
    parsed.model = chat_body["model"]
    response_id = f"resp_{new_id().lower()}"
    created_at = int(time.time())

    if parsed.model.startswith(AGENT_PREFIX):
        return await _agent_response(ctx, principal, body, chat_body, tool_map, response_id, created_at)
    if asks_compaction(body):
        return await compaction.answer_trigger(ctx, principal, body, chat_body, tool_map, response_id, created_at)

    exchange = await _open(ctx, principal, chat_body, parsed, body)
    kept = _Kept(body, chat_body, tool_map, exchange.ref.id, principal)
    if not stream:
        def statements_for(result: ChatResult) -> list[Statement]:
            return kept.statements(_translate(result.response))

        def _translate(completion: dict[str, Any]) -> dict[str, Any]:
            return chat_to_response(completion, response_id=response_id, request=body, tool_map=tool_map,
                                    created_at=created_at)

        result = await complete(ctx, exchange, statements_for)
        response = _translate(result.response)
        await kept.without_capture(gateway.store, response)
        return json_response(response, headers=exchange.headers)

    upstream = await open_stream(ctx, exchange)
    relay = Relay(ctx, exchange, upstream, include_usage=True)
    events = ResponseStream(response_id=response_id, request=body, tool_map=tool_map, created_at=created_at)
    return EventStreamResponse(_stream(relay, events, kept, gateway.store), headers=exchange.headers)


async def compact_response(ctx: RequestContext) -> Response:
    """``POST /v1/responses/compact``: a history in, a shorter one out (its user messages and one ``compaction``
    item), from the native upstream or, on a chat backend, from the summarizer."""
    asked = await _read(ctx)
    if asked.parsed.model.startswith(AGENT_PREFIX):
        raise APIError(400, f"'{asked.parsed.model}' is an agent profile; agent profiles do not compact.",
                       param="model")
    if asked.backend is not None:
        return await _pass_through(ctx, asked, compact=True)
    validate_chat_request(asked.chat_body)
    return await compaction.answer_compact(ctx, asked.principal, asked.body, asked.chat_body,
                                           f"resp_{new_id().lower()}", int(time.time()))


async def _pass_through(ctx: RequestContext, asked: _Asked, *, compact: bool) -> Response:
    assert asked.backend is not None
    asked.parsed.messages = asked.chat_body["messages"]
    body = asked.body
    exchange = await _open(ctx, asked.principal, asked.chat_body, asked.parsed, body, compact=compact)
    kept = _Kept(body, asked.chat_body, asked.tool_map, exchange.ref.id, asked.principal)
    return await pass_through_response(ctx, exchange, asked.backend, asked.raw, body, asked.asked_model,
                                       asked.tool_map, kept.statements, compact=compact)


async def _open(ctx: RequestContext, principal: Principal, chat_body: dict[str, Any], parsed: ChatCompletionRequest,
                body: dict[str, Any], *, compact: bool = False) -> Exchange:
    """The request's exchange, in its session's trajectory across compactions; a call that compacts (``compact``:
    one to ``/responses/compact``) is marked as the session's summary."""
    compacting = compact or compacts(body)
    exchange = await open_exchange(ctx, principal, chat_body, parsed, session_body=body,
                                   compacted=compacting or is_compacted(body))
    if compacting:
        exchange.labels = {**exchange.labels, "purpose": "summary"}
    return exchange


async def _stream(relay: Relay, events: ResponseStream, kept: _Kept, store: TrajectoryStore) -> AsyncIterator[bytes]:
    """Events as the chunks come; ``response.completed`` (or ``response.failed``) only after the commit."""
    async for frames in relay.translated(events):
        yield frames
    tail = relay.held_events(events)
    if relay.status == "error":
        tail += events.fail(failure_code(relay.error_status, relay.error or ""), relay.error or "the backend failed")
    else:
        tail += events.finish()
    try:
        await relay.commit(kept.statements(events.response))
    except APIError as exc:  # not recorded: the finishing events are not sent
        yield encode_named_events(events.error(exc.code or exc.error_type, exc.message))
        return
    await kept.without_capture(store, events.response)
    yield encode_named_events(tail)


async def _agent_response(ctx: RequestContext, principal: Principal, body: dict[str, Any], chat_body: dict[str, Any],
                          tool_map: ToolMap, response_id: str, created_at: int) -> Response:
    """An agent profile behind the Responses API: the run goes to completion, then answers as one response
    (streamed as the events of that answer when asked), with the ``harness`` object on it."""
    gateway = ctx.gateway
    profile = chat_body["model"][len(AGENT_PREFIX):]
    messages = [m for m in chat_body["messages"] if m.get("role") != "system"] or chat_body["messages"]
    loop, recorder = gateway.agents.prepare(profile, messages, principal)
    ctx.line.model, ctx.line.backend, ctx.line.trajectory_id = chat_body["model"], loop.backend.name, loop.state.run_id
    await recorder.start(loop.state)
    state = await loop.run()
    harness = state.harness()
    completion = {"id": f"chatcmpl-{state.run_id}", "object": "chat.completion", "created": created_at,
                  "model": chat_body["model"], "usage": harness["usage"],
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": state.final or ""},
                               "finish_reason": "stop"}]}
    headers = {TRAJECTORY_HEADER: state.run_id}
    kept = _Kept(body, chat_body, tool_map, state.run_id, principal)
    if not body.get("stream"):
        response = chat_to_response(completion, response_id=response_id, request=body, tool_map=tool_map,
                                    created_at=created_at)
        response["harness"] = harness
        await _keep_alone(gateway.store, kept, response)
        return json_response(response, headers=headers)
    events = ResponseStream(response_id=response_id, request=body, tool_map=tool_map, created_at=created_at)
    out = events.start()
    base = {k: completion[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    for delta, finish in (({"role": "assistant", "content": state.final or ""}, None), ({}, "stop")):
        out += events.feed({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    out += events.feed({**base, "choices": [], "usage": harness["usage"]})
    out += events.finish()
    out[-1]["response"]["harness"] = harness
    await _keep_alone(gateway.store, kept, events.response)

    async def once() -> AsyncIterator[bytes]:
        yield encode_named_events(out)

    return EventStreamResponse(once(), headers=headers)


async def _keep_alone(store: TrajectoryStore, kept: _Kept, response: dict[str, Any]) -> None:
    statements = kept.statements(response)
    if statements:
        await store.write(WriteOp(statements=statements))
    await kept.without_capture(store, response)


async def get_response(ctx: RequestContext) -> Response:
    request, gateway = ctx.request, ctx.gateway
    principal = await gateway.auth.authenticate(request.headers)
    response_id = request.path_params["response_id"]
    found = await stored_responses.get(gateway.store, response_id, tenant=principal.tenant, all_tenants=principal.admin)
    if found is None:
        raise APIError(404, f"Response with id '{response_id}' not found.", code="not_found")
    return json_response(found["body"])
