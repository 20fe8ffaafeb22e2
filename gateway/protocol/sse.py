"""Server-sent events framing for OpenAI-style streams."""

from __future__ import annotations

from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"


def encode_event(payload: dict[str, Any]) -> bytes:
    """One ``data:`` frame; orjson never emits raw newlines, so a single line is always enough."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"
