"""Tool calls held for a person's approval: holding, listing, deciding and expiring them.

A decision is one conditional update: a call is decided once, and never after it expired.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson

from replay.records import Statement

if TYPE_CHECKING:
    from replay.store import TrajectoryStore

PENDING, APPROVED, DENIED, EXPIRED = "pending", "approved", "denied", "expired"

_SELECT = """SELECT a.*, r.profile, t.tenant FROM approvals a JOIN agent_runs r ON r.id = a.trajectory_id
             JOIN trajectories t ON t.id = a.trajectory_id"""


def _row(row: dict[str, Any]) -> dict[str, Any]:
    return {"object": "approval", **row, "arguments": orjson.loads(row["arguments"])}


def hold_statement(run_id: str, *, approval_id: str, step: int, call_id: str | None, tool: str, arguments: Any,
                   at: float, expires_at: float) -> Statement:
    return ("""INSERT INTO approvals(id, trajectory_id, step, call_id, tool, arguments, status, created_at,
                   expires_at) VALUES (?, ?, ?, ?, ?, ?, 'pending', ?, ?)""",
            (approval_id, run_id, step, call_id, tool, orjson.dumps(arguments, default=str).decode(), at,
             expires_at))


async def list_approvals(store: TrajectoryStore, *, status: str | None = PENDING, trajectory_id: str | None = None,
                         tenant: str | None = None, all_tenants: bool = True) -> list[dict[str, Any]]:
    """Held calls, oldest first: every tenant's, or (``all_tenants`` false) those of ``tenant``'s runs alone, as
    the store's listings scope them."""
    where, args = [], []
    if status is not None:
        where.append("a.status = ?")
        args.append(status)
    if trajectory_id is not None:
        where.append("a.trajectory_id = ?")
        args.append(trajectory_id)
    if not all_tenants:
        where.append("t.tenant IS ?")
        args.append(tenant)
    sql = _SELECT + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY a.created_at, a.id"
    return [_row(r) for r in await store._select(sql, tuple(args))]


async def get_approval(store: TrajectoryStore, approval_id: str) -> dict[str, Any] | None:
    rows = await store._select(_SELECT + " WHERE a.id = ?", (approval_id,))
    return _row(rows[0]) if rows else None


async def decide(store: TrajectoryStore, approval_id: str, *, approve: bool, reason: str | None, by: str,
                 now: float) -> tuple[dict[str, Any] | None, bool]:
    """The approval after the attempt (None when there is no such id), and whether this call decided it."""
    [changed] = await store._change([(
        "UPDATE approvals SET status = ?, reason = ?, decided_by = ?, decided_at = ? "
        "WHERE id = ? AND status = 'pending' AND expires_at > ?",
        (APPROVED if approve else DENIED, reason, by, now, approval_id, now))])
    return await get_approval(store, approval_id), bool(changed)


async def expire(store: TrajectoryStore, now: float) -> int:
    [changed] = await store._change([("UPDATE approvals SET status = ?, decided_at = ? WHERE status = 'pending' "
                                      "AND expires_at <= ?", (EXPIRED, now, now))])
    return changed


async def settled_runs(store: TrajectoryStore) -> list[str]:
    """Runs paused for approval none of whose held calls is still waiting: ready to go on."""
    rows = await store._select("""SELECT r.id FROM agent_runs r WHERE r.status = 'pending_approval' AND NOT EXISTS
                                  (SELECT 1 FROM approvals a WHERE a.trajectory_id = r.id AND a.status = 'pending')
                                  ORDER BY r.updated_at""")
    return [r["id"] for r in rows]


async def decisions(store: TrajectoryStore, run_id: str) -> dict[str, dict[str, Any]]:
    """Approval id -> ``{"status", "reason"}`` for a run's decided calls."""
    rows = await store._select("SELECT id, status, reason FROM approvals WHERE trajectory_id = ? AND status != ?",
                               (run_id, PENDING))
    return {r["id"]: {"status": r["status"], "reason": r["reason"]} for r in rows}


def refusal(row: dict[str, Any]) -> str:
    """Why a decision on ``row`` changed nothing: it was decided already, or it expired (maybe not yet swept)."""
    return f"Approval {row['id']} is already {'expired' if row['status'] == PENDING else row['status']}."
