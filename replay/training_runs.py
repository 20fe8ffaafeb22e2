"""Replay-train runs: a row per run, written as it goes (started, each stage as it ends, then completed with its
metrics and the adapter version it registered, or failed with why), so any replica's console can show a run that
trains on another host.

``stages`` holds the run's stage records (``training.stages.Stages.records``); ``metrics`` what the console draws
(``training.run_record`` says what). Both are JSON text.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from replay.records import new_id

if TYPE_CHECKING:
    from replay.store import TrajectoryStore

RUNNING, COMPLETED, FAILED = "running", "completed", "failed"


@dataclass(frozen=True)
class TrainingRun:
    id: str
    name: str
    mode: str
    status: str
    host: str | None
    run_dir: str | None
    stages: list[dict[str, Any]]
    metrics: dict[str, Any] | None
    error: str | None
    adapter_version: int | None
    created_at: float
    updated_at: float

    @property
    def finished(self) -> bool:
        return self.status != RUNNING


def _json(value: Any) -> str:
    return orjson.dumps(value).decode()


def _run(row: dict[str, Any]) -> TrainingRun:
    return TrainingRun(**{**row, "stages": orjson.loads(row["stages"]) if row["stages"] else [],
                          "metrics": orjson.loads(row["metrics"]) if row["metrics"] else None})


async def start(store: TrajectoryStore, *, name: str, mode: str, host: str | None, run_dir: str | None) -> str:
    """A new run, running: its id."""
    run_id, now = new_id(), time.time()
    await store._change([("INSERT INTO training_runs(id, name, mode, status, host, run_dir, stages, created_at, "
                          "updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                          (run_id, name, mode, RUNNING, host, run_dir, "[]", now, now))])
    return run_id


async def record_stages(store: TrajectoryStore, run_id: str, stages: list[dict[str, Any]]) -> None:
    """The stages a running run has ended so far (all of them: each write replaces the last)."""
    # Only while running: a late write must not undo what finishing the run wrote.
    await store._change([("UPDATE training_runs SET stages = ?, updated_at = ? WHERE id = ? AND status = ?",
                          (_json(stages), time.time(), run_id, RUNNING))])


async def finish(store: TrajectoryStore, run_id: str, *, stages: list[dict[str, Any]], metrics: dict[str, Any],
                 adapter_version: int | None) -> None:
    await store._change([("UPDATE training_runs SET status = ?, stages = ?, metrics = ?, adapter_version = ?, "
                          "updated_at = ? WHERE id = ?",
                          (COMPLETED, _json(stages), _json(metrics), adapter_version, time.time(), run_id))])


async def fail(store: TrajectoryStore, run_id: str, *, error: str, stages: list[dict[str, Any]],
               metrics: dict[str, Any] | None = None) -> None:
    """The run stopped: why, and what it had done (``metrics``: the curves it had drawn, if any)."""
    await store._change([("UPDATE training_runs SET status = ?, stages = ?, metrics = ?, error = ?, updated_at = ? "
                          "WHERE id = ?",
                          (FAILED, _json(stages), _json(metrics) if metrics else None, error, time.time(), run_id))])


async def list_runs(store: TrajectoryStore, *, before: str | None = None, limit: int = 50) -> list[TrainingRun]:
    """Runs newest first; ``before``: only those older than that run (the next page)."""
    where, args = ("WHERE id < ? ", (before, limit)) if before else ("", (limit,))
    rows = await store._select(f"SELECT * FROM training_runs {where}ORDER BY id DESC LIMIT ?", args)
    return [_run(row) for row in rows]


async def get(store: TrajectoryStore, run_id: str) -> TrainingRun | None:
    rows = await store._select("SELECT * FROM training_runs WHERE id = ?", (run_id,))
    return _run(rows[0]) if rows else None
