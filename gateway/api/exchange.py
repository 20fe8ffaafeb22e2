"""One request to a model backend, whatever surface it came through: routing, stitching, the proxy
guard, and capture.

A body is sent only after its record is committed; a stream's final chunk likewise. Surfaces
(chat completions, the Responses API) differ only in how they encode what this module hands them.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect

from gateway.agent import guard
from gateway.agent.validation import function_schemas
from gateway.api.fallbacks import Renamed, with_fallbacks
from gateway.api.limits import admit, prompt_counter
from gateway.auth import Principal
from gateway.backends import token_capture
from gateway.backends.base import Backend, BackendError, ChatRequest, ChatResult, ChunkStream
from gateway.context import RequestContext
from gateway.errors import APIError, store_unavailable
from gateway.protocol.chat import ChatCompletionRequest, ChunkRelay, carries_output
from gateway.protocol.sse import encode_named_events
from gateway.routing import Target
from gateway.streaming import unless_disconnected
from replay import hashing
from replay.database import StoreUnavailable
from replay.records import CallRecord, Statement, TrajectoryRef, WriteOp, new_id
from replay.writer import RecordRejected

log = structlog.get_logger()

TRAJECTORY_HEADER = "X-Harness-Trajectory-Id"
SESSION_HEADER = "x-harness-session"
_PARAM_KEYS = ("temperature", "top_p", "max_tokens", "max_completion_tokens", "n", "stop", "seed",
               "response_format", "tool_choice", "parallel_tool_calls", "stream_options", "logprobs",
               "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias", "reasoning_effort")


def session_key(headers: Headers, body: dict[str, Any]) -> str | None:
    """The conversation a request names, in order of trust; never ``user``, which names a person."""
    header = headers.get(SESSION_HEADER)
    if header:
        return f"session:{header}"
    if isinstance(body.get("prompt_cache_key"), str) and body["prompt_cache_key"]:
        return f"cache:{body['prompt_cache_key']}"
    metadata = body.get("client_metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("session_id"), str):
        return f"client:{metadata['session_id']}"
    return None


def choose_model(ctx: RequestContext, principal: Principal, parsed: ChatCompletionRequest,
                 body: dict[str, Any]) -> str:
    """Routing's first steps (alias, defaults, override header): the name this request stands for replaces its
    ``model``, where agent profiles and ``open_exchange`` read it."""
    gateway = ctx.gateway
    ctx.requested_model = parsed.model or None
    name = gateway.router.name_for(parsed.model or None, principal.caller(),
                                   ctx.request.headers.get(gateway.settings.routing.override_header))
    parsed.model = body["model"] = name
    return name


@dataclass
class Exchange:
    """One chat request on its way through: what was asked, where it goes, where it is recorded."""

    principal: Principal
    body: dict[str, Any]
    parsed: ChatCompletionRequest
    target: Target[Backend]
    requested: str | None
    ref: TrajectoryRef
    prefix: list[str]
    started: float
    # What the surface adds to each call's recorded parameters (the API it came through, a side request's purpose,
    # what a chat backend could not take).
    labels: dict[str, Any] = field(default_factory=dict)
    # The Anthropic API's max_tokens is a ceiling clients set to the largest a model allows: lowered to what the
    # backend can give rather than refused.
    max_tokens_ceiling: bool = False
    # A surface of another API than chat completions: its call as that API saw it, from the completion answered
    # (None when there was none), kept with each record of the client's own request.
    native: Callable[[dict[str, Any] | None], dict[str, Any]] | None = None
    # The pool member that answered (or failed last), where the backend is a pool; its records name it.
    member: str | None = None
    # Calls that failed before a fallback model was tried, recorded with whatever follows them.
    failed: list[CallRecord] = field(default_factory=list)
    # The caller asked for the token ids and log-probabilities its answer was sampled with (return_token_ids).
    tokens: bool = False

    @property
    def backend(self) -> Backend:
        return self.target.backend

    def chat_request(self, body: dict[str, Any] | None = None) -> ChatRequest:
        return ChatRequest(body=self.body if body is None else body, model=self.target.base,
                           tenant=self.principal.tenant, max_tokens_ceiling=self.max_tokens_ceiling,
                           tokens=self.tokens)

    @property
    def headers(self) -> dict[str, str]:
        if self.tokens:  # the tokens are the answering backend's: a caller that trains on them needs its name
            return {TRAJECTORY_HEADER: self.ref.id, token_capture.BACKEND_HEADER: self.member or self.backend.name}
        return {TRAJECTORY_HEADER: self.ref.id}

    def record(self, *, status: str, response: dict[str, Any] | None = None, error: str | None = None,
               result_extras: Any = None, ttft_ms: float | None = None, messages: list[dict[str, Any]] | None = None,
               tool_calls: list[dict[str, Any]] | None = None, native: dict[str, Any] | None = None) -> CallRecord:
        """The record of one backend call; ``messages`` when a guard retry sent other messages than the client;
        ``native``: the call as its API saw it, where the surface has it whole (else ``self.native`` makes it)."""
        if native is None and self.native is not None and messages is None:
            native = self.native(response)
        usage = (response or {}).get("usage") or {}
        return CallRecord(
            trajectory=self.ref,
            request_messages=messages if messages is not None else self.body["messages"],
            tool_calls=tool_calls or [],
            request_prefix=self.prefix,
            status=status,
            tenant=self.principal.tenant,
            key_id=self.principal.key_id,
            requested_model=self.requested or self.parsed.model,
            base_model=self.target.base,
            adapter=self.target.adapter.backend_name if self.target.adapter else None,
            backend=self.member or self.backend.name,
            tools=self.body.get("tools"),
            params={**{k: self.body[k] for k in _PARAM_KEYS if k in self.body}, **self.labels},
            response=response,
            error=error,
            stream=self.parsed.stream,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            latency_ms=(time.perf_counter() - self.started) * 1000,
            ttft_ms=ttft_ms,
            native=native,
            prompt_token_ids=getattr(result_extras, "prompt_token_ids", None),
            completion_token_ids=getattr(result_extras, "completion_token_ids", None),
            completion_logprobs=getattr(result_extras, "completion_logprobs", None),
            completion_sampled_logprobs=getattr(result_extras, "completion_sampled_logprobs", None),
        )


async def open_exchange(ctx: RequestContext, principal: Principal, body: dict[str, Any], parsed: ChatCompletionRequest,
                        *, session_body: dict[str, Any] | None = None, session: str | None = None,
                        side: bool = False, compacted: bool = False) -> Exchange:
    """Route the request and decide its trajectory (before the backend runs, so the id can go out in the
    headers). ``session_body`` is where session ids are read from when it is not the chat body itself;
    ``session`` is a key the surface found itself (the session header still comes first). A ``side`` request
    (a client's own title or summary request) gets a trajectory of its own, never stitched into its session's;
    a ``compacted`` one (a history its client shortened, or the call that shortens it) goes on in its session's."""
    gateway = ctx.gateway
    messages = body["messages"]
    prefix = hashing.prefix_hashes(messages)
    session = session_key(ctx.request.headers, session_body if session_body is not None else body) or session
    # A request passed through may carry no message at all (only items its upstream keeps): an opening of its own.
    anchor = prefix[hashing.anchor_index(messages)] if prefix else new_id()
    # A canary draw keyed by the session, else by the conversation's opening, keeps a trajectory on one version.
    target = gateway.router.route(parsed.model, sticky=session or anchor)
    await admit(ctx, principal, target.base, body, prompt_counter(target.backend, messages, body.get("tools")))
    line = ctx.line
    line.model, line.backend, line.stream = parsed.model, target.backend.name, parsed.stream
    line.adapter = target.adapter.backend_name if target.adapter else None
    if target.canary:
        line.canary = target.model
    if side:
        # Its own session key: the session's newest trajectory must stay the session's own.
        ref = TrajectoryRef(id=new_id(), seq=0, is_new=True, session_key=f"{session}:side" if session else None)
    elif principal.capture:
        ref = await gateway.store.stitch(session_key=session, prefix=prefix, anchor=anchor, tenant=principal.tenant,
                                         compacted=compacted)
    else:
        ref = TrajectoryRef(id=new_id(), seq=0, is_new=True)
    line.trajectory_id = ref.id
    return Exchange(principal, body, parsed, target, ctx.requested_model, ref, prefix, time.perf_counter())


Statements = list[Statement]


def as_api_error(exc: BackendError, exchange: Exchange) -> APIError:
    return APIError(exc.status_code, exc.message, error_type=exc.error_type, code=exc.code, param=exc.param,
                    headers=exchange.headers)


async def complete(ctx: RequestContext, exchange: Exchange,
                   statements_for: Callable[[ChatResult], Statements] | None = None) -> ChatResult:
    """A non-streamed completion, guarded and committed (with ``statements_for(result)``) before it returns."""
    records: list[CallRecord] = []

    async def answer() -> ChatResult:
        result = await with_fallbacks(ctx, exchange, lambda: exchange.backend.chat(exchange.chat_request()))
        answered_by(ctx, exchange, result.backend)
        if "fallback_from" in exchange.labels:
            result.response["model"] = exchange.target.model
        if not exchange.body.get("tools"):  # nothing for the guard to check
            records.append(exchange.record(status="ok", response=result.response, result_extras=result.extras))
            return result
        return await _guard(ctx, exchange, result, records)

    try:
        # Nobody waits for an answer once its client has gone: the backend's work is cancelled then.
        result = await unless_disconnected(ctx.request.receive, answer())
    except BackendError as exc:
        answered_by(ctx, exchange, exc.backend)
        records.append(exchange.record(status="error", error=exc.message))
        await save(ctx, exchange, records)
        raise as_api_error(exc, exchange) from None
    except ClientDisconnect:
        record_disconnect(ctx, exchange, [*records, exchange.record(
            status="client_disconnected", error="the client closed the connection before the answer")])
        raise
    await save(ctx, exchange, records, statements_for(result) if statements_for else [])
    account(ctx, exchange, records)
    return result


async def open_stream(ctx: RequestContext, exchange: Exchange) -> ChunkStream:
    """Start a streamed completion; errors before the first chunk become ordinary HTTP errors (after a fallback
    model, if one is configured, had its turn)."""
    try:
        stream = await with_fallbacks(ctx, exchange, lambda: exchange.backend.stream(exchange.chat_request()))
    except BackendError as exc:
        answered_by(ctx, exchange, exc.backend)
        await save(ctx, exchange, [exchange.record(status="error", error=exc.message)])
        raise as_api_error(exc, exchange) from None
    answered_by(ctx, exchange, getattr(stream, "backend", None))
    return Renamed(stream, exchange.target.model) if "fallback_from" in exchange.labels else stream


def answered_by(ctx: RequestContext, exchange: Exchange, member: str | None) -> None:
    """Name the pool member that answered (or failed last) in the records and the request's log and metrics."""
    exchange.member = member
    ctx.line.backend = member or exchange.backend.name


async def save(ctx: RequestContext, exchange: Exchange, records: list[CallRecord],
               statements: Statements | None = None) -> None:
    """Commit an exchange's calls (and statements with them); a 502 or 503 when they cannot be recorded."""
    records = [*exchange.failed, *records]
    if exchange.principal.capture and (records or statements):
        try:
            await ctx.gateway.store.write(WriteOp(records=records, statements=statements or []))
        except RecordRejected as exc:
            # Nothing is answered that is not recorded; the other exchanges committed with it are stored.
            raise APIError(502, f"The exchange could not be recorded, so it is not answered: {exc}.",
                           error_type="server_error", code="record_failed", headers=exchange.headers) from None
        except StoreUnavailable:
            raise store_unavailable(exchange.headers) from None


def record_disconnect(ctx: RequestContext, exchange: Exchange, records: list[CallRecord]) -> None:
    """Keep what a client that went away was sent (or nothing, but that it asked), in the background: nobody
    waits for this commit."""
    ctx.line.status_detail = "client_disconnected"
    if exchange.principal.capture:
        gateway = ctx.gateway
        gateway.spawn(gateway.store.write(WriteOp(records=[*exchange.failed, *records])))


async def _guard(ctx: RequestContext, exchange: Exchange, result: ChatResult, records: list[CallRecord]) -> ChatResult:
    """Proxy mode: send invalid tool calls back to the model (up to the configured retries) before the
    client sees them; appends the record of every call made, the first included."""
    schemas = function_schemas(exchange.body.get("tools"))
    sent = exchange.body["messages"]
    # A caller that trains on the tokens it is answered needs the answer to its own messages: checked, not retried.
    retries = 0 if exchange.tokens else ctx.gateway.settings.server.guard_retries
    for attempt in range(retries + 1):
        _one_call_unless_parallel(exchange, result)
        checked = guard.check_message(result.message, schemas) if schemas else []
        invalid = [c for c in checked if not c.valid]
        retry = bool(invalid) and attempt < retries
        records.append(exchange.record(status="ok", response=result.response, result_extras=result.extras,
                                       messages=sent, tool_calls=guard.tool_rows(
                                           checked, "retried" if retry else "returned")))
        if not retry:
            if invalid:
                ctx.line.invalid_tool_calls = len(invalid)
            return result
        sent = guard.retry_messages(sent, result.message, checked)
        result = await exchange.backend.chat(exchange.chat_request({**exchange.body, "messages": sent}))
    return result


def _one_call_unless_parallel(exchange: Exchange, result: ChatResult) -> None:
    """``parallel_tool_calls: false`` allows one tool call a turn; many servers do not take the flag, so the calls a
    backend made past the first are dropped here, before they are checked, recorded or sent."""
    calls = result.message.get("tool_calls")
    if exchange.body.get("parallel_tool_calls") is False and calls and len(calls) > 1:
        result.message["tool_calls"] = calls[:1]


def account(ctx: RequestContext, exchange: Exchange, records: list[CallRecord]) -> None:
    """The tokens and cost of every call an exchange made (a guard's retries too), in the metrics, the request's log
    and its settlement against the caller's limits."""
    prompt = sum(r.prompt_tokens for r in records)
    completion = sum(r.completion_tokens for r in records)
    ctx.gateway.metrics.count_tokens(exchange.parsed.model, prompt, completion)
    costs = [ctx.gateway.pricing.price_record(r) for r in records]
    if prompt or completion:
        ctx.line.prompt_tokens, ctx.line.completion_tokens = prompt, completion
    if any(c is not None for c in costs):
        ctx.line.cost_usd = sum(c for c in costs if c is not None)


class EventTranslator(Protocol):
    """A pure translation of chat chunks into another API's stream events (Responses, Anthropic Messages)."""

    def start(self) -> list[dict[str, Any]]: ...

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]: ...


class Relay:
    """Relays a backend stream: the I/O around a ``ChunkRelay`` (which chunks go now, which wait for the commit),
    with the guard and the records once the stream has ended. The consumer iterates ``chunks()``, always calls
    ``close()`` (which records a client that went away), then ``commit()`` before sending ``held``.
    """

    def __init__(self, ctx: RequestContext, exchange: Exchange, stream: ChunkStream, *, include_usage: bool) -> None:
        self.ctx = ctx
        self.exchange = exchange
        self.stream = stream
        guarded = exchange.parsed.n == 1 and bool(function_schemas(exchange.body.get("tools")))
        self.relay = ChunkRelay(exchange.parsed.n, guarded=guarded, include_usage=include_usage)
        self.failure: BackendError | None = None
        self.records: list[CallRecord] = []
        self.finished = False
        self._ttft_ms: float | None = None

    @property
    def held(self) -> list[dict[str, Any]]:
        return self.relay.held

    @property
    def status(self) -> str:
        return "error" if self.failure is not None else "ok"

    @property
    def error(self) -> str | None:
        return self.failure.message if self.failure is not None else None

    @property
    def error_code(self) -> str | None:
        return self.failure.code if self.failure is not None else None

    @property
    def error_status(self) -> int | None:
        return self.failure.status_code if self.failure is not None else None

    def _completion(self) -> dict[str, Any] | None:
        return self.relay.acc.completion() if self.relay.acc.chunks else None

    async def chunks(self) -> AsyncIterator[dict[str, Any]]:
        exchange = self.exchange
        try:
            async for chunk in self.stream:
                if self._ttft_ms is None and carries_output(chunk):
                    # Every backend's time to first token, measured here alone: the first generated output,
                    # never an empty role chunk a backend sends before it has computed anything.
                    self._ttft_ms = (time.perf_counter() - exchange.started) * 1000
                    self.ctx.gateway.metrics.ttft.labels(exchange.parsed.model).observe(self._ttft_ms / 1000)
                out = self.relay.feed(chunk)
                if out is not None:
                    yield out
        except BackendError as exc:
            self.failure = exc
        self.records = [exchange.record(status=self.status, response=self._completion(), error=self.error,
                                        result_extras=self.stream.extras, ttft_ms=self._ttft_ms)]
        if self.relay.guarded and self.failure is None:
            await self._guard()
        self.finished = True

    async def _guard(self) -> None:
        first = ChatResult(response=self.relay.acc.completion(), extras=self.stream.extras)
        made = len(first.message.get("tool_calls") or ())
        records: list[CallRecord] = []
        try:
            result = await _guard(self.ctx, self.exchange, first, records)
            # Checked and passed: the fragments go out as the backend sent them; else a retry's calls (or the one
            # call of a turn that allows one), whole.
            calls = result.message.get("tool_calls") or []
            self.relay.release_calls(None if result is first and len(calls) == made else calls)
        except BackendError as exc:
            self.failure = exc
            records.append(self.exchange.record(status="error", error=exc.message))
        records[0].ttft_ms = self._ttft_ms
        self.records = records

    async def translated(self, events: EventTranslator) -> AsyncIterator[bytes]:
        """A translated stream's live part: the opening events, then each chunk's events as it comes; the relay is
        closed however it ends. The caller then feeds ``held`` to ``events``, commits, and sends the rest."""
        try:
            yield encode_named_events(events.start())
            async for chunk in self.chunks():
                out = events.feed(chunk)
                if out:
                    yield encode_named_events(out)
        finally:
            await self.close()

    def held_events(self, events: EventTranslator) -> list[dict[str, Any]]:
        """The held chunks as the translation's events: what goes out after the commit."""
        return [event for chunk in self.held for event in events.feed(chunk)]

    async def close(self) -> None:
        """When the client went away mid-stream: stop the upstream and keep what was streamed."""
        if self.finished:
            return
        await self.stream.aclose()
        record_disconnect(self.ctx, self.exchange, [self.exchange.record(
            status="client_disconnected", response=self._completion(),
            error="the client closed the connection mid-stream", result_extras=self.stream.extras,
            ttft_ms=self._ttft_ms)])

    async def commit(self, statements: Statements | None = None) -> None:
        account(self.ctx, self.exchange, self.records)
        if self.status == "error":
            self.ctx.gateway.metrics.errors.labels("backend_error").inc()
        await save(self.ctx, self.exchange, self.records, statements)
