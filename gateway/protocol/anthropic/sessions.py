"""Claude Code's habits, read from its requests: the session a request belongs to, and whether it is one of its
side requests (a compaction summary, a session title, a topic check, a quota probe), which are no turns of the
session and must not be stitched into its trajectory.

The phrases below follow Claude Code's releases (checked against 2.1.x); a side request that no phrase
recognises is recorded as a turn, never refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from gateway.protocol.anthropic.to_chat import block_text

SESSION_HEADER = "x-claude-code-session-id"
SUMMARY_PHRASE = "create a detailed summary of"  # the compaction prompt, in the last user message
TOPIC_PHRASES = ("new conversation topic", "isNewTopic")  # the topic check's system prompt
QUOTA_TEXT = "quota"  # the quota probe's only message, with max_tokens 1


def session_id(body: dict[str, Any], headers: Mapping[str, str]) -> str | None:
    header = headers.get(SESSION_HEADER)
    if header:
        return header
    user = (body.get("metadata") or {}).get("user_id") if isinstance(body.get("metadata"), dict) else None
    if not isinstance(user, str):
        return None
    if user.startswith("{"):  # 2.x: a JSON object with device, account and session ids
        try:
            value = orjson.loads(user)
        except orjson.JSONDecodeError:
            return None
        found = value.get("session_id") if isinstance(value, dict) else None
        return found if isinstance(found, str) and found else None
    _, marker, rest = user.partition("_session_")  # 1.x: user_<hash>_account_<uuid>_session_<uuid>
    return rest or None if marker else None


def _user_texts(body: dict[str, Any]) -> list[str]:
    return [m["content"] if isinstance(m.get("content"), str) else block_text(m.get("content"))
            for m in body.get("messages") or [] if isinstance(m, dict) and m.get("role") == "user"]


def _json_schema(body: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON Schema the request asks its answer to follow, if any (``output_format`` or ``output_config``)."""
    config = body.get("output_config")
    for fmt in (body.get("output_format"), config.get("format") if isinstance(config, dict) else None):
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            return fmt.get("schema") if isinstance(fmt.get("schema"), dict) else {}
    return None


def side_request_kind(body: dict[str, Any]) -> str | None:
    """``summary``, ``title``, ``topic``, ``quota`` or ``side`` (another tool-free structured request), else None."""
    texts = _user_texts(body)
    if texts and SUMMARY_PHRASE in texts[-1]:
        return "summary"
    system = block_text(body.get("system"))
    schema = _json_schema(body)
    tools = body.get("tools")
    if schema is not None and "title" in (schema.get("properties") or {}):
        return "title"
    if any(phrase in system for phrase in TOPIC_PHRASES):
        return "topic"
    if body.get("max_tokens") == 1 and len(texts) == 1 and texts[0].strip().lower() == QUOTA_TEXT:
        return "quota"
    # A structured answer with no tools to act with is no turn of the session. A turn's system prompt may well
    # mention titles, and a tool-less session's turns carry no tools: neither says "side request" alone.
    if not tools and schema is not None:
        return "side"
    return None
