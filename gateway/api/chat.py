"""``POST /v1/chat/completions``: route to a backend, relay the answer, capture the exchange.

A body is sent only after its record is committed; a stream's last chunk and ``[DONE]`` likewise.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
import structlog
from starlette.requests import Request
from starlette.responses import Response

from gateway.agent import guard
from gateway.agent.service import AGENT_PREFIX
from gateway.agent.validation import function_schemas
from gateway.api.agent import agent_chat
from gateway.api.common import read_json_body
from gateway.auth import Principal
from gateway.backends.base import Backend, BackendError, ChatRequest, ChatResult, ChunkStream
from gateway.errors import APIError, error_body
from gateway.protocol.chat import ChatCompletionRequest, ChunkAccumulator, validate_chat_request
from gateway.protocol.sse import DONE, encode_event
from gateway.streaming import EventStreamResponse
from replay import hashing
from replay.store import CallRecord, TrajectoryRef, WriteOp, new_id

log = structlog.get_logger()

TRAJECTORY_HEADER = "X-Harness-Trajectory-Id"
SESSION_HEADER = "x-harness-session"
_PARAM_KEYS = ("temperature", "top_p", "max_tokens", "max_completion_tokens", "n", "stop", "seed",
               "response_format", "tool_choice", "parallel_tool_calls", "stream_options", "logprobs",
               "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "reasoning_effort")


def session_key(request: Request, body: dict[str, Any]) -> str | None:
    """The conversation a request names, in order of trust; never ``user``, which names a person."""
    header = request.headers.get(SESSION_HEADER)
    if header:
        return f"session:{header}"
    if isinstance(body.get("prompt_cache_key"), str) and body["prompt_cache_key"]:
        return f"cache:{body['prompt_cache_key']}"
    metadata = body.get("client_metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("session_id"), str):
        return f"client:{metadata['session_id']}"
    return None


@dataclass
class Exchange:
    """One chat request on its way through: what was asked, where it goes, where it is recorded."""

    principal: Principal
    body: dict[str, Any]
    parsed: ChatCompletionRequest
    backend: Backend
    ref: TrajectoryRef
    prefix: list[str]
    started: float

    def record(self, *, status: str, response: dict[str, Any] | None = None, error: str | None = None,
               result_extras: Any = None, ttft_ms: float | None = None, messages: list[dict[str, Any]] | None = None,
               tool_calls: list[dict[str, Any]] | None = None) -> CallRecord:
        """The record of one backend call; ``messages`` when a guard retry sent other messages than the client."""
        usage = (response or {}).get("usage") or {}
        extras = result_extras
        return CallRecord(
            trajectory=self.ref,
            request_messages=messages if messages is not None else self.body["messages"],
            tool_calls=tool_calls or [],
            request_prefix=self.prefix,
            status=status,
            tenant=self.principal.tenant,
            key_id=self.principal.key_id,
            requested_model=self.parsed.model,
            base_model=self.parsed.model,
            backend=self.backend.name,
            tools=self.body.get("tools"),
            params={k: self.body[k] for k in _PARAM_KEYS if k in self.body},
            response=response,
            error=error,
            stream=self.parsed.stream,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            latency_ms=(time.perf_counter() - self.started) * 1000,
            ttft_ms=ttft_ms,
            prompt_token_ids=getattr(extras, "prompt_token_ids", None),
            completion_token_ids=getattr(extras, "completion_token_ids", None),
            completion_logprobs=getattr(extras, "completion_logprobs", None),
        )


async def chat_completions(request: Request) -> Response:
    gateway = request.app.state.gateway
    started = time.perf_counter()
    log_fields = request.scope["state"]["log"]
    principal = await gateway.auth.authenticate(request.headers)
    body = await read_json_body(request, gateway.settings.server.max_body_bytes)
    parsed = validate_chat_request(body)
    if parsed.model.startswith(AGENT_PREFIX):
        return await agent_chat(request, principal, parsed, body)
    backend = gateway.backend_for(parsed.model)
    log_fields.update(model=parsed.model, adapter=None, backend=backend.name, stream=parsed.stream)

    messages = body["messages"]
    prefix = hashing.prefix_hashes(messages)
    if principal.capture:
        ref = await gateway.store.resolve(
            session_key=session_key(request, body), prefix=prefix,
            anchor=prefix[hashing.anchor_index(messages)], tenant=principal.tenant)
    else:
        ref = TrajectoryRef(id=new_id(), seq=0, is_new=True)
    log_fields["trajectory_id"] = ref.id
    headers = {TRAJECTORY_HEADER: ref.id}
    exchange = Exchange(principal, body, parsed, backend, ref, prefix, started)
    backend_request = ChatRequest(body=body, model=parsed.model)

    if not parsed.stream:
        return await _complete(request, exchange, backend_request, headers)
    try:
        stream = await backend.stream(backend_request)
    except BackendError as exc:
        if principal.capture:
            await gateway.store.record(exchange.record(status="error", error=exc.message))
        raise _as_api_error(exc, headers) from None
    return EventStreamResponse(_relay(request, exchange, stream), headers=headers)


def _as_api_error(exc: BackendError, headers: dict[str, str]) -> APIError:
    return APIError(exc.status_code, exc.message, error_type=exc.error_type, code=exc.code, param=exc.param,
                    headers=headers)


async def _complete(request: Request, exchange: Exchange, backend_request: ChatRequest,
                    headers: dict[str, str]) -> Response:
    records: list[CallRecord] = []
    try:
        result: ChatResult = await exchange.backend.chat(backend_request)
        result = await _guard(request, exchange, result, records)
    except BackendError as exc:
        records.append(exchange.record(status="error", error=exc.message))
        await _save(request, exchange, records)
        raise _as_api_error(exc, headers) from None
    await _save(request, exchange, records)
    _account(request, exchange, result.response.get("usage"))
    return Response(orjson.dumps(result.response), media_type="application/json", headers=headers)


async def _save(request: Request, exchange: Exchange, records: list[CallRecord]) -> None:
    if exchange.principal.capture and records:
        await request.app.state.gateway.store.write(WriteOp(records=records))


def _first_message(result: ChatResult) -> dict[str, Any]:
    return ((result.response.get("choices") or [{}])[0].get("message")) or {}


async def _guard(request: Request, exchange: Exchange, result: ChatResult, records: list[CallRecord]) -> ChatResult:
    """Proxy mode: send invalid tool calls back to the model (up to the configured retries) before the
    client sees them; appends the record of every call made, the first included."""
    schemas = function_schemas(exchange.body.get("tools"))
    sent = exchange.body["messages"]
    retries = request.app.state.gateway.settings.server.guard_retries
    for attempt in range(retries + 1):
        checked = guard.check_message(_first_message(result), schemas) if schemas else []
        invalid = [c for c in checked if not c.valid]
        retry = bool(invalid) and attempt < retries
        records.append(exchange.record(status="ok", response=result.response, result_extras=result.extras,
                                       messages=sent, tool_calls=guard.tool_rows(
                                           checked, "retried" if retry else "returned")))
        if not retry:
            if invalid:
                request.scope["state"]["log"]["invalid_tool_calls"] = len(invalid)
            return result
        sent = guard.retry_messages(sent, _first_message(result), checked)
        result = await exchange.backend.chat(ChatRequest(body={**exchange.body, "messages": sent},
                                                         model=exchange.parsed.model))
    return result


def _account(request: Request, exchange: Exchange, usage: dict[str, Any] | None) -> None:
    if not usage:
        return
    metrics = request.app.state.gateway.metrics
    prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    metrics.tokens.labels(exchange.parsed.model, "prompt").inc(prompt)
    metrics.tokens.labels(exchange.parsed.model, "completion").inc(completion)
    request.scope["state"]["log"].update(prompt_tokens=prompt, completion_tokens=completion)


def _without_tool_calls(chunk: dict[str, Any]) -> dict[str, Any] | None:
    """The chunk minus its tool-call parts (held for the guard); None when nothing else is left in it."""
    choices = []
    for choice in chunk.get("choices") or ():
        delta = {k: v for k, v in (choice.get("delta") or {}).items() if k != "tool_calls"}
        if delta or choice.get("finish_reason"):
            choices.append({**choice, "delta": delta})
    if not choices and chunk.get("choices"):
        return None
    return {**chunk, "choices": choices}


def _tool_call_chunk(template: dict[str, Any], calls: list[dict[str, Any]]) -> dict[str, Any]:
    deltas = [{"index": i, "id": c.get("id"), "type": "function", "function": c.get("function")}
              for i, c in enumerate(calls)]
    return {**{k: template[k] for k in ("id", "object", "created", "model") if k in template},
            "choices": [{"index": 0, "delta": {"tool_calls": deltas}, "finish_reason": None}]}


async def _relay(request: Request, exchange: Exchange, stream: ChunkStream) -> AsyncIterator[bytes]:
    """Forward chunks as they come; the one that finishes the last choice, and any after it, wait for the commit.

    With the client's ``tools`` on a single-choice request, tool-call parts are held back until the guard
    has checked them (text still streams as it comes); a retry contributes only its tool calls.
    """
    gateway = request.app.state.gateway
    wants_usage = bool(exchange.parsed.stream_options and exchange.parsed.stream_options.include_usage)
    guarded = exchange.parsed.n == 1 and bool(function_schemas(exchange.body.get("tools")))
    acc = ChunkAccumulator()
    held: list[bytes] = []
    unfinished = exchange.parsed.n
    ttft_ms: float | None = None
    status, error = "ok", None
    finished = False
    template: dict[str, Any] = {}
    try:
        async for chunk in stream:
            if ttft_ms is None:
                ttft_ms = (time.perf_counter() - exchange.started) * 1000
                gateway.metrics.ttft.labels(exchange.parsed.model).observe(ttft_ms / 1000)
                template = chunk
            acc.add(chunk)
            choices = chunk.get("choices")
            if not choices and chunk.get("usage") and not wants_usage:
                continue
            unfinished -= sum(1 for c in choices or () if c.get("finish_reason"))
            if guarded and (chunk := _without_tool_calls(chunk)) is None:
                continue
            frame = encode_event(chunk)
            if held or unfinished <= 0 or not choices:
                held.append(frame)
            else:
                yield frame
        finished = True
    except BackendError as exc:
        status, error = "error", exc.message
    except (asyncio.CancelledError, GeneratorExit):
        status, error = "client_disconnected", "the client closed the connection mid-stream"
        raise
    finally:
        if not finished:
            await stream.aclose()
        records = [exchange.record(status=status, response=acc.completion() if acc.chunks else None,
                                   error=error, result_extras=stream.extras, ttft_ms=ttft_ms)]
        if status == "client_disconnected":
            request.scope["state"]["log"]["status_detail"] = status
            if exchange.principal.capture:
                gateway.spawn(gateway.store.write(WriteOp(records=records)))
    if guarded and status == "ok":
        first = ChatResult(response=acc.completion(), extras=stream.extras)
        records = []
        try:
            result = await _guard(request, exchange, first, records)
            calls = _first_message(result).get("tool_calls")
            if calls:
                held.insert(0, encode_event(_tool_call_chunk(template, calls)))
        except BackendError as exc:
            status, error = "error", exc.message
            records.append(exchange.record(status="error", error=exc.message))
        records[0].ttft_ms = ttft_ms
    _account(request, exchange, acc.usage)
    await _save(request, exchange, records)
    if status == "error":
        gateway.metrics.errors.labels("backend_error").inc()
        held.append(encode_event(error_body(error or "backend error", "backend_error")))
    else:
        held.append(DONE)
    yield b"".join(held)
