"""What full-text search indexes: the text each model call adds to its trajectory (``trajectory_text``).

The whole request on a trajectory's first call; on later calls the messages after the last assistant turn (the
user's or the tools' new ones); and the replies. Each message's text is its content and its tool calls' names and
arguments. The writer indexes each call as it commits it; ``backfill`` indexes the calls of a store from before
the index existed (migration 10, on SQLite: a PostgreSQL store never predates it).
"""

from __future__ import annotations

import sqlite3
from typing import Any

import orjson

from replay.model import content_text


def _message_text(message: Any) -> str:
    if not isinstance(message, dict):
        return ""
    parts = [content_text(message.get("content")) or ""]
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            parts.append(f"{function.get('name') or ''} {function.get('arguments') or ''}")
    return "\n".join(p for p in parts if p)


def call_text(seq: int, request_messages: list[Any], replies: list[Any]) -> str:
    """The text call ``seq`` of a trajectory adds to it (see the module doc)."""
    messages = request_messages
    if seq > 0:
        last = max((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "assistant"),
                   default=-1)
        messages = messages[last + 1:]
    return "\n".join(t for t in map(_message_text, [*messages, *replies]) if t)


def backfill(conn: sqlite3.Connection, page: int = 500) -> int:
    """Index every stored call, inside the caller's transaction; how many calls had text."""
    indexed = 0
    after = ""
    while True:
        calls = conn.execute("SELECT id, trajectory_id, seq, request_messages, response_messages FROM model_calls "
                             "WHERE id > ? ORDER BY id LIMIT ?", (after, page)).fetchall()
        if not calls:
            return indexed
        after = calls[-1][0]
        keys = {k for c in calls for column in (c[3], c[4]) if column for k in orjson.loads(column)}
        bodies: dict[str, Any] = {}
        key_list = list(keys)
        for i in range(0, len(key_list), 500):
            chunk = key_list[i:i + 500]
            bodies.update((h, orjson.loads(b)) for h, b in conn.execute(
                f"SELECT hash, body FROM blobs WHERE hash IN ({','.join('?' * len(chunk))})", chunk))
        rows = []
        for _, tid, seq, request, replies in calls:
            text = call_text(seq, [bodies.get(k) for k in orjson.loads(request)],
                             [bodies.get(k) for k in orjson.loads(replies or "[]")])
            if text:
                rows.append((text, tid))
        conn.executemany("INSERT INTO trajectory_text(body, trajectory_id) VALUES (?, ?)", rows)
        indexed += len(rows)
