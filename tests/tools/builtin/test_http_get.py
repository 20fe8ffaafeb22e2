import json

import pytest

from gateway.config import ToolsSettings
from tests.tools.conftest import LoopbackServer, Reply
from tools.builtin.http_get import build
from tools.context import ToolContext
from tools.executor import ToolOutcome, execute

pytestmark = pytest.mark.integration


async def get(settings: ToolsSettings, url: str) -> ToolOutcome:
    async with ToolContext(settings) as context:
        return await execute(build(settings), {"url": url}, context)


async def test_reads_json_and_text(site: LoopbackServer, settings: ToolsSettings) -> None:
    site.routes["/data"] = Reply(200, b'{"answer": 42}', {"Content-Type": "application/json"})
    site.routes["/page"] = Reply(200, "<h1>Grüße</h1>".encode(), {"Content-Type": "text/html; charset=utf-8"})
    site.routes["/logo"] = Reply(200, b"\x89PNG....", {"Content-Type": "image/png"})
    outcome = await get(settings, site.url("/data"))
    assert outcome.status == "ok"
    assert json.loads(outcome.output) == {"status": 200, "content_type": "application/json", "json": {"answer": 42}}
    page = json.loads((await get(settings, site.url("/page"))).output)
    assert page == {"status": 200, "content_type": "text/html", "text": "<h1>Grüße</h1>"}
    logo = json.loads((await get(settings, site.url("/logo"))).output)
    assert logo["text"] == "<8 bytes of image/png not shown>"


async def test_error_statuses_are_results_not_failures(site: LoopbackServer, settings: ToolsSettings) -> None:
    outcome = await get(settings, site.url("/missing"))
    assert outcome.status == "ok" and json.loads(outcome.output)["status"] == 404


async def test_follows_redirects_hop_by_hop(site: LoopbackServer, settings: ToolsSettings) -> None:
    site.routes["/a"] = Reply(301, headers={"Location": "/b"})
    site.routes["/b"] = Reply(302, headers={"Location": site.url("/c")})
    site.routes["/c"] = Reply(200, b"end", {"Content-Type": "text/plain"})
    result = json.loads((await get(settings, site.url("/a"))).output)
    assert result["text"] == "end" and result["url"] == site.url("/c")
    assert site.paths() == ["/a", "/b", "/c"]


async def test_too_many_redirects(site: LoopbackServer, settings: ToolsSettings) -> None:
    site.routes["/loop"] = Reply(302, headers={"Location": "/loop"})
    outcome = await get(settings.model_copy(update={"http_max_redirects": 3}), site.url("/loop"))
    assert outcome.status == "error" and "redirected more than 3 times" in outcome.output
    assert len(site.received) == 4


async def test_redirect_to_cloud_metadata_is_refused(site: LoopbackServer, settings: ToolsSettings) -> None:
    site.routes["/r"] = Reply(302, headers={"Location": "http://169.254.169.254/latest/meta-data/"})
    outcome = await get(settings, site.url("/r"))
    assert outcome.status == "error"
    assert outcome.output == ("Tool http_get failed: refused http://169.254.169.254/latest/meta-data/: "
                              "169.254.169.254 is a cloud metadata address")


@pytest.mark.parametrize("location", ["file:///etc/passwd", "ftp://127.0.0.1/x"])
async def test_redirect_to_other_schemes_is_refused(site: LoopbackServer, settings: ToolsSettings,
                                                    location: str) -> None:
    site.routes["/r"] = Reply(302, headers={"Location": location})
    outcome = await get(settings, site.url("/r"))
    assert outcome.status == "error" and "only http and https URLs may be fetched" in outcome.output


async def test_redirect_to_a_refused_address_never_reaches_it(site: LoopbackServer, trap: LoopbackServer,
                                                              settings: ToolsSettings) -> None:
    site.routes["/r"] = Reply(302, headers={"Location": trap.url("/internal")})
    outcome = await get(settings, site.url("/r"))
    assert outcome.status == "error" and "127.0.0.2 is a loopback address" in outcome.output
    assert trap.received == []


@pytest.mark.parametrize("url", ["http://127.0.0.2/", "http://[::1]/", "http://2130706433/", "http://0x7f000001/",
                                 "http://localhost/", "file:///etc/passwd", "ftp://example.com/"])
async def test_refused_urls(url: str) -> None:
    outcome = await get(ToolsSettings(), url)
    assert outcome.status == "error" and outcome.output.startswith(f"Tool http_get failed: refused {url}")


async def test_not_allow_listed_loopback_server_is_refused(trap: LoopbackServer, settings: ToolsSettings) -> None:
    outcome = await get(settings, trap.url("/"))
    assert outcome.status == "error" and trap.received == []


async def test_large_bodies_are_cut(site: LoopbackServer, settings: ToolsSettings) -> None:
    site.routes["/big"] = Reply(200, b"a" * 5000, {"Content-Type": "text/plain"})
    small = settings.model_copy(update={"http_max_bytes": 1000})
    result = json.loads((await get(small, site.url("/big"))).output)
    assert result["text"] == "a" * 1000 and result["truncated"] is True
    capped = settings.model_copy(update={"output_cap": 800})
    result = json.loads((await get(capped, site.url("/big"))).output)
    assert result["text"] == "a" * 300 and result["truncated"] is True
