"""The bot's rows: conversations (each one growing trajectory) and the messages users sent.

A message is stored before the platform hears back (so nothing accepted is lost) and moves through
``queued`` (stored) → ``running`` (added to its conversation's trajectory, in the same commit) →
``pending_approval`` | ``answered`` (the reply is stored) → ``delivered`` | ``failed`` (delivery gave up).
An answered message with nowhere to send the reply stays ``answered`` until it is polled.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import orjson

from replay.records import Statement, new_id

if TYPE_CHECKING:
    from replay.store import TrajectoryStore

QUEUED, RUNNING, PENDING_APPROVAL, ANSWERED, DELIVERED, FAILED = (
    "queued", "running", "pending_approval", "answered", "delivered", "failed")


def view(row: dict[str, Any]) -> dict[str, Any]:
    """A message as the API shows it."""
    return {"object": "bot.message", "id": row["id"], "conversation_id": row["conversation_id"],
            "user_id": row["user_id"], "run_id": row["trajectory_id"], "status": row["status"], "reply": row["reply"],
            "harness": orjson.loads(row["harness"]) if row["harness"] else None,
            "created_at": row["created_at"], "updated_at": row["updated_at"]}


async def add(store: TrajectoryStore, *, platform: str, external_id: str | None, conversation_id: str, user_id: str,
              text: str, callback_url: str | None) -> dict[str, Any] | None:
    """Store a new message as ``queued``; None when the platform already sent one with this external id."""
    now = time.time()
    added = await store._change_returning(
        """INSERT INTO bot_messages(id, platform, external_id, conversation_id, user_id, text, callback_url,
               status, created_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
           ON CONFLICT DO NOTHING RETURNING *""",
        (new_id(), platform, external_id, conversation_id, user_id, text, callback_url, QUEUED, now, now))
    return added[0] if added else None


async def seen(store: TrajectoryStore, platform: str, external_id: str) -> bool:
    """Whether the platform's message with this id is stored already (a retry)."""
    return bool(await store._select("SELECT 1 FROM bot_messages WHERE platform = ? AND external_id = ?",
                                    (platform, external_id)))


async def get(store: TrajectoryStore, message_id: str) -> dict[str, Any] | None:
    rows = await store._select("SELECT * FROM bot_messages WHERE id = ?", (message_id,))
    return rows[0] if rows else None


async def of_run(store: TrajectoryStore, trajectory_id: str, statuses: tuple[str, ...]) -> list[dict[str, Any]]:
    marks = ",".join("?" * len(statuses))
    return await store._select(f"SELECT * FROM bot_messages WHERE trajectory_id = ? AND status IN ({marks}) "
                               "ORDER BY created_at", (trajectory_id, *statuses))


async def with_status(store: TrajectoryStore, statuses: tuple[str, ...]) -> list[dict[str, Any]]:
    marks = ",".join("?" * len(statuses))
    return await store._select(f"SELECT * FROM bot_messages WHERE status IN ({marks}) ORDER BY created_at, id",
                               statuses)


async def conversation_run(store: TrajectoryStore, platform: str, conversation_id: str) -> str | None:
    """The trajectory a conversation grows, while it still exists (retention may have deleted it)."""
    rows = await store._select("""SELECT c.trajectory_id FROM bot_conversations c
                                  JOIN agent_runs r ON r.id = c.trajectory_id
                                  WHERE c.platform = ? AND c.conversation_id = ?""", (platform, conversation_id))
    return rows[0]["trajectory_id"] if rows else None


def conversation_statement(message: dict[str, Any], trajectory_id: str) -> Statement:
    return ("""INSERT INTO bot_conversations(platform, conversation_id, trajectory_id, user_id, created_at)
               VALUES (?, ?, ?, ?, ?) ON CONFLICT(platform, conversation_id) DO UPDATE SET
               trajectory_id = excluded.trajectory_id""",
            (message["platform"], message["conversation_id"], trajectory_id, message["user_id"], time.time()))


def running_statement(message_id: str, trajectory_id: str) -> Statement:
    return ("UPDATE bot_messages SET status = ?, trajectory_id = ?, updated_at = ? WHERE id = ?",
            (RUNNING, trajectory_id, time.time(), message_id))


async def set_outcome(store: TrajectoryStore, message_id: str, *, status: str, reply: str | None = None,
                      harness: dict[str, Any] | None = None, model_call_seq: int | None = None,
                      only_from: tuple[str, ...] | None = None) -> dict[str, Any] | None:
    """The message's outcome set, and its row. ``only_from``: only while its status is one of these (None, and
    nothing changed, otherwise: another process answered it first). A delivered reply is never set again."""
    allowed = only_from or (QUEUED, RUNNING, PENDING_APPROVAL, ANSWERED, FAILED)
    rows = await store._change_returning(
        f"""UPDATE bot_messages SET status = ?, reply = COALESCE(?, reply), harness = COALESCE(?, harness),
               model_call_seq = COALESCE(?, model_call_seq), updated_at = ?
               WHERE id = ? AND status IN ({", ".join("?" * len(allowed))}) RETURNING *""",
        (status, reply, orjson.dumps(harness).decode() if harness else None, model_call_seq, time.time(),
         message_id, *allowed))
    if rows or only_from:
        return rows[0] if rows else None
    return await get(store, message_id)


async def claim_delivery(store: TrajectoryStore, message_id: str, *, now: float, until: float) -> bool:
    """Whether this process sends an answered message's reply now: it may, unless another one's claim still runs.
    The claim holds until ``until`` (``renew_delivery`` moves it on while sending); a process stopped mid-way
    leaves the message answered, and its claim runs out for another to take."""
    return bool(await store._change_returning(
        "UPDATE bot_messages SET delivery_claimed_until = ? WHERE id = ? AND status = ? "
        "AND (delivery_claimed_until IS NULL OR delivery_claimed_until <= ?) RETURNING id",
        (until, message_id, ANSWERED, now)))


async def renew_delivery(store: TrajectoryStore, message_id: str, *, until: float) -> None:
    await store._change_returning(
        "UPDATE bot_messages SET delivery_claimed_until = ? WHERE id = ? RETURNING id", (until, message_id))


async def set_delivery(store: TrajectoryStore, message_id: str, *, delivered: bool, attempts: int,
                       error: str | None) -> dict[str, Any]:
    [row] = await store._change_returning(
        "UPDATE bot_messages SET status = ?, attempts = attempts + ?, error = ?, updated_at = ? WHERE id = ? "
        "RETURNING *", (DELIVERED if delivered else FAILED, attempts, error, time.time(), message_id))
    return row
