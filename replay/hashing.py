"""Content hashes of messages: exact ones for storage, canonical ones for stitching conversations.

Pure functions. Storage keys hash the exact JSON a client sent, so nothing is lost; stitching hashes a
canonical form, so that a client echoing an assistant message back with cosmetic differences (``content``
null versus absent, reformatted tool-call arguments, extra null fields) still extends its conversation.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import orjson

_DIGEST = 16


def _h(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=_DIGEST).hexdigest()


def exact_json(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS)


def blob_hash(body: bytes) -> str:
    return _h(body)


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                parts.append(orjson.dumps(part, option=orjson.OPT_SORT_KEYS).decode())
        return "".join(parts)
    return orjson.dumps(content, option=orjson.OPT_SORT_KEYS).decode()


def _canonical_arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return arguments
    return arguments


def canonical_message(message: dict[str, Any]) -> dict[str, Any]:
    role = message.get("role")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role,
                           "content": _text(message.get("content"))}
    calls = message.get("tool_calls")
    if calls:
        out["tool_calls"] = [
            {"id": c.get("id"), "name": (c.get("function") or {}).get("name"),
             "arguments": _canonical_arguments((c.get("function") or {}).get("arguments"))}
            for c in calls
        ]
    if message.get("tool_call_id"):
        out["tool_call_id"] = message["tool_call_id"]
    return out


def stitch_hash(message: dict[str, Any]) -> str:
    return _h(orjson.dumps(canonical_message(message), option=orjson.OPT_SORT_KEYS))


def chain(previous: str, message_hash: str) -> str:
    """The hash of a conversation prefix: each step folds in the next message."""
    return _h((previous + message_hash).encode())


def prefix_hashes(messages: Iterable[dict[str, Any]], start: str = "") -> list[str]:
    """``out[i]`` identifies the conversation ``messages[: i + 1]``."""
    out = []
    head = start
    for message in messages:
        head = chain(head, stitch_hash(message))
        out.append(head)
    return out


def anchor_index(messages: list[dict[str, Any]]) -> int:
    """Index of the first user message: system prompt plus first request name a conversation."""
    for i, message in enumerate(messages):
        if message.get("role") == "user":
            return i
    return len(messages) - 1
