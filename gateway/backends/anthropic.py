"""An Anthropic Messages API upstream, passed through: the request's bytes go on as they came, and its answer
comes back byte for byte (thinking signatures, block types this gateway has never heard of), for
``/v1/messages`` alone. It speaks no chat completions.

The upstream's own key (``api_key_env``) goes as ``x-api-key``; the client's key is the gateway's, never
forwarded. The headers that shape the answer (``anthropic-version``, ``anthropic-beta``) are. Connection
errors, 429, 5xx and 529 (overloaded) are retried before anything reached the client; an upstream's error
after that is handed back as it came, in Anthropic's shape, for the client to read.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import structlog

from gateway.backends import upstream_http
from gateway.backends.base import BackendError, ChatRequest, ChatResult, ChunkStream
from gateway.backends.upstream_http import ERROR_BODY_BYTES, HTTPBackend, Reply, Retry, UpstreamResponse

log = structlog.get_logger()

FORWARDED_HEADERS = ("anthropic-version", "anthropic-beta", "anthropic-dangerous-direct-browser-access",
                     "x-claude-code-session-id", "user-agent", "x-app")
DEFAULT_VERSION = "2023-06-01"
RETRY_STATUSES = upstream_http.RETRY_STATUSES | {529}  # 529: Anthropic's "overloaded"
_ANSWER_HEADERS = ("content-type", "request-id", "retry-after")


def _answer_headers(response: UpstreamResponse) -> dict[str, str]:
    return {k: v for k, v in response.headers.items()
            if k in _ANSWER_HEADERS or k.startswith("anthropic-ratelimit-")}


class EventStream:
    """A streamed answer: its bytes as they arrive. A refusal (``status`` not 200) holds its whole body instead."""

    def __init__(self, response: UpstreamResponse, max_bytes: int, refusal: bytes | None = None) -> None:
        self.status = response.status
        self.headers = _answer_headers(response)
        self._response = response
        self._max_bytes = max_bytes
        self._refusal = refusal

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._bytes()

    async def _bytes(self) -> AsyncIterator[bytes]:
        if self._refusal is not None:
            yield self._refusal
            return
        async for data in self._response.iter_bytes(self._max_bytes):
            yield data

    async def aclose(self) -> None:
        await self._response.aclose()


class AnthropicBackend(HTTPBackend):
    def _headers(self, client: Mapping[str, str]) -> dict[str, str]:
        headers = {"content-type": "application/json", "anthropic-version": DEFAULT_VERSION}
        for name in FORWARDED_HEADERS:
            value = client.get(name)
            if value:
                headers[name] = value
        if self.settings.api_key:
            headers["x-api-key"] = self.settings.api_key
        return headers

    async def send(self, path: str, body: bytes, headers: Mapping[str, str], *, query: str = "") -> Reply:
        response, content = await self._post(path, body, headers, query, stream=False)
        return Reply(response.status, response.reason, _answer_headers(response), content)

    async def open_stream(self, path: str, body: bytes, headers: Mapping[str, str], *, query: str = "") -> EventStream:
        response, refusal = await self._post(path, body, headers, query, stream=True)
        return EventStream(response, self.settings.max_response_bytes, refusal if response.status != 200 else None)

    async def _post(self, path: str, body: bytes, headers: Mapping[str, str], query: str,
                    *, stream: bool) -> tuple[UpstreamResponse, bytes]:
        """The upstream's answer after retries; its whole body unless it is a stream that was accepted. Once the
        retries run out, the upstream's own error goes back to the client as it came."""
        url = path + (f"?{query}" if query else "")
        sent = self._headers(headers)

        async def attempt() -> tuple[UpstreamResponse, bytes]:
            response = await self.client.open("POST", url, body, sent)
            if response.status >= 400:
                content = await response.read(ERROR_BODY_BYTES, truncate=True)
                if response.status in RETRY_STATUSES:
                    log.warning("backend.retry", backend=self.name, status=response.status)
                    raise Retry(last=(response, content))
                return response, content
            if stream:
                return response, b""
            return response, await response.read(self.settings.max_response_bytes)

        return await self.with_retries(attempt)

    def _wrong_api(self) -> BackendError:
        return BackendError(f"backend {self.name!r} speaks the Anthropic Messages API: its models are served on "
                            "/v1/messages only", status_code=400, error_type="invalid_request_error",
                            code="wrong_api", param="model")

    async def chat(self, request: ChatRequest) -> ChatResult:
        raise self._wrong_api()

    async def stream(self, request: ChatRequest) -> ChunkStream:
        raise self._wrong_api()
