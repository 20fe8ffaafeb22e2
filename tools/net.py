"""An httpx client that can only reach what the SSRF guard allows, at the very address it vetted.

The check and the connection are one step: a network backend resolves the host through the guard and
opens the TCP connection to a vetted address, while the request keeps the host name in its Host header
and TLS SNI. A rebinding DNS server therefore gets no second look-up to answer differently.
"""

from __future__ import annotations

import asyncio
import ssl
import typing
from dataclasses import dataclass

import httpcore
import httpx

from tools.spec import ToolError
from tools.ssrf import BlockedURL, SSRFGuard


class _GuardedBackend(httpcore.AsyncNetworkBackend):
    def __init__(self, guard: SSRFGuard) -> None:
        self._guard = guard
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: typing.Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                addresses = await self._guard.resolve(host, port)
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"resolving {host} took longer than {timeout}s") from None
        error: Exception | None = None
        for ip in addresses:
            try:
                return await self._inner.connect_tcp(
                    str(ip), port, timeout=timeout, local_address=local_address, socket_options=socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
        raise error or httpcore.ConnectError(f"no address to connect to for {host}")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class GuardedTransport(httpx.AsyncHTTPTransport):
    """``httpx.AsyncHTTPTransport`` whose every connection goes through the SSRF guard.

    httpx has no public way to hand its transport a network backend, so the connection pool is rebuilt
    with one; everything else (request conversion, error mapping) stays httpx's own. Proxies are never
    used: a proxy would make the connection the guard vetted a different one from the request's target.
    """

    def __init__(self, guard: SSRFGuard, *, ssl_context: ssl.SSLContext | None = None,
                 limits: httpx.Limits | None = None) -> None:
        limits = limits or httpx.Limits(max_connections=50, max_keepalive_connections=10)
        super().__init__(trust_env=False, limits=limits)
        self._guard = guard
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=ssl_context or httpx.create_ssl_context(),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=_GuardedBackend(guard),
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        # Scheme and host syntax are refused with a clear reason before any connection is considered.
        self._guard.check_url(request.url)
        try:
            return await super().handle_async_request(request)
        except BlockedURL as exc:
            # The connection only knew the host; the caller wants to hear which URL was refused.
            raise exc.retarget(str(request.url)) from None


def guarded_client(guard: SSRFGuard, *, timeout: float, user_agent: str,
                   ssl_context: ssl.SSLContext | None = None) -> httpx.AsyncClient:
    """A client for network tools: guarded, no redirects followed by itself, no proxies from the environment.

    ``ssl_context`` replaces the default certificate checks (a private CA); verification stays on.
    """
    return httpx.AsyncClient(
        transport=GuardedTransport(guard, ssl_context=ssl_context),
        follow_redirects=False,
        trust_env=False,
        timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
        headers={"User-Agent": user_agent},
    )


@dataclass
class Fetched:
    """A response read (at most ``max_bytes`` of it) after following redirects; ``response.url`` is the last hop."""

    response: httpx.Response
    body: bytes
    truncated: bool
    redirects: int


async def fetch(client: httpx.AsyncClient, request: httpx.Request, *, max_bytes: int, max_redirects: int) -> Fetched:
    """Sends ``request`` and follows redirects one hop at a time, so each hop meets the guard on its own.

    The client must not follow redirects itself; httpx still prepares each next request (method
    changes, credentials dropped across origins) in ``response.next_request``.
    """
    redirects = 0
    while True:
        # Every hop, the first included, passes the guarded transport's checks.
        response = await client.send(request, stream=True)
        if response.next_request is None:
            break
        await response.aclose()
        redirects += 1
        if redirects > max_redirects:
            raise ToolError(f"{response.url} redirected more than {max_redirects} times")
        request = response.next_request
    chunks: list[bytes] = []
    size = 0
    truncated = False
    try:
        async for chunk in response.aiter_bytes():
            chunks.append(chunk)
            size += len(chunk)
            if size > max_bytes:
                truncated = True
                break
    finally:
        await response.aclose()
    return Fetched(response, b"".join(chunks)[:max_bytes], truncated, redirects)
