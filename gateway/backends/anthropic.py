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
from dataclasses import dataclass

import structlog
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from gateway.backends.base import BackendError, ChatRequest, ChatResult, ChunkStream
from gateway.backends.openai_compat import ERROR_BODY_BYTES
from gateway.backends.upstream_http import Unreached, UpstreamClient, UpstreamResponse
from gateway.config import BackendSettings

log = structlog.get_logger()

FORWARDED_HEADERS = ("anthropic-version", "anthropic-beta", "anthropic-dangerous-direct-browser-access",
                     "x-claude-code-session-id", "user-agent", "x-app")
DEFAULT_VERSION = "2023-06-01"
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504, 529})
_ANSWER_HEADERS = ("content-type", "request-id", "retry-after")


@dataclass
class Reply:
    """A whole answer, as the upstream sent it."""

    status: int
    headers: dict[str, str]
    body: bytes


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


class _Retryable(Exception):
    def __init__(self, error: BackendError | None = None, response: UpstreamResponse | None = None,
                 body: bytes = b"") -> None:
        self.error = error
        self.response = response
        self.body = body


class AnthropicBackend:
    def __init__(self, settings: BackendSettings) -> None:
        self.settings = settings
        self.name = settings.name
        self.models = list(settings.models)
        self._client: UpstreamClient | None = None

    async def start(self) -> None:
        self._client = UpstreamClient(self.settings)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

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
        return Reply(response.status, _answer_headers(response), content)

    async def open_stream(self, path: str, body: bytes, headers: Mapping[str, str], *, query: str = "") -> EventStream:
        response, refusal = await self._post(path, body, headers, query, stream=True)
        return EventStream(response, self.settings.max_response_bytes, refusal if response.status != 200 else None)

    async def _post(self, path: str, body: bytes, headers: Mapping[str, str], query: str,
                    *, stream: bool) -> tuple[UpstreamResponse, bytes]:
        """The upstream's answer after retries; its whole body unless it is a stream that was accepted."""
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.settings.max_retries + 1),
            wait=wait_exponential_jitter(multiplier=0.05, max=2.0, jitter=0.05),
            retry=retry_if_exception_type(_Retryable),
            reraise=True,
        )
        url = path + (f"?{query}" if query else "")
        sent = self._headers(headers)
        try:
            async for attempt in retrying:
                with attempt:
                    return await self._attempt(url, body, sent, stream)
        except _Retryable as exc:
            if exc.error is not None:
                raise exc.error from None
            assert exc.response is not None
            return exc.response, exc.body  # retried enough: the upstream's own error goes back to the client
        raise AssertionError("unreachable")

    async def _attempt(self, url: str, body: bytes, headers: dict[str, str],
                       stream: bool) -> tuple[UpstreamResponse, bytes]:
        assert self._client is not None, "backend not started"
        try:
            response = await self._client.open("POST", url, body, headers)
            if response.status >= 400:
                content = await response.read(ERROR_BODY_BYTES, truncate=True)
                if response.status in RETRY_STATUSES:
                    log.warning("backend.retry", backend=self.name, status=response.status)
                    raise _Retryable(response=response, body=content)
                return response, content
            if stream:
                return response, b""
            return response, await response.read(self.settings.max_response_bytes)
        except Unreached as exc:
            raise (_Retryable(exc.error) if exc.retry else exc.error) from None

    def _wrong_api(self) -> BackendError:
        return BackendError(f"backend {self.name!r} speaks the Anthropic Messages API: its models are served on "
                            "/v1/messages only", status_code=400, error_type="invalid_request_error",
                            code="wrong_api", param="model")

    async def chat(self, request: ChatRequest) -> ChatResult:
        raise self._wrong_api()

    async def stream(self, request: ChatRequest) -> ChunkStream:
        raise self._wrong_api()
