"""http_get: fetches a URL with the guarded client, following redirects one vetted hop at a time."""

from __future__ import annotations

import json
from typing import Any

from tools.builtin.common import URL_PARAMETERS, put_text
from tools.context import ToolContext
from tools.net import fetch
from tools.settings import ToolsSettings
from tools.spec import ToolSpec

_TEXTUAL = ("text/", "application/xml", "application/xhtml", "application/javascript", "application/x-www-form")


def _is_json(content_type: str) -> bool:
    return content_type == "application/json" or content_type.endswith("+json")


async def _run(arguments: dict[str, Any], context: ToolContext) -> dict[str, Any]:
    settings = context.settings
    url = context.guard.check_url(arguments["url"])
    client = context.http_client()
    fetched = await fetch(client, client.build_request("GET", url), max_bytes=settings.http_max_bytes,
                          max_redirects=settings.http_max_redirects)
    response = fetched.response
    content_type = response.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    result: dict[str, Any] = {"status": response.status_code, "content_type": content_type}
    if response.url != url:
        result["url"] = str(response.url)
    if _is_json(content_type) and not fetched.truncated:
        try:
            result["json"] = json.loads(fetched.body)
            return result
        except ValueError:
            pass  # served as JSON but is not; shown as text below
    if content_type and not content_type.startswith(_TEXTUAL) and not _is_json(content_type):
        result["text"] = f"<{len(fetched.body)} bytes of {content_type} not shown>"
        return result
    try:
        text = fetched.body.decode(response.encoding or "utf-8", errors="replace")
    except LookupError:  # a charset Python does not know
        text = fetched.body.decode("utf-8", errors="replace")
    return put_text(result, text, settings.output_cap, cut=fetched.truncated)


def build(settings: ToolsSettings) -> ToolSpec:
    return ToolSpec(
        name="http_get",
        description=(
            "Fetch a public http(s) URL and get its status, content type and body (parsed when JSON, "
            "raw text otherwise, e.g. HTML source). Use browse to read a web page as rendered text."
        ),
        parameters=URL_PARAMETERS,
        run=_run,
        timeout=settings.http_timeout,
        output_cap=settings.output_cap,
        permissions=frozenset({"network"}),
    )
