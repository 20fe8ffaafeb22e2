"""Server-sent events framing for OpenAI-style streams."""

from __future__ import annotations

from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"


def encode_event(payload: dict[str, Any]) -> bytes:
    """One ``data:`` frame; orjson never emits raw newlines, so a single line is always enough."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def encode_named_event(event_type: str, payload: dict[str, Any]) -> bytes:
    """An ``event:`` line naming the event, then its ``data:`` line, as OpenAI frames Responses streams."""
    if "\n" in event_type or "\r" in event_type:
        raise ValueError("an SSE event type cannot contain a line break")
    return b"event: " + event_type.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def encode_named_events(events: list[dict[str, Any]]) -> bytes:
    """Events that name their own type (``{"type": ...}``, as Responses and Anthropic streams do), framed in order."""
    return b"".join(encode_named_event(e["type"], e) for e in events)
