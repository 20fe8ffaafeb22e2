"""Agent runs: each run's resumable state beside its trajectory, the events it passed through, and the
statements a recorder commits with each step, so the store always holds a state the run can resume from.

A run carries a lease: which gateway process carries it on (``lease_owner``), and until when
(``lease_expires_at``). A process takes it when the run starts or is resumed, renews it while the run goes on,
and releases it in the commit that pauses or ends the run. A lease is free once released (``lease_expires_at``
NULL) or past its time (its holder died or stalled); ``lease_owner`` stays, naming the process that last carried
the run. Only the holder of a run's lease carries it on, so an approval decided on any replica resumes its run
in one process, and a dead replica's runs are taken over by a live one. Times are the processes' own clocks:
replicas' clocks must agree to well within a lease.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from replay.records import Statement
from replay.vocabulary import INTERRUPTED, PENDING_APPROVAL, RUNNING, TRAJECTORY_STATUSES

if TYPE_CHECKING:
    from replay.store import TrajectoryStore


# A run in one of these may be carried on; in any other it is over, and no lease on it is renewed.
UNFINISHED = (RUNNING, PENDING_APPROVAL, INTERRUPTED)


def _json(value: Any) -> str:
    return orjson.dumps(value, default=str).decode()


@dataclass(frozen=True)
class Lease:
    """The leases one process takes: its own id (unique among the store's processes) and how long each lasts."""

    owner: str
    seconds: float


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
    lease: Lease | None = None  # the starting process's: the run is carried on from its first commit


@dataclass(frozen=True)
class RunProgress:
    """A run after a step: its state (its trajectory takes its status), and the lease of the process it ran in."""

    run_id: str
    status: str
    termination_reason: str | None
    steps: int
    state: dict[str, Any]
    result: dict[str, Any]
    at: float
    lease: Lease | None = None


def start_statements(run: RunStart) -> list[Statement]:
    """The trajectory and the run row of a new run (nothing when they exist: a resumed run)."""
    return [
        ("""INSERT INTO trajectories(id, source, tenant, key_id, requested_model, base_model, status,
                message_count, metadata, created_at, updated_at)
            VALUES (?, ?, ?, ?, ?, ?, 'running', ?, ?, ?, ?) ON CONFLICT DO NOTHING""",
         (run.run_id, run.source, run.tenant, run.key_id, run.requested_model, run.base_model, run.message_count,
          _json(run.metadata) if run.metadata else None, run.at, run.at)),
        ("""INSERT INTO agent_runs(id, profile, status, steps, state, created_at, updated_at, lease_owner,
                lease_expires_at)
            VALUES (?, ?, ?, 0, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING""",
         (run.run_id, run.profile, run.status, _json(run.state), run.at, run.at,
          run.lease.owner if run.lease else None, run.at + run.lease.seconds if run.lease else None)),
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
    statements: list[Statement] = [
        ("""UPDATE agent_runs SET status = ?, termination_reason = ?, steps = ?, state = ?, result = ?,
               updated_at = ? WHERE id = ?""",
         (run.status, run.termination_reason, run.steps, _json(run.state), _json(run.result), run.at, run.run_id)),
        ("UPDATE trajectories SET status = ?, termination_reason = ?, updated_at = ? WHERE id = ?",
         (run.status, run.termination_reason, run.at, run.run_id))]
    if run.lease is not None:
        # Going on, a step refreshes the lease (and a conversation's next turn takes it); a pause or an end
        # releases it in the same commit, so a run that stopped is never seen held.
        statements.append(acquire_statement(run.run_id, run.lease, now=run.at) if run.status == RUNNING
                          else release_statement(run.run_id, run.lease.owner))
    return statements


def task_statement(trajectory_id: str, *, task_id: str, group_id: str | None, metadata: dict[str, Any]) -> Statement:
    """Label a trajectory with the task it attempted (and the group of attempts it belongs to)."""
    return ("UPDATE trajectories SET task_id = ?, group_id = COALESCE(?, group_id), metadata = ? WHERE id = ?",
            (task_id, group_id, orjson.dumps(metadata).decode(), trajectory_id))


async def get(store: TrajectoryStore, run_id: str) -> dict[str, Any] | None:
    """The run's row with its trajectory's tenant, key and source."""
    rows = await store._select("SELECT r.*, t.tenant, t.key_id, t.source FROM agent_runs r "
                               "JOIN trajectories t ON t.id = r.id WHERE r.id = ?", (run_id,))
    return rows[0] if rows else None


async def interrupt(store: TrajectoryStore, run_id: str, *, at: float) -> None:
    """A run left ``running`` that nobody can carry on (its profile is gone) is ``interrupted``, as a stop would
    have left it, instead of being taken over again and again."""
    await store._change([
        ("UPDATE agent_runs SET status = ?, updated_at = ? WHERE id = ? AND status = ?",
         (INTERRUPTED, at, run_id, RUNNING)),
        ("UPDATE trajectories SET status = ?, updated_at = ? WHERE id = ? AND status = ?",
         (INTERRUPTED, at, run_id, RUNNING))])


# -- leases ---------------------------------------------------------------------------------------------


def acquire_statement(run_id: str, lease: Lease, *, now: float) -> Statement:
    """Take the run's lease if it is free, expired or already this process's (then it is refreshed)."""
    return ("UPDATE agent_runs SET lease_owner = ?, lease_expires_at = ? WHERE id = ? "
            "AND (lease_expires_at IS NULL OR lease_expires_at <= ? OR lease_owner = ?)",
            (lease.owner, now + lease.seconds, run_id, now, lease.owner))


def release_statement(run_id: str, owner: str) -> Statement:
    """Free the run's lease, if ``owner`` still holds it (one that expired may have been taken since)."""
    return "UPDATE agent_runs SET lease_expires_at = NULL WHERE id = ? AND lease_owner = ?", (run_id, owner)


async def acquire(store: TrajectoryStore, run_id: str, lease: Lease, *, now: float) -> bool:
    """Whether this process now holds the run's lease. One conditional update: of processes racing for a free
    lease, one wins (PostgreSQL re-checks the condition on the row another just changed; SQLite writes one at a
    time)."""
    [changed] = await store._change([acquire_statement(run_id, lease, now=now)])
    return changed == 1


async def release(store: TrajectoryStore, run_id: str, owner: str) -> None:
    await store._change([release_statement(run_id, owner)])


async def renew(store: TrajectoryStore, lease: Lease, *, now: float) -> int:
    """Extend every lease this process holds on an unfinished run, in one statement; how many."""
    [changed] = await store._change([(
        "UPDATE agent_runs SET lease_expires_at = ? WHERE lease_owner = ? AND lease_expires_at IS NOT NULL "
        "AND status IN (?, ?, ?)", (now + lease.seconds, lease.owner, *UNFINISHED))])
    return changed


async def orphaned(store: TrajectoryStore, *, owner: str, now: float) -> list[dict[str, Any]]:
    """Runs ``running`` that no process carries on: ``id``, and the ``lease_owner`` that last carried them. Their
    lease was released (whoever held it let go without ending the run) or expired, though not this process's own:
    it is alive, and a late renewal does not mean it stopped carrying them."""
    return await store._select(
        "SELECT id, lease_owner FROM agent_runs WHERE status = ? AND (lease_expires_at IS NULL "
        "OR (lease_expires_at <= ? AND lease_owner IS NOT ?)) ORDER BY updated_at", (RUNNING, now, owner))
