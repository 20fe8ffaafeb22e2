"""One headless Chromium (Playwright, the system's binary), started on first use and shared by all calls.

Network policy: Chromium fetches nothing by itself. Every request a page makes is intercepted
(``route("**/*")``) and either refused by the SSRF guard or fetched by the guarded httpx client, which
connects to the address it vetted, and handed back with ``route.fulfill``; Chromium never resolves or
connects for those. What interception does not see (WebSockets, preconnects, the redirects Chromium
would follow after a fulfilled 3xx, WebRTC) goes to a proxy that is a bound but never-listening local
port, so it fails; host names Chromium would resolve itself map to nothing, service workers are blocked.

What remains: a page's own JavaScript still runs (it can only reach the network through the routes
above); a redirect followed inside the route handler is served under the URL the page asked for, so a
redirected document's relative links resolve against the first URL (the main document's redirects are
resolved before navigation and do not have this problem).
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
import structlog
from playwright.async_api import Browser, Page, Playwright, Request, Route, async_playwright
from playwright.async_api import Error as PlaywrightError

from tools.net import Fetched, fetch
from tools.settings import ToolsSettings
from tools.spec import ToolError
from tools.ssrf import BlockedURL

log = structlog.get_logger(__name__)

BASE_ARGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-quic",
    "--no-first-run", "--disable-component-update", "--disable-sync",
    "--host-resolver-rules=MAP * ~NOTFOUND",
    "--dns-prefetch-disable",
    "--force-webrtc-ip-handling-policy=disable_non_proxied_udp",
    # By default Chromium bypasses a proxy for loopback; "<-loopback>" sends loopback to it too.
    "--proxy-bypass-list=<-loopback>",
)
_HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "proxy-connection", "upgrade", "te",
                          "trailer", "host", "content-length"})
# httpx negotiates (and undoes) the encoding itself: Chromium's accept-encoding may name codecs httpx lacks,
# and the body Chromium gets back is already decoded.
_REQUEST_DROPPED = _HOP_HEADERS | {"accept-encoding"}
_RESPONSE_DROPPED = _HOP_HEADERS | {"content-encoding"}
MAX_BLOCKED_SHOWN = 20


@dataclass
class GuardedPage:
    """A fresh page in its own browser context, with the guarded routes installed."""

    page: Page
    blocked: list[str] = field(default_factory=list)
    # A response fetched ahead for the next main-frame navigation (the caller's goto), used once.
    document: Fetched | None = None


class BrowserPool:
    """The shared browser: launched lazily, relaunched after a crash, closed by ``aclose``."""

    def __init__(self, settings: ToolsSettings, http_client: Callable[[], httpx.AsyncClient]) -> None:
        self._settings = settings
        self._http_client = http_client
        self._lock = asyncio.Lock()
        self._pages = asyncio.Semaphore(settings.browser_max_pages)
        self._playwright: Playwright | None = None
        self._browser: Browser | None = None
        self._dead_proxy: socket.socket | None = None

    @property
    def running(self) -> bool:
        """Whether a browser process is up (it starts on the first page asked for)."""
        return self._browser is not None and self._browser.is_connected()

    async def _ensure(self) -> Browser:
        async with self._lock:
            if self._browser is not None and self._browser.is_connected():
                return self._browser
            if self._browser is not None:
                log.warning("browser.relaunch", reason="the browser process went away")
            await self._shutdown()
            executable = self._settings.browser_executable
            if not os.access(executable, os.X_OK):
                raise ToolError(
                    f"no Chromium at {executable}; install it (scripts/install.sh) or set [tools] browser_executable")
            # A port bound but never listening refuses every connection: a proxy that lets nothing through.
            self._dead_proxy = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._dead_proxy.bind(("127.0.0.1", 0))
            proxy_port = self._dead_proxy.getsockname()[1]
            try:
                self._playwright = await async_playwright().start()
                self._browser = await self._playwright.chromium.launch(
                    executable_path=executable,
                    args=[*BASE_ARGS, f"--proxy-server=http://127.0.0.1:{proxy_port}"],
                    timeout=self._settings.browser_timeout * 1000,
                )
            except PlaywrightError as exc:
                await self._shutdown()
                raise ToolError(f"could not start Chromium ({executable}): {str(exc).splitlines()[0]}") from None
            log.info("browser.launched", executable=executable, version=self._browser.version)
            return self._browser

    @asynccontextmanager
    async def page(self) -> AsyncIterator[GuardedPage]:
        """A page for one call; its context (cookies, storage) is discarded afterwards."""
        async with self._pages:
            browser = await self._ensure()
            context = await browser.new_context(service_workers="block", accept_downloads=False)
            try:
                page = await context.new_page()
                guarded = GuardedPage(page)

                async def handle(route: Route, request: Request) -> None:
                    await self._handle(route, request, guarded)

                await context.route("**/*", handle)
                yield guarded
            finally:
                try:
                    await context.close()
                except PlaywrightError:
                    pass  # the browser is already gone; nothing left to close

    async def _handle(self, route: Route, request: Request, guarded: GuardedPage) -> None:
        url = request.url
        fetched = None
        main_navigation = request.is_navigation_request() and request.frame == guarded.page.main_frame
        if guarded.document is not None and main_navigation:
            fetched, guarded.document = guarded.document, None
        try:
            if fetched is None:
                client = self._http_client()
                outgoing = client.build_request(
                    request.method, url,
                    headers={k: v for k, v in (await request.all_headers()).items()
                             if k.lower() not in _REQUEST_DROPPED and not k.startswith(":")},
                    content=request.post_data_buffer,
                )
                fetched = await fetch(client, outgoing, max_bytes=self._settings.http_max_bytes,
                                      max_redirects=self._settings.http_max_redirects)
            headers = {k: v for k, v in fetched.response.headers.items() if k.lower() not in _RESPONSE_DROPPED}
            await route.fulfill(status=fetched.response.status_code, headers=headers, body=fetched.body)
        except BlockedURL as exc:
            log.info("browser.request_blocked", url=url, reason=str(exc))
            if len(guarded.blocked) < MAX_BLOCKED_SHOWN:
                guarded.blocked.append(url)
            await _quietly(route.abort("blockedbyclient"))
        except (httpx.HTTPError, ToolError) as exc:
            log.info("browser.request_failed", url=url, error=str(exc))
            await _quietly(route.abort("failed"))
        except PlaywrightError:
            pass  # the page closed while this request was in flight
        except Exception:
            # An unanswered route would stall the page until the call times out.
            log.exception("browser.route_crashed", url=url)
            await _quietly(route.abort("failed"))

    async def _shutdown(self) -> None:
        browser, playwright, proxy = self._browser, self._playwright, self._dead_proxy
        self._browser = self._playwright = self._dead_proxy = None
        if browser is not None:
            try:
                await browser.close()
            except PlaywrightError:
                pass  # it crashed or was closed already
        if playwright is not None:
            await playwright.stop()
        if proxy is not None:
            proxy.close()

    async def aclose(self) -> None:
        """Closes the browser; the next call launches a new one."""
        async with self._lock:
            await self._shutdown()


async def _quietly(action: Awaitable[None]) -> None:
    try:
        await action
    except PlaywrightError:
        pass  # the page closed meanwhile
