"""Any OpenAI-compatible upstream (SGLang, vLLM, hosted APIs) over one pooled httpx client.

The client is httpx2, the maintained fork of httpx that the openai SDK itself uses: the same API, but
its connection pool does not degrade under many concurrent requests the way httpx 0.28's does (at 64
concurrent requests it measured about twice httpx 0.28's throughput here). Streams are read with its own
server-sent-events reader, which bounds each event (1 MiB).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx2 as httpx
import orjson
import structlog
from httpx2 import EventSource, SSEError
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from gateway.backends.base import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    BadGateway,
    CallExtras,
    ChatRequest,
    ChatResult,
)
from gateway.config import BackendSettings
from gateway.protocol.nesting import MAX_DEPTH, too_deep

log = structlog.get_logger()

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
ERROR_BODY_BYTES = 65_536  # of an error response: enough to quote its message


class _Retryable(Exception):
    def __init__(self, error: BackendError) -> None:
        self.error = error


def transport_failure(backend: str, exc: httpx.TransportError) -> tuple[BackendError, bool]:
    """What a failed exchange with an upstream becomes, and whether to try again. A timeout once connected is not
    retried: the upstream may still be working on it, and the client's wait must stay bounded."""
    if isinstance(exc, httpx.ConnectTimeout):
        return BackendUnavailable(f"backend {backend!r} did not accept a connection in time"), True
    if isinstance(exc, httpx.TimeoutException):
        return BackendTimeout(f"backend {backend!r} did not answer in time ({type(exc).__name__})"), False
    return BackendUnavailable(f"backend {backend!r} is unreachable: {exc or type(exc).__name__}"), True


def upstream_client(settings: BackendSettings, headers: dict[str, str] | None = None) -> httpx.AsyncClient:
    """A pooled client for one upstream, with the backend's timeouts and connection limit."""
    s = settings
    return httpx.AsyncClient(
        base_url=str(s.base_url).rstrip("/"),
        headers=headers or {},
        timeout=httpx.Timeout(s.read_timeout, connect=s.connect_timeout, pool=s.connect_timeout),
        limits=httpx.Limits(max_connections=s.max_connections, max_keepalive_connections=s.max_connections),
    )


def stream_failure(backend: str, exc: httpx.TransportError) -> BackendError:
    """What a stream that failed once under way becomes (never retried: part of it may have reached the client)."""
    if isinstance(exc, httpx.TimeoutException):
        return BackendTimeout(f"backend {backend!r} stalled mid-stream")
    return BackendUnavailable(f"backend {backend!r} dropped the stream: {exc}")


def _bounded(answer: dict[str, Any], backend: str) -> None:
    """An answer nested deeper than a request may be could be neither recorded nor sent on."""
    if too_deep(answer) is not None:
        raise BadGateway(f"backend {backend!r} answered with JSON nested more than {MAX_DEPTH} levels deep")


def _upstream_error(response: httpx.Response, body: bytes) -> BackendError:
    """Map an upstream error response: its own message where it sent OpenAI's envelope."""
    message = body[:500].decode("utf-8", "replace") or response.reason_phrase
    error_type, code, param = None, None, None
    try:
        data = orjson.loads(body)
        err = data.get("error")
        if isinstance(err, dict):
            message = str(err.get("message") or message)
            error_type, code, param = err.get("type"), err.get("code"), err.get("param")
        elif isinstance(err, str):
            message = err
        elif data.get("object") == "error" and data.get("message"):  # SGLang's errors are not wrapped
            message = str(data["message"])
    except (orjson.JSONDecodeError, AttributeError):
        pass
    if response.status_code == 429:
        # Passed on as a 429, so clients back off as they would against OpenAI (Codex reads "try again in").
        return BackendError(f"upstream is rate limiting: {message}", status_code=429, error_type="requests",
                            code=code or "rate_limit_exceeded")
    if response.status_code >= 500:
        status = 503 if response.status_code == 503 else 502
        return BackendError(f"upstream returned {response.status_code}: {message}", status_code=status,
                            error_type="backend_error", code=code)
    return BackendError(message, status_code=response.status_code,
                        error_type=error_type or "invalid_request_error", code=code, param=param)


class OpenAICompatBackend:
    """Relays chat completions; retries connection errors, 429 and 5xx before anything reached the client."""

    def __init__(self, settings: BackendSettings) -> None:
        self.settings = settings
        self.name = settings.name
        self.models = list(settings.models)
        self._client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        s = self.settings
        self._client = upstream_client(s, {"Authorization": f"Bearer {s.api_key}"} if s.api_key else {})

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    def upstream_model(self, request: ChatRequest) -> str:
        return request.model

    def _body(self, request: ChatRequest, stream: bool) -> dict[str, Any]:
        if request.body.get("constrain_tool_calls"):
            raise BackendError(f"constrain_tool_calls is supported by the embedded model only, not by backend "
                               f"{self.name!r}", status_code=400, error_type="invalid_request_error",
                               param="constrain_tool_calls", code="unsupported_parameter")
        body = {**request.body, "model": self.upstream_model(request), "stream": stream}
        body.pop("constrain_tool_calls", None)
        ceiling = self.settings.max_output_tokens
        if request.max_tokens_ceiling and ceiling and int(body.get("max_tokens") or 0) > ceiling:
            body["max_tokens"] = ceiling
        if stream:
            # Usage is always asked for so it can be recorded; the gateway hides it from clients that did not ask.
            body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
        else:
            body.pop("stream_options", None)
        return body

    async def _send(self, body: dict[str, Any], stream: bool) -> tuple[httpx.Response, bytes]:
        """The upstream's response, with its whole body when not streaming (read under the size cap)."""
        assert self._client is not None, "backend not started"
        content = orjson.dumps(body)
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.settings.max_retries + 1),
            wait=wait_exponential_jitter(multiplier=0.05, max=2.0, jitter=0.05),
            retry=retry_if_exception_type(_Retryable),
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    return await self._attempt(content, stream)
        except _Retryable as exc:
            raise exc.error from None
        raise AssertionError("unreachable")

    async def _attempt(self, content: bytes, stream: bool) -> tuple[httpx.Response, bytes]:
        assert self._client is not None
        request = self._client.build_request(
            "POST", "/chat/completions", content=content, headers={"Content-Type": "application/json"})
        try:
            # Always streamed from the socket, so no body is read beyond its cap.
            response = await self._client.send(request, stream=True)
            if response.status_code >= 400:
                body = await read_body(response, ERROR_BODY_BYTES, self.name, truncate=True)
                error = _upstream_error(response, body)
                if response.status_code in RETRY_STATUSES:
                    raise _Retryable(error)
                raise error
            if stream:
                return response, b""
            return response, await read_body(response, self.settings.max_response_bytes, self.name)
        except httpx.TransportError as exc:
            error, retry = transport_failure(self.name, exc)
            raise (_Retryable(error) if retry else error) from None

    async def chat(self, request: ChatRequest) -> ChatResult:
        _, content = await self._send(self._body(request, stream=False), stream=False)
        try:
            data = orjson.loads(content)
        except orjson.JSONDecodeError:
            raise BadGateway(f"backend {self.name!r} returned a body that is not JSON") from None
        if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
            raise BadGateway(f"backend {self.name!r} returned JSON without 'choices'")
        _bounded(data, self.name)
        return ChatResult(response=data)

    async def stream(self, request: ChatRequest) -> UpstreamStream:
        response, _ = await self._send(self._body(request, stream=True), stream=True)
        return UpstreamStream(response, self.name, self.settings.max_response_bytes)


async def read_body(response: httpx.Response, limit: int, backend: str, *, truncate: bool = False) -> bytes:
    """At most ``limit`` bytes of the body, then the response is closed; past it, ``BadGateway`` (or, with
    ``truncate``, the first ``limit`` bytes: enough of an error body to quote)."""
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > limit:
                if truncate:
                    chunks.append(chunk[:limit - size])
                    break
                raise BadGateway(f"backend {backend!r} sent a response larger than its limit of {limit} bytes "
                                 "(max_response_bytes)")
            chunks.append(chunk)
    finally:
        await response.aclose()
    return b"".join(chunks)


class UpstreamStream:
    """Relays an upstream SSE stream chunk by chunk, never buffering the whole response."""

    def __init__(self, response: httpx.Response, backend: str, max_bytes: int) -> None:
        self._response = response
        self._backend = backend
        self._max_bytes = max_bytes
        self.extras = CallExtras()

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[dict[str, Any]]:
        size = 0
        try:
            async for event in EventSource(self._response):
                if event.data == "[DONE]":
                    return
                if not event.data:
                    continue
                size += len(event.data)
                if size > self._max_bytes:
                    raise BadGateway(f"backend {self._backend!r} streamed more than its limit of {self._max_bytes} "
                                     "bytes (max_response_bytes)")
                try:
                    chunk = orjson.loads(event.data)
                except orjson.JSONDecodeError:
                    raise BadGateway(f"backend {self._backend!r} sent a stream event that is not JSON") from None
                if not isinstance(chunk, dict):
                    raise BadGateway(f"backend {self._backend!r} sent a stream event that is not an object")
                _bounded(chunk, self._backend)
                if "error" in chunk and "choices" not in chunk:
                    err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
                    raise BackendError(f"backend {self._backend!r} failed mid-stream: {err.get('message')}",
                                       code=err.get("code"))
                yield chunk
        except SSEError as exc:
            raise BadGateway(f"backend {self._backend!r} sent no usable event stream: {exc}") from None
        except httpx.TransportError as exc:
            raise stream_failure(self._backend, exc) from None
        finally:
            await self._response.aclose()

    async def aclose(self) -> None:
        await self._response.aclose()
