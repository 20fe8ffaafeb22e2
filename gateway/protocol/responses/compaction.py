"""Context compaction in the Responses API, as Codex uses it, for backends that cannot compact themselves.

A client compacts a long session in one of three ways: ``POST /v1/responses/compact`` (the history in, a shorter
one out: its user messages and one ``compaction`` item); a ``/v1/responses`` request whose input ends with a
``compaction_trigger`` item, answered with exactly one ``compaction`` output item (what Codex does for providers it
takes for OpenAI's); or an ordinary request whose last message asks the model for a summary (Codex's own
compaction, for any other provider). A native upstream does the first two itself. For a chat backend the gateway
writes the summary with the agent loop's summarizer and hands it out as a ``compaction`` item of its own making:
its ``encrypted_content`` is the summary, encoded, not encrypted (the client already holds everything it says), and
a later request that carries it back gives the chat backend that summary as a user message. A compaction item
another server made is opaque and dropped, as before.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

TRIGGER = "compaction_trigger"
ITEM_TYPES = frozenset({"compaction", "compaction_summary"})  # Codex accepts the second as an alias
# Codex's own compaction: the prompt that asks for the summary, and the opening of the message the summary is then
# handed back in (codex-rs core/templates/compact).
CODEX_CHECKPOINT = "You are performing a CONTEXT CHECKPOINT COMPACTION"
CODEX_SUMMARY = "Another language model started to solve this problem"
SUMMARY_INTRO = "A summary of the conversation so far, written when it was compacted:\n\n"
_OWN = "harness-summary-v1."


def _items(body: dict[str, Any]) -> list[dict[str, Any]]:
    items = body.get("input")
    return [i for i in items if isinstance(i, dict)] if isinstance(items, list) else []


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text") or "" for p in content or () if isinstance(p, dict))


def _user_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    return [i for i in _items(body) if i.get("role") == "user" and i.get("type", "message") == "message"]


def asks_compaction(body: dict[str, Any]) -> bool:
    """A request for one ``compaction`` item: its input ends with a ``compaction_trigger``."""
    items = _items(body)
    return bool(items) and items[-1].get("type") == TRIGGER


def compacts(body: dict[str, Any]) -> bool:
    """A request that compacts its history, by either way a ``/v1/responses`` request can."""
    if asks_compaction(body):
        return True
    users = _user_messages(body)
    return bool(users) and _text(users[-1].get("content")).lstrip().startswith(CODEX_CHECKPOINT)


def is_compacted(body: dict[str, Any]) -> bool:
    """A history that a compaction shortened: it carries a compaction item or Codex's summary message."""
    for item in _items(body):
        if item.get("type") in ITEM_TYPES:
            return True
        if item.get("role") == "user" and _text(item.get("content")).lstrip().startswith(CODEX_SUMMARY):
            return True
    return False


def compaction_item(item_id: str, summary: str) -> dict[str, Any]:
    encoded = base64.urlsafe_b64encode(summary.encode()).decode()
    return {"id": item_id, "type": "compaction", "encrypted_content": _OWN + encoded}


def summary_of(item: dict[str, Any]) -> str | None:
    """The summary in a compaction item this gateway made; None for one made elsewhere (opaque to it)."""
    content = item.get("encrypted_content")
    if not isinstance(content, str) or not content.startswith(_OWN):
        return None
    try:
        return base64.urlsafe_b64decode(content[len(_OWN):].encode()).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None


def summary_message(summary: str) -> dict[str, Any]:
    """The chat message a compaction item of this gateway's stands for."""
    return {"role": "user", "content": SUMMARY_INTRO + summary}


def kept_user_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The user's own messages of a history, which ``/v1/responses/compact`` hands back as they were."""
    return [i for i in _user_messages(body)
            if not _text(i.get("content")).lstrip().startswith((CODEX_CHECKPOINT, CODEX_SUMMARY))]


def compacted_response(response_id: str, created_at: int, output: list[dict[str, Any]],
                       usage: dict[str, Any] | None) -> dict[str, Any]:
    """The answer of ``/v1/responses/compact``."""
    return {"id": response_id, "object": "response.compaction", "created_at": created_at, "output": output,
            "usage": usage}
