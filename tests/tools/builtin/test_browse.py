import asyncio
import json
from pathlib import Path

import pytest

from gateway.config import ToolsSettings
from tests.tools.conftest import LoopbackServer, Reply
from tools.builtin.browse import build
from tools.context import ToolContext
from tools.executor import execute

pytestmark = pytest.mark.integration

HTML = {"Content-Type": "text/html; charset=utf-8"}


def page(trap: LoopbackServer) -> bytes:
    return f"""<!doctype html><html><head><title>Harbour report</title>
<link rel="preconnect" href="{trap.url('/')}"></head>
<body><h1>Tides</h1><p>High water at 06:12.</p><p style="display:none">hidden words</p>
<img src="logo.png"><img src="{trap.url('/pixel.gif')}">
<iframe src="{trap.url('/frame')}"></iframe>
<script>
document.body.insertAdjacentHTML("beforeend", "<p>Rendered by script.</p>");
fetch("{trap.url('/api')}").catch(() => null);
try {{ new WebSocket("ws://127.0.0.2:{trap.port}/socket"); }} catch (e) {{}}
</script></body></html>""".encode()


async def test_reads_title_and_visible_text_and_blocks_other_addresses(
        site: LoopbackServer, trap: LoopbackServer, settings: ToolsSettings) -> None:
    site.routes["/"] = Reply(200, page(trap), HTML)
    site.routes["/logo.png"] = Reply(200, b"GIF89a", {"Content-Type": "image/gif"})
    async with ToolContext(settings) as context:
        outcome = await execute(build(settings), {"url": site.url("/")}, context)
        assert outcome.status == "ok", outcome.output
        result = json.loads(outcome.output)
        assert result["title"] == "Harbour report" and result["status"] == 200
        assert "Tides" in result["text"] and "High water at 06:12." in result["text"]
        assert "Rendered by script." in result["text"] and "hidden words" not in result["text"]
        assert trap.url("/pixel.gif") in result["blocked_requests"]
        assert "/logo.png" in site.paths()  # allowed subresources load, through the guarded client
        await asyncio.sleep(0.5)  # give a stray request time to arrive, were there one
    assert trap.received == []


async def test_redirects_land_on_the_final_page(site: LoopbackServer, trap: LoopbackServer,
                                                settings: ToolsSettings) -> None:
    site.routes["/start"] = Reply(302, headers={"Location": "/docs/final"})
    site.routes["/docs/final"] = Reply(200, b"<title>Final</title><p>arrived</p><img src='pic.png'>", HTML)
    site.routes["/docs/pic.png"] = Reply(200, b"GIF89a", {"Content-Type": "image/gif"})
    async with ToolContext(settings) as context:
        result = json.loads((await execute(build(settings), {"url": site.url("/start")}, context)).output)
    assert result["url"] == site.url("/docs/final") and result["title"] == "Final" and result["text"] == "arrived"
    assert site.paths().count("/docs/final") == 1 and "/docs/pic.png" in site.paths()


async def test_a_redirect_inside_the_page_to_a_refused_address_is_blocked(
        site: LoopbackServer, trap: LoopbackServer, settings: ToolsSettings) -> None:
    site.routes["/"] = Reply(200, b"<title>T</title><p>text</p><img src='/bounce'>", HTML)
    site.routes["/bounce"] = Reply(302, headers={"Location": "http://169.254.169.254/latest/meta-data/"})
    site.routes["/meta"] = Reply(302, headers={"Location": trap.url("/x")})
    async with ToolContext(settings) as context:
        result = json.loads((await execute(build(settings), {"url": site.url("/")}, context)).output)
        assert result["blocked_requests"] == [site.url("/bounce")]
        outcome = await execute(build(settings), {"url": site.url("/meta")}, context)
    assert outcome.status == "error" and "127.0.0.2 is a loopback address" in outcome.output
    assert trap.received == []


async def test_refused_url_needs_no_browser(trap: LoopbackServer, settings: ToolsSettings) -> None:
    async with ToolContext(settings) as context:
        outcome = await execute(build(settings), {"url": trap.url("/")}, context)
        assert outcome.status == "error"
        assert outcome.output == f"Tool browse failed: refused {trap.url('/')}: 127.0.0.2 is a loopback address"
        assert not context.browser.running
    assert trap.received == []


async def test_browser_is_reused_and_closed(site: LoopbackServer, settings: ToolsSettings) -> None:
    site.routes["/"] = Reply(200, b"<title>One</title><p>x</p>", HTML)
    context = ToolContext(settings)
    spec = build(settings)
    first, second = await asyncio.gather(*(execute(spec, {"url": site.url("/")}, context) for _ in range(2)))
    assert first.status == second.status == "ok" and context.browser.running
    await context.aclose()
    assert not context.browser.running
    again = await execute(spec, {"url": site.url("/")}, context)  # a closed context starts afresh
    assert again.status == "ok"
    await context.aclose()


async def test_missing_chromium_is_a_clear_error(site: LoopbackServer, settings: ToolsSettings) -> None:
    site.routes["/"] = Reply(200, b"<title>x</title>", HTML)
    broken = settings.model_copy(update={"browser_executable": "/nonexistent/chromium"})
    async with ToolContext(broken) as context:
        outcome = await execute(build(broken), {"url": site.url("/")}, context)
    assert outcome.status == "error" and "no Chromium at /nonexistent/chromium" in outcome.output


async def test_broken_chromium_is_a_clear_error(site: LoopbackServer, settings: ToolsSettings,
                                                tmp_path: Path) -> None:
    site.routes["/"] = Reply(200, b"<title>x</title>", HTML)
    fake = tmp_path / "chromium"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    broken = settings.model_copy(update={"browser_executable": str(fake)})
    async with ToolContext(broken) as context:
        outcome = await execute(build(broken), {"url": site.url("/")}, context)
        assert not context.browser.running
    assert outcome.status == "error" and f"could not start Chromium ({fake})" in outcome.output
