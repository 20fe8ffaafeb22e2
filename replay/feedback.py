"""Feedback rows: rewards and labels from users, verifiers and the reward engine."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from replay.records import Statement, WriteOp, new_id

if TYPE_CHECKING:
    from replay.store import TrajectoryStore


def statement(trajectory_id: str, *, source: str, name: str, value: float | None = None, label: str | None = None,
              comment: str | None = None, model_call_seq: int | None = None,
              created_at: float | None = None) -> Statement:
    """The statement adding one feedback row (a reward or a label) to a ``WriteOp``.

    It inserts nothing when the trajectory is gone, so a concurrent delete never fails the batch it commits with.
    """
    return ("INSERT INTO feedback(id, trajectory_id, model_call_seq, source, name, value, label, comment, "
            "created_at) SELECT ?, ?, ?, ?, ?, ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM trajectories WHERE id = ?)",
            (new_id(), trajectory_id, model_call_seq, source, name, value, label, comment,
             time.time() if created_at is None else created_at, trajectory_id))


def replacing(trajectory_id: str, source: str, rows: list[dict[str, Any]], final_reward: float | None = None, *,
              set_final_reward: bool = False) -> list[Statement]:
    """Statements replacing every row of ``source`` for a trajectory (recomputing is idempotent) and, with
    ``set_final_reward``, its ``final_reward``. Each row: name, value, label, comment, model_call_seq."""
    now = time.time()
    out: list[Statement] = [("DELETE FROM feedback WHERE trajectory_id = ? AND source = ?", (trajectory_id, source))]
    out.extend(statement(trajectory_id, source=source, name=r["name"], value=r.get("value"), label=r.get("label"),
                         comment=r.get("comment"), model_call_seq=r.get("model_call_seq"), created_at=now)
               for r in rows)
    if set_final_reward:
        # updated_at is left alone: stitching orders a session's trajectories by it.
        out.append(("UPDATE trajectories SET final_reward = ? WHERE id = ?", (final_reward, trajectory_id)))
    return out


async def add(store: TrajectoryStore, trajectory_id: str, *, source: str, name: str, value: float | None = None,
              label: str | None = None, comment: str | None = None, model_call_seq: int | None = None) -> None:
    """Record one feedback row (a user's thumbs, a verifier's verdict, ...) through the writer."""
    await store.write(WriteOp(statements=[statement(
        trajectory_id, source=source, name=name, value=value, label=label, comment=comment,
        model_call_seq=model_call_seq)]))
