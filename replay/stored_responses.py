"""Responses API objects kept with ``store: true``, to fetch them or continue with ``previous_response_id``."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import orjson

from replay.records import Statement

if TYPE_CHECKING:
    from replay.store import TrajectoryStore


def statement(response: dict[str, Any], *, trajectory_id: str | None, tenant: str | None,
              messages: list[dict[str, Any]]) -> Statement:
    """The statement keeping a response (and the chat history it ends) with its exchange's commit."""
    return ("INSERT INTO responses(id, trajectory_id, tenant, body, messages, created_at) VALUES (?, ?, ?, ?, ?, ?) "
            "ON CONFLICT(id) DO UPDATE SET trajectory_id = excluded.trajectory_id, tenant = excluded.tenant, "
            "body = excluded.body, messages = excluded.messages, created_at = excluded.created_at",
            (response["id"], trajectory_id, tenant, orjson.dumps(response).decode(),
             orjson.dumps(messages).decode(), time.time()))


async def get(store: TrajectoryStore, response_id: str, *, tenant: str | None,
              all_tenants: bool = False) -> dict[str, Any] | None:
    """``{"body": the response object, "messages": the chat history it ends}``, or None."""
    rows = await store._select("SELECT tenant, body, messages FROM responses WHERE id = ?", (response_id,))
    if not rows or (not all_tenants and rows[0]["tenant"] != tenant):
        return None
    return {"body": orjson.loads(rows[0]["body"]), "messages": orjson.loads(rows[0]["messages"])}
