"""What tools share while the gateway runs: settings, the SSRF guard, one HTTP client, one browser."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import httpx

from extras import MissingExtra, require_extra
from tools.net import guarded_client
from tools.settings import ToolsSettings
from tools.spec import ToolError
from tools.ssrf import SSRFGuard

if TYPE_CHECKING:
    from tools.browser import BrowserPool


class ToolContext:
    """Handed to every tool call. Expensive resources start on first use; ``aclose`` releases them.

    One context serves all runs of a gateway: the HTTP connection pool and the browser process are
    shared, while each browse call gets its own browser context (no cookies carried between calls).
    """

    def __init__(self, settings: ToolsSettings | None = None, *, guard: SSRFGuard | None = None,
                 own: tuple[tuple[str, int], ...] = ()) -> None:
        """``own``: where the gateway listens (host, port), which no tool may reach."""
        self.settings = settings or ToolsSettings()
        self.guard = guard or SSRFGuard(self.settings.allow_hosts, self.settings.allow_networks, own=own)
        self._http: httpx.AsyncClient | None = None
        # Sends a chat message (recipient, text) through the bot's platform; set by the gateway when it has one.
        self.messenger: Callable[[str, str], Awaitable[None]] | None = None
        self._browser: BrowserPool | None = None

    @property
    def browser(self) -> BrowserPool:
        """The shared browser pool, made on first use: Playwright is an optional extra (``[browse]``)."""
        if self._browser is None:
            try:
                require_extra("browse", "the browse tool")
            except MissingExtra as exc:
                raise ToolError(str(exc)) from None
            from tools.browser import BrowserPool

            self._browser = BrowserPool(self.settings, self.http_client)
        return self._browser

    def http_client(self) -> httpx.AsyncClient:
        """The guarded client network tools must use (never a client of their own)."""
        if self._http is None or self._http.is_closed:
            self._http = guarded_client(
                self.guard, timeout=self.settings.http_timeout, user_agent=self.settings.user_agent)
        return self._http

    async def aclose(self) -> None:
        """Closes the browser and the HTTP client; the context can be used again afterwards."""
        if self._browser is not None:
            await self._browser.aclose()
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def __aenter__(self) -> ToolContext:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
