"""Server-sent events: framing for OpenAI-style streams, and splitting an upstream's bytes into events."""

from __future__ import annotations

import re
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


_EVENT_END = re.compile(rb"\r\n\r\n|\n\n|\r\r")


def split_events(buffer: bytes) -> tuple[list[tuple[bytes, bytes | None]], bytes]:
    """The complete events at the start of ``buffer``, each as its raw bytes (blank line included) and its data
    (the ``data:`` lines' values joined by newlines, or None when it has none: a comment, a bare ``event:``), and
    the bytes of the event not yet complete."""
    events = []
    start = 0
    while match := _EVENT_END.search(buffer, start):
        raw = buffer[start:match.end()]
        start = match.end()
        data = [line[5:].removeprefix(b" ") for line in raw.splitlines() if line.startswith(b"data:")]
        events.append((raw, b"\n".join(data) if data else None))
    return events, buffer[start:]


def parse_events(buffer: bytes) -> tuple[list[tuple[bytes, dict[str, Any] | None]], bytes]:
    """As ``split_events``, each event's data parsed as a JSON object (None when it is not one)."""
    events, rest = split_events(buffer)
    return [(raw, json_object(data)) for raw, data in events], rest


def json_object(data: bytes | None) -> dict[str, Any] | None:
    """``data`` parsed as JSON when it is an object; None for anything else."""
    if data is None:
        return None
    try:
        parsed = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None
