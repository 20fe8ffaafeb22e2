"""Any OpenAI-compatible upstream (SGLang, vLLM, hosted APIs) over one pooled client (``upstream_http``).

Streams are read event by event (``gateway.protocol.sse.split_events``) as the bytes arrive; an event larger than
1 MiB, or a stream past ``max_response_bytes``, ends it with a 502.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
import structlog

from gateway.backends.base import BackendError, BadGateway, CallExtras, ChatRequest, ChatResult
from gateway.backends.upstream_http import ERROR_BODY_BYTES, RETRY_STATUSES, HTTPBackend, Retry, UpstreamResponse
from gateway.protocol.nesting import MAX_DEPTH, too_deep
from gateway.protocol.sse import split_events

log = structlog.get_logger()

MAX_EVENT_BYTES = 1024 * 1024  # one server-sent event of a stream


def _bounded(answer: dict[str, Any], backend: str) -> None:
    """An answer nested deeper than a request may be could be neither recorded nor sent on."""
    if too_deep(answer) is not None:
        raise BadGateway(f"backend {backend!r} answered with JSON nested more than {MAX_DEPTH} levels deep")


def _upstream_error(response: UpstreamResponse, body: bytes) -> BackendError:
    """Map an upstream error response: its own message where it sent OpenAI's envelope."""
    message = body[:500].decode("utf-8", "replace") or response.reason
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
    if response.status == 429:
        # Passed on as a 429, so clients back off as they would against OpenAI (Codex reads "try again in").
        return BackendError(f"upstream is rate limiting: {message}", status_code=429, error_type="requests",
                            code=code or "rate_limit_exceeded")
    if response.status >= 500:
        status = 503 if response.status == 503 else 502
        return BackendError(f"upstream returned {response.status}: {message}", status_code=status,
                            error_type="backend_error", code=code)
    return BackendError(message, status_code=response.status,
                        error_type=error_type or "invalid_request_error", code=code, param=param)


class OpenAICompatBackend(HTTPBackend):
    """Relays chat completions; retries connection errors, 429 and 5xx before anything reached the client."""

    def client_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.settings.api_key}"} if self.settings.api_key else {}

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

    async def _send(self, body: dict[str, Any], stream: bool,
                    path: str = "/chat/completions") -> tuple[UpstreamResponse, bytes]:
        """The upstream's response, with its whole body when not streaming (read under the size cap)."""
        content = orjson.dumps(body)

        async def attempt() -> tuple[UpstreamResponse, bytes]:
            response = await self.client.open("POST", path, content, {"Content-Type": "application/json"})
            if response.status >= 400:
                error = _upstream_error(response, await response.read(ERROR_BODY_BYTES, truncate=True))
                raise Retry(error) if response.status in RETRY_STATUSES else error
            if stream:
                return response, b""
            # Always read from the socket under its cap, so no body is held beyond it.
            return response, await response.read(self.settings.max_response_bytes)

        return await self.with_retries(attempt)

    async def chat(self, request: ChatRequest) -> ChatResult:
        return ChatResult(response=await self._answer(self._body(request, stream=False), "/chat/completions",
                                                       "choices"))

    async def stream(self, request: ChatRequest) -> UpstreamStream:
        return await self._stream(self._body(request, stream=True), "/chat/completions")

    # The legacy text completions and embeddings, passed through as they came (``apis``).

    async def completions(self, request: ChatRequest) -> ChatResult:
        return ChatResult(response=await self._answer(self._body(request, stream=False), "/completions", "choices"))

    async def stream_completions(self, request: ChatRequest) -> UpstreamStream:
        return await self._stream(self._body(request, stream=True), "/completions")

    async def embeddings(self, request: ChatRequest) -> dict[str, Any]:
        return await self._answer({**request.body, "model": self.upstream_model(request)}, "/embeddings", "data")

    async def _answer(self, body: dict[str, Any], path: str, holds: str) -> dict[str, Any]:
        """A whole answer, which must be a JSON object with the list ``holds``."""
        _, content = await self._send(body, stream=False, path=path)
        return self._parsed(content, holds)

    def _parsed(self, content: bytes, holds: str) -> dict[str, Any]:
        try:
            data = orjson.loads(content)
        except orjson.JSONDecodeError:
            raise BadGateway(f"backend {self.name!r} returned a body that is not JSON") from None
        if not isinstance(data, dict) or not isinstance(data.get(holds), list):
            raise BadGateway(f"backend {self.name!r} returned JSON without '{holds}'")
        _bounded(data, self.name)
        return data

    async def _stream(self, body: dict[str, Any], path: str) -> UpstreamStream:
        response, _ = await self._send(body, stream=True, path=path)
        return UpstreamStream(response, self.name, self.settings.max_response_bytes)


class UpstreamStream:
    """Relays an upstream SSE stream chunk by chunk, never buffering the whole response."""

    def __init__(self, response: UpstreamResponse, backend: str, max_bytes: int) -> None:
        self._response = response
        self._backend = backend
        self._max_bytes = max_bytes
        self.extras = CallExtras()

    def __aiter__(self) -> AsyncIterator[dict[str, Any]]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[dict[str, Any]]:
        pending = b""
        try:
            async for data in self._response.iter_bytes(self._max_bytes):
                events, pending = split_events(pending + data if pending else data)
                if len(pending) > MAX_EVENT_BYTES:
                    raise BadGateway(f"backend {self._backend!r} sent a stream event larger than {MAX_EVENT_BYTES} "
                                     "bytes")
                for _, payload in events:
                    if not payload:
                        continue
                    if payload == b"[DONE]":
                        return
                    yield self._chunk(payload)
        finally:
            await self._response.aclose()

    def _chunk(self, payload: bytes) -> dict[str, Any]:
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            raise BadGateway(f"backend {self._backend!r} sent a stream event that is not JSON") from None
        if not isinstance(chunk, dict):
            raise BadGateway(f"backend {self._backend!r} sent a stream event that is not an object")
        _bounded(chunk, self._backend)
        if "error" in chunk and "choices" not in chunk:
            err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
            raise BackendError(f"backend {self._backend!r} failed mid-stream: {err.get('message')}",
                               code=err.get("code"))
        return chunk

    async def aclose(self) -> None:
        await self._response.aclose()
