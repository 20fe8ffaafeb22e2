"""Tool calls held for a person's approval (the ``approvals`` table): listing, deciding and expiring them.

The agent loop holds the calls and the recorder writes the rows with the run's state; a decision is one
conditional update (a call is decided once, and never after it expired), and ``AgentService`` resumes the run
once all the calls it holds are decided.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.agent.loop import APPROVED, DENIED, EXPIRED
from replay.store import TrajectoryStore

PENDING = "pending"
_SELECT = """SELECT a.*, r.profile, t.tenant FROM approvals a JOIN agent_runs r ON r.id = a.trajectory_id
             JOIN trajectories t ON t.id = a.trajectory_id"""


def _row(row: dict[str, Any]) -> dict[str, Any]:
    return {"object": "approval", **row, "arguments": orjson.loads(row["arguments"])}


async def list_approvals(store: TrajectoryStore, *, status: str | None = PENDING,
                         trajectory_id: str | None = None) -> list[dict[str, Any]]:
    where, args = [], []
    if status is not None:
        where.append("a.status = ?")
        args.append(status)
    if trajectory_id is not None:
        where.append("a.trajectory_id = ?")
        args.append(trajectory_id)
    sql = _SELECT + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY a.created_at, a.id"
    return [_row(r) for r in await store.query(sql, tuple(args))]


async def get_approval(store: TrajectoryStore, approval_id: str) -> dict[str, Any] | None:
    rows = await store.query(_SELECT + " WHERE a.id = ?", (approval_id,))
    return _row(rows[0]) if rows else None


async def decide(store: TrajectoryStore, approval_id: str, *, approve: bool, reason: str | None, by: str,
                 now: float) -> tuple[dict[str, Any] | None, bool]:
    """The approval after the attempt (None when there is no such id), and whether this call decided it."""
    changed = await store.execute(
        "UPDATE approvals SET status = ?, reason = ?, decided_by = ?, decided_at = ? "
        "WHERE id = ? AND status = 'pending' AND expires_at > ?",
        (APPROVED if approve else DENIED, reason, by, now, approval_id, now))
    return await get_approval(store, approval_id), bool(changed)


def refusal(row: dict[str, Any]) -> str:
    """Why a decision on ``row`` changed nothing: it was decided already, or it expired (maybe not yet swept)."""
    return f"Approval {row['id']} is already {'expired' if row['status'] == PENDING else row['status']}."


async def expire(store: TrajectoryStore, now: float) -> int:
    return await store.execute("UPDATE approvals SET status = ?, decided_at = ? WHERE status = 'pending' "
                               "AND expires_at <= ?", (EXPIRED, now, now))


async def settled_runs(store: TrajectoryStore) -> list[str]:
    """Runs paused for approval none of whose held calls is still waiting: ready to go on."""
    rows = await store.query("""SELECT r.id FROM agent_runs r WHERE r.status = 'pending_approval' AND NOT EXISTS
                                (SELECT 1 FROM approvals a WHERE a.trajectory_id = r.id AND a.status = 'pending')
                                ORDER BY r.updated_at""")
    return [r["id"] for r in rows]


async def decisions(store: TrajectoryStore, run_id: str) -> dict[str, dict[str, Any]]:
    """Approval id -> ``{"status", "reason"}`` for a run's decided calls."""
    rows = await store.query("SELECT id, status, reason FROM approvals WHERE trajectory_id = ? AND status != ?",
                             (run_id, PENDING))
    return {r["id"]: {"status": r["status"], "reason": r["reason"]} for r in rows}
