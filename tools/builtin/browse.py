"""browse: opens a page in headless Chromium and returns its title and visible text.

The page's network traffic goes through the guarded client (see ``tools.browser``). The main document
is fetched, redirects and all, before navigation, so the page is shown under its final URL.
"""

from __future__ import annotations

import time
from typing import Any

from tools.builtin.common import URL_PARAMETERS, put_text
from tools.context import ToolContext
from tools.net import fetch
from tools.settings import ToolsSettings
from tools.spec import ToolError, ToolSpec

_VISIBLE_TEXT = "() => document.body ? document.body.innerText : ''"


async def _run(arguments: dict[str, Any], context: ToolContext) -> dict[str, Any]:
    settings = context.settings
    started = time.monotonic()
    url = context.guard.check_url(arguments["url"])
    browser = context.browser  # a clear error before any fetch when the [browse] extra is missing
    from playwright.async_api import Error as PlaywrightError
    from playwright.async_api import TimeoutError as PlaywrightTimeout

    client = context.http_client()
    first = await fetch(client, client.build_request("GET", url), max_bytes=settings.http_max_bytes,
                        max_redirects=settings.http_max_redirects)
    final_url = str(first.response.url)
    async with browser.page() as guarded:
        guarded.document = first
        # Most of what is left of the call's time goes to loading; the rest to reading the page.
        budget_ms = max((settings.browser_timeout - (time.monotonic() - started)) * 1000 * 0.8, 1000)
        try:
            await guarded.page.goto(final_url, wait_until="domcontentloaded", timeout=budget_ms)
        except PlaywrightError as exc:
            raise ToolError(f"could not open {final_url}: {str(exc).splitlines()[0]}") from None
        try:
            await guarded.page.wait_for_load_state("load", timeout=budget_ms / 2)
        except PlaywrightTimeout:
            pass  # a slow image or script; the text is there already
        title = await guarded.page.title()
        text = await guarded.page.evaluate(_VISIBLE_TEXT)
        blocked = list(guarded.blocked)
    result: dict[str, Any] = {"url": final_url, "status": first.response.status_code, "title": title}
    if blocked:
        result["blocked_requests"] = blocked
    return put_text(result, text, settings.output_cap, reserved=sum(len(b) for b in blocked))


def build(settings: ToolsSettings) -> ToolSpec:
    return ToolSpec(
        name="browse",
        description=(
            "Open a public web page in a real browser (JavaScript runs) and get its title and visible text. "
            "Requests the page makes to private or local addresses are blocked and listed."
        ),
        parameters=URL_PARAMETERS,
        run=_run,
        timeout=settings.browser_timeout,
        output_cap=settings.output_cap,
        permissions=frozenset({"network", "browser"}),
    )
