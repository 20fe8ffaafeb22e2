"""The training runs pages: every replay-train run newest first, and one run's stages, curves, before/after table
and gate decision. They read the runs' rows in the store (``replay.training_runs``), which the run writes as it goes
wherever it trains, so a run on another host shows here as one on this one would. Admin only: runs train on every
tenant's trajectories."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from starlette.responses import Response

from gateway.console import charts
from gateway.console.app import Page
from gateway.console.gate import gate_of
from gateway.errors import APIError
from replay import training_runs
from replay.training_runs import TrainingRun

PAGE_SIZE = 50


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 20 s``, ``2 h 05 min``."""
    seconds = max(round(seconds), 0)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


@dataclass(frozen=True)
class Listed:
    run: TrainingRun
    seconds: float  # from its start to its last write (to now while it runs)
    gate_passed: bool | None  # None: no gate yet

    @property
    def duration(self) -> str:
        return duration(self.seconds)


@dataclass(frozen=True)
class StageRow:
    stage: str
    seconds: float
    share: float  # of all its stages' seconds
    processed: str


def _seconds(run: TrainingRun, now: float) -> float:
    return (run.updated_at if run.finished else now) - run.created_at


def _gate_passed(run: TrainingRun) -> bool | None:
    gate = (run.metrics or {}).get("gate")
    return bool(gate["passed"]) if gate else None


def stage_rows(stages: list[dict[str, Any]]) -> tuple[list[StageRow], float]:
    """Each stage with its share of the run's time, and that time."""
    total = sum(s.get("seconds") or 0.0 for s in stages)
    rows = [StageRow(stage=s["stage"], seconds=s.get("seconds") or 0.0,
                     share=(s.get("seconds") or 0.0) / total if total else 0.0,
                     processed=", ".join(f"{value:,} {name}" for name, value in s.items()
                                         if name not in ("stage", "seconds")))
            for s in stages]
    return rows, total


def before_after(reports: list[dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """The before/after table's rows: each metric any report has, a value per report, then the episodes."""
    # In the order the reports hold them (the evaluator's): the gateway does not import training.
    names = list(dict.fromkeys(m for r in reports for m in r["metrics"]))
    rows = [(name.replace("_", " "), [_metric(name, r["metrics"].get(name)) for r in reports]) for name in names]
    return rows + [("episodes", [f"{r.get('episodes', 0):,}" for r in reports])]


def _metric(name: str, value: Any) -> str:
    """A rate as a percentage; steps and perplexity as numbers (as ``harness eval`` prints them)."""
    if not isinstance(value, (int, float)):
        return "-" if value is None else str(value)
    return f"{value:.0%}" if name.endswith("_rate") else f"{value:.2f}"


def curves(metrics: dict[str, Any] | None) -> list[charts.Chart]:
    """The run's loss, reward and validation curves, as charts (each empty when the run drew none)."""
    drawn = (metrics or {}).get("curves") or {}
    loss, reward, validation = drawn.get("loss") or [], drawn.get("reward") or [], drawn.get("validation") or []
    return [
        charts.line_chart([y for _, y in loss], xs=[x for x, _ in loss], title="SFT loss", x_label="optimizer step",
                          y_label="loss"),
        charts.line_chart([y for _, y in reward], xs=[x for x, _ in reward], title="RL reward", x_label="RL step",
                          y_label="mean reward"),
        charts.line_chart([(v.get("metrics") or {}).get("success_rate") for v in validation],
                          names=[v["label"] for v in validation], title="Validation success",
                          x_label="checkpoint", y_label="success rate", y_range=(0.0, 1.0),
                          y_format=charts.percent),
    ]


async def list_page(page: Page) -> Response:
    before = page.query("before")
    rows = await training_runs.list_runs(page.gateway.store, before=before, limit=PAGE_SIZE + 1)
    more = len(rows) > PAGE_SIZE
    rows = rows[:PAGE_SIZE]
    now = time.time()
    return page.render("training_runs.html", runs=[Listed(r, _seconds(r, now), _gate_passed(r)) for r in rows],
                       before=before, next_before=rows[-1].id if more else None)


async def show_page(page: Page) -> Response:
    run_id = page.request.path_params["run_id"]
    run = await training_runs.get(page.gateway.store, run_id)
    if run is None:
        raise APIError(404, f"No training run '{run_id}'.", code="not_found")
    metrics = run.metrics or {}
    stages, total = stage_rows(run.stages)
    reports = metrics.get("reports") or []
    return page.render("training_run.html", run=run, duration=duration(_seconds(run, time.time())), stages=stages,
                       stage_seconds=total, charts=curves(metrics), reports=reports,
                       table=before_after(reports) if reports else [], gate=gate_of(metrics),
                       registered=metrics.get("registered"))
