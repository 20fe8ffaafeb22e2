"""What the network tools share: their one-URL argument schema, and fitting text under the output cap."""

from __future__ import annotations

from typing import Any

URL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {"url": {"type": "string", "minLength": 1, "description": "an http:// or https:// URL"}},
    "required": ["url"],
    "additionalProperties": False,
}


def put_text(result: dict[str, Any], text: str, cap: int, *, reserved: int = 0, cut: bool = False) -> dict[str, Any]:
    """Add ``text`` under the cap, marking the result truncated when any of it was cut.

    Room is left for the fields around the text, so the executor's cap rarely has to cut the JSON itself.
    """
    limit = max(cap - 500 - reserved, 0)
    if cut or len(text) > limit:
        result["truncated"] = True
    result["text"] = text[:limit]
    return result
