"""An upstream whose API the gateway passes through rather than translates: the request's bytes go on as they came
and the answer comes back byte for byte, plain or as the upstream's own event stream.

What differs between such upstreams (which of the client's headers go on, how the upstream's own key is sent,
which statuses are worth a retry, which answer headers come back) is declared by each kind; the client's key is
the gateway's and never forwarded. Connection errors and the retry statuses are retried before anything reached
the client; an upstream's error after that is handed back as it came, for the client to read. Such a backend
speaks no chat completions.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import structlog

from gateway.backends import upstream_http
from gateway.backends.base import BackendError, ChatRequest, ChatResult, ChunkStream
from gateway.backends.upstream_http import ERROR_BODY_BYTES, HTTPBackend, Reply, Retry, UpstreamResponse

log = structlog.get_logger()


class EventStream:
    """A streamed answer: its bytes as they arrive. A refusal (``status`` not 200) holds its whole body instead."""

    def __init__(self, response: UpstreamResponse, headers: dict[str, str], max_bytes: int,
                 refusal: bytes | None = None) -> None:
        self.status = response.status
        self.headers = headers
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


class PassThroughBackend(HTTPBackend):
    """The common part of the pass-through kinds; each sets what the class attributes below name."""

    API = ""  # the API it speaks, as errors name it
    SERVED_ON = ""  # the gateway's paths that serve it
    FORWARDED_HEADERS: tuple[str, ...] = ()  # the client's headers that go on (lower case)
    FORWARDED_PREFIXES: tuple[str, ...] = ()  # ... and every header starting with one of these
    ANSWER_HEADERS: tuple[str, ...] = ("content-type",)  # the upstream's headers that come back
    ANSWER_PREFIXES: tuple[str, ...] = ()
    RETRY_STATUSES: frozenset[int] = upstream_http.RETRY_STATUSES

    def base_headers(self) -> dict[str, str]:
        """What every request carries before the client's forwarded headers (the upstream's key among them)."""
        return {"content-type": "application/json"}

    def _headers(self, client: Mapping[str, str]) -> dict[str, str]:
        headers = self.base_headers()
        for name, value in client.items():
            name = name.lower()
            if value and (name in self.FORWARDED_HEADERS or name.startswith(self.FORWARDED_PREFIXES)):
                headers[name] = value
        return {**headers, **self.key_headers()}

    def key_headers(self) -> dict[str, str]:
        """The upstream's own key, set last: no forwarded header can replace it."""
        return {}

    def answer_headers(self, response: UpstreamResponse) -> dict[str, str]:
        return {k: v for k, v in response.headers.items()
                if k in self.ANSWER_HEADERS or k.startswith(self.ANSWER_PREFIXES)}

    async def send(self, path: str, body: bytes, headers: Mapping[str, str], *, query: str = "") -> Reply:
        response, content = await self._post(path, body, headers, query, stream=False)
        return Reply(response.status, response.reason, self.answer_headers(response), content)

    async def open_stream(self, path: str, body: bytes, headers: Mapping[str, str], *, query: str = "") -> EventStream:
        response, refusal = await self._post(path, body, headers, query, stream=True)
        return EventStream(response, self.answer_headers(response), self.settings.max_response_bytes,
                           refusal if response.status != 200 else None)

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
                if response.status in self.RETRY_STATUSES:
                    log.warning("backend.retry", backend=self.name, status=response.status)
                    raise Retry(last=(response, content))
                return response, content
            if stream:
                return response, b""
            return response, await response.read(self.settings.max_response_bytes)

        return await self.with_retries(attempt)

    def _wrong_api(self) -> BackendError:
        return BackendError(f"backend {self.name!r} speaks the {self.API}: its models are served on "
                            f"{self.SERVED_ON} only", status_code=400, error_type="invalid_request_error",
                            code="wrong_api", param="model")

    async def chat(self, request: ChatRequest) -> ChatResult:
        raise self._wrong_api()

    async def stream(self, request: ChatRequest) -> ChunkStream:
        raise self._wrong_api()
