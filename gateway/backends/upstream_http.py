"""The gateway's HTTP client to model upstreams: one pooled aiohttp session per backend.

aiohttp, not httpx: measured here as a client alone against a fixed nginx answer (bench/upstream_clients.py),
httpx2 spent 0.37 ms of CPU a request at one connection and 0.76 ms at 64, where aiohttp spent 0.11 and 0.06. The
gateway's own cost per request rose with concurrency mostly from that. What the backends need of a client is
small and lives here: open a request and read its answer under a size cap, or stream its bytes; every failure
to reach the upstream becomes the backend error it means, with whether a retry may help.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import aiohttp

from gateway.backends.base import BackendError, BackendTimeout, BackendUnavailable, BadGateway
from gateway.config import BackendSettings


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
        self.backend = settings.name
        self.base_url = str(settings.base_url).rstrip("/")
        self._settings = settings
        self._headers = dict(headers or {})
        self._session: aiohttp.ClientSession | None = None

    def _open_session(self) -> aiohttp.ClientSession:
        s = self._settings
        if self._session is None:
            # connect: waiting for a pooled connection and making one; sock_read: the longest silence in an answer.
            # trust_env: HTTP(S)_PROXY and NO_PROXY are honoured, as they were with httpx.
            timeout = aiohttp.ClientTimeout(total=None, connect=s.connect_timeout, sock_connect=s.connect_timeout,
                                            sock_read=s.read_timeout)
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=s.max_connections, limit_per_host=0, ttl_dns_cache=300),
                timeout=timeout, headers=self._headers, auto_decompress=True, trust_env=True,
                skip_auto_headers=("User-Agent",))
        return self._session

    async def open(self, method: str, path: str, content: bytes | None = None,
                   headers: Mapping[str, str] | None = None) -> UpstreamResponse:
        """Send a request (``path`` under the base URL, or a whole URL) and return once its headers are in; raises
        ``Unreached`` when no answer came."""
        url = path if "://" in path else self.base_url + path
        try:
            response = await self._open_session().request(method, url, data=content, headers=headers,
                                                           allow_redirects=False)
        except FAILURES as exc:
            raise transport_failure(self.backend, exc) from None
        return UpstreamResponse(response, self.backend)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
