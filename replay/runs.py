"""Agent runs: each run's resumable state beside its trajectory, the events it passed through, and the
statements a recorder commits with each step, so the store always holds a state the run can resume from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from replay.records import Statement
from replay.vocabulary import TRAJECTORY_STATUSES

if TYPE_CHECKING:
    from replay.store import TrajectoryStore


def _json(value: Any) -> str:
    return orjson.dumps(value, default=str).decode()


@dataclass(frozen=True)
class RunStart:
    run_id: str
    profile: str
    status: str
    state: dict[str, Any]
    source: str
    tenant: str | None
    key_id: str | None
    requested_model: str
    base_model: str | None
    message_count: int
    metadata: dict[str, Any] | None
    at: float


@dataclass(frozen=True)
class RunProgress:
    """A run after a step: its state (its trajectory takes its status)."""

    run_id: str
    status: str
    termination_reason: str | None
    steps: int
    state: dict[str, Any]
    result: dict[str, Any]
    at: float


def start_statements(run: RunStart) -> list[Statement]:
    """The trajectory and the run row of a new run (nothing when they exist: a resumed run)."""
    return [
        ("""INSERT INTO trajectories(id, source, tenant, key_id, requested_model, base_model, status,
                message_count, metadata, created_at, updated_at)
            VALUES (?, ?, ?, ?, ?, ?, 'running', ?, ?, ?, ?) ON CONFLICT DO NOTHING""",
         (run.run_id, run.source, run.tenant, run.key_id, run.requested_model, run.base_model, run.message_count,
          _json(run.metadata) if run.metadata else None, run.at, run.at)),
        ("""INSERT INTO agent_runs(id, profile, status, steps, state, created_at, updated_at)
            VALUES (?, ?, ?, 0, ?, ?, ?) ON CONFLICT DO NOTHING""",
         (run.run_id, run.profile, run.status, _json(run.state), run.at, run.at)),
    ]


def event_statement(run_id: str, *, step: int, state: str, data: Any, at: float) -> Statement:
    return ("INSERT INTO events(trajectory_id, step, state, data, created_at) VALUES (?, ?, ?, ?, ?)",
            (run_id, step, state, _json(data), at))


def decided_call_statement(run_id: str, call_id: str, *, status: str, result: str | None,
                           duration_ms: float | None) -> Statement:
    """A tool call held for approval, once decided (and run, when approved)."""
    return ("UPDATE tool_calls SET status = ?, result = ?, duration_ms = ? WHERE trajectory_id = ? "
            "AND call_id = ? AND status = 'pending_approval'", (status, result, duration_ms, run_id, call_id))


def progress_statements(run: RunProgress) -> list[Statement]:
    if run.status not in TRAJECTORY_STATUSES:
        raise ValueError(f"a run cannot be {run.status!r}")
    return [
        ("""UPDATE agent_runs SET status = ?, termination_reason = ?, steps = ?, state = ?, result = ?,
               updated_at = ? WHERE id = ?""",
         (run.status, run.termination_reason, run.steps, _json(run.state), _json(run.result), run.at, run.run_id)),
        ("UPDATE trajectories SET status = ?, termination_reason = ?, updated_at = ? WHERE id = ?",
         (run.status, run.termination_reason, run.at, run.run_id)),
    ]


def task_statement(trajectory_id: str, *, task_id: str, group_id: str | None, metadata: dict[str, Any]) -> Statement:
    """Label a trajectory with the task it attempted (and the group of attempts it belongs to)."""
    return ("UPDATE trajectories SET task_id = ?, group_id = COALESCE(?, group_id), metadata = ? WHERE id = ?",
            (task_id, group_id, orjson.dumps(metadata).decode(), trajectory_id))


async def get(store: TrajectoryStore, run_id: str) -> dict[str, Any] | None:
    """The run's row with its trajectory's tenant, key and source."""
    rows = await store._select("SELECT r.*, t.tenant, t.key_id, t.source FROM agent_runs r "
                               "JOIN trajectories t ON t.id = r.id WHERE r.id = ?", (run_id,))
    return rows[0] if rows else None


async def mark(store: TrajectoryStore, *, from_status: str, to_status: str, at: float) -> int:
    """Move every run (and its trajectory) in ``from_status`` to ``to_status``; how many runs moved."""
    counts = await store._change([
        ("UPDATE agent_runs SET status = ?, updated_at = ? WHERE status = ?", (to_status, at, from_status)),
        ("UPDATE trajectories SET status = ?, updated_at = ? WHERE status = ? AND id IN "
         "(SELECT id FROM agent_runs)", (to_status, at, from_status))])
    return counts[0]
