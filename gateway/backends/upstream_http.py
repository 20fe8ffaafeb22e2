"""The gateway's HTTP client to model upstreams: one pooled aiohttp session per backend.

aiohttp, not httpx: measured here as a client alone against a fixed nginx answer (bench/upstream_clients.py),
httpx2 spent 0.37 ms of CPU a request at one connection and 0.76 ms at 64, where aiohttp spent 0.11 and 0.06. The
gateway's own cost per request rose with concurrency mostly from that. What the backends need of a client is
small and lives here: open a request and read its answer under a size cap, or stream its bytes; every failure
to reach the upstream becomes the backend error it means, with whether a retry may help.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from gateway.backends.base import BackendError, BackendTimeout, BackendUnavailable, BadGateway
from gateway.config import BackendSettings

T = TypeVar("T")
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
ERROR_BODY_BYTES = 65_536  # of an error response: enough to quote its message


class Unreached(Exception):
    """The exchange with the upstream failed before an answer came: ``error`` to raise, ``retry`` if it may help."""

    def __init__(self, error: BackendError, retry: bool) -> None:
        self.error = error
        self.retry = retry


def transport_failure(backend: str, exc: BaseException) -> Unreached:
    """A timeout once connected is not retried: the upstream may still be working on it, and the client's wait
    must stay bounded."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return Unreached(BackendUnavailable(f"backend {backend!r} did not accept a connection in time"), True)
    if isinstance(exc, asyncio.TimeoutError):  # aiohttp's read timeouts are TimeoutErrors too
        return Unreached(BackendTimeout(f"backend {backend!r} did not answer in time ({type(exc).__name__})"), False)
    return Unreached(BackendUnavailable(f"backend {backend!r} is unreachable: {exc or type(exc).__name__}"), True)


def stream_failure(backend: str, exc: BaseException) -> BackendError:
    """What a stream that failed once under way becomes (never retried: part of it may have reached the client)."""
    if isinstance(exc, asyncio.TimeoutError):
        return BackendTimeout(f"backend {backend!r} stalled mid-stream")
    return BackendUnavailable(f"backend {backend!r} dropped the stream: {exc or type(exc).__name__}")


# What a failed exchange raises: aiohttp's own errors, and the TimeoutErrors of its timeouts.
FAILURES = (aiohttp.ClientError, asyncio.TimeoutError, OSError)


@dataclass
class Reply:
    """A whole answer, as the upstream sent it."""

    status: int
    reason: str
    headers: dict[str, str]
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


class UpstreamResponse:
    """An answer whose body is still to be read: its status and headers, then its bytes (``read`` or iteration)."""

    def __init__(self, response: aiohttp.ClientResponse, backend: str) -> None:
        self._response = response
        self.backend = backend
        self.status = response.status
        self.reason = response.reason or ""
        self.headers = {k.lower(): v for k, v in response.headers.items()}

    async def read(self, limit: int, *, truncate: bool = False) -> bytes:
        """At most ``limit`` bytes of the body, then the response is released; past it, ``BadGateway`` (or, with
        ``truncate``, the first ``limit`` bytes: enough of an error body to quote). ``Unreached`` when the body
        does not come whole."""
        chunks: list[bytes] = []
        size = 0
        try:
            async for chunk in self._response.content.iter_any():
                size += len(chunk)
                if size > limit:
                    if truncate:
                        chunks.append(chunk[:limit - size])
                        break
                    raise BadGateway(f"backend {self.backend!r} sent a response larger than its limit of {limit} "
                                     "bytes (max_response_bytes)")
                chunks.append(chunk)
        except FAILURES as exc:
            raise transport_failure(self.backend, exc) from None
        finally:
            self._response.release()
        return b"".join(chunks)

    async def reply(self, limit: int, *, truncate: bool = False) -> Reply:
        """The whole answer, its body read as ``read`` reads it."""
        return Reply(self.status, self.reason, self.headers, await self.read(limit, truncate=truncate))

    async def iter_bytes(self, limit: int) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive; past ``limit`` bytes in all, ``BadGateway``."""
        size = 0
        try:
            async for data in self._response.content.iter_any():
                size += len(data)
                if size > limit:
                    raise BadGateway(f"backend {self.backend!r} streamed more than its limit of {limit} bytes "
                                     "(max_response_bytes)")
                yield data
        except FAILURES as exc:
            raise stream_failure(self.backend, exc) from None
        finally:
            self._response.release()

    async def aclose(self) -> None:
        # Closed, not released: an unread body must not leave its connection to the next request.
        self._response.close()


class UpstreamClient:
    """One upstream's connection pool, with the backend's timeouts and connection limit."""

    def __init__(self, settings: BackendSettings, headers: Mapping[str, str] | None = None) -> None:
        """Made on the event loop (a backend's ``start``), where its session belongs."""
        s = settings
        self.backend = s.name
        self.base_url = str(s.base_url).rstrip("/")
        # connect: waiting for a pooled connection and making one; sock_read: the longest silence in an answer.
        # trust_env: HTTP(S)_PROXY and NO_PROXY are honoured, as they were with httpx.
        timeout = aiohttp.ClientTimeout(total=None, connect=s.connect_timeout, sock_connect=s.connect_timeout,
                                        sock_read=s.read_timeout)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=s.max_connections, limit_per_host=0, ttl_dns_cache=300),
            timeout=timeout, headers=dict(headers or {}), auto_decompress=True, trust_env=True,
            skip_auto_headers=("User-Agent",))

    async def open(self, method: str, path: str, content: bytes | None = None,
                   headers: Mapping[str, str] | None = None) -> UpstreamResponse:
        """Send a request (``path`` under the base URL, or a whole URL) and return once its headers are in; raises
        ``Unreached`` when no answer came."""
        url = path if "://" in path else self.base_url + path
        try:
            response = await self._session.request(method, url, data=content, headers=headers,
                                                   allow_redirects=False)
        except FAILURES as exc:
            raise transport_failure(self.backend, exc) from None
        return UpstreamResponse(response, self.backend)

    async def aclose(self) -> None:
        await self._session.close()


class Retry(Exception):
    """An attempt failed in a way the next may not: once attempts run out, ``error`` is raised, or else ``last`` (the
    upstream's own answer) is returned."""

    def __init__(self, error: BackendError | None = None, last: Any = None) -> None:
        self.error = error
        self.last = last


class HTTPBackend:
    """What the backends over HTTP share: their settings, one pooled client, and retries with backoff before
    anything has reached the client."""

    def __init__(self, settings: BackendSettings) -> None:
        self.settings = settings
        self.name = settings.name
        self.models = list(settings.models)
        self.apis = frozenset(settings.apis or ())
        self._client: UpstreamClient | None = None

    def client_headers(self) -> dict[str, str]:
        """Headers every request to the upstream carries (its key)."""
        return {}

    async def start(self) -> None:
        self._client = UpstreamClient(self.settings, self.client_headers())

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    @property
    def client(self) -> UpstreamClient:
        assert self._client is not None, "backend not started"
        return self._client

    async def check_health(self) -> None:
        """Probe the upstream (``GET {base_url}/models``, never retried): a ``BackendError`` when it cannot be
        reached or answers a 5xx. Any other answer, a 401 or a 404 included, shows a server that is up."""
        try:
            reply = await (await self.client.open("GET", "/models")).reply(ERROR_BODY_BYTES, truncate=True)
        except Unreached as exc:
            raise exc.error from None
        if reply.status >= 500:
            raise BackendUnavailable(f"backend {self.name!r} answered its health check with {reply.status}")

    async def with_retries(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """``attempt()`` until it returns, raises anything but ``Retry``/``Unreached``, or the attempts run out.
        An ``Unreached`` is retried when a retry may help."""

        async def once() -> T:
            try:
                return await attempt()
            except Unreached as exc:
                raise (Retry(exc.error) if exc.retry else exc.error) from None

        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.settings.max_retries + 1),
            wait=wait_exponential_jitter(multiplier=0.05, max=2.0, jitter=0.05),
            retry=retry_if_exception_type(Retry),
            reraise=True,
        )
        try:
            async for tried in retrying:
                with tried:
                    return await once()
        except Retry as exc:
            if exc.error is not None:
                raise exc.error from None
            return exc.last
        raise AssertionError("unreachable")
