"""The reward engine: weighted signals per trajectory, stored as feedback rows and ``final_reward``.

Signals (``replay/signals.py``) are numbers in [0, 1], or unknown (``None``). Weights come from
``[rewards]`` (``RewardSettings``); a negative weight makes a signal a penalty. The total is

    total = Σ_known w_i · s_i  ×  Σ_all |w_i| / Σ_known |w_i|

over every registered signal with a weight: an unknown signal is left out and the known weights are
scaled up so that their absolute sum equals the absolute sum of all weights (the share each known
signal holds stays the same, whatever the signs). With nothing known the total is NULL; with only
zero weights known it is 0. A trajectory whose task success is unknown is flagged: a feedback row
``success_unknown`` = 1 (else 0), counted in the summary, so training can skip or down-weight it.

Each trajectory keeps its breakdown as feedback rows of source ``reward_engine``: one per signal
(``model_call_seq`` NULL, value NULL and label ``unknown`` when unknown), ``success_unknown``, and
per-step rows for signals that credit steps (``model_call_seq`` = the step's model call). Recomputing
replaces the engine's previous rows in the same transaction that sets ``final_reward``; for the same
data and configuration the results are the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from replay import feedback
from replay.filters import Filters
from replay.model import CONVERSATIONS, Trajectory, content_text
from replay.records import Statement, WriteOp
from replay.settings import RewardSettings
from replay.signals import DEFAULT_STEP_LIMIT, SIGNALS, TrajectoryView
from replay.store import TrajectoryStore
from replay.vocabulary import MAX_STEPS, PENDING_APPROVAL, RUNNING

ENGINE = "reward_engine"
SUCCESS_UNKNOWN = "success_unknown"
# Trajectories still in flight are not scored: their reward would describe half a run.
IN_FLIGHT = frozenset({RUNNING, PENDING_APPROVAL})


class RewardError(ValueError):
    """The engine cannot run as configured (an unknown signal, a signal that failed or misbehaved)."""


@dataclass
class RewardResult:
    trajectory_id: str
    total: float | None
    signals: dict[str, float | None]
    per_step: dict[str, dict[int, float]]  # signal -> {model call seq: value}
    weights: dict[str, float]

    @property
    def success_unknown(self) -> bool:
        return self.signals.get("task_success") is None

    def rows(self) -> list[dict[str, Any]]:
        """The feedback rows (source ``reward_engine``) that store this result."""
        out: list[dict[str, Any]] = []
        for name, value in self.signals.items():
            out.append({"name": name, "value": value, "label": "unknown" if value is None else None,
                        "comment": f"weight {self.weights.get(name, 0.0):g}"})
        out.append({"name": SUCCESS_UNKNOWN, "value": 1.0 if self.success_unknown else 0.0})
        for name, steps in self.per_step.items():
            out.extend({"name": name, "value": value, "model_call_seq": seq} for seq, value in sorted(steps.items()))
        return out


@dataclass
class RewardSummary:
    count: int = 0  # trajectories scored
    skipped: int = 0  # selected but in flight (or gone)
    mean_reward: float | None = None
    unknown_success: int = 0
    signal_means: dict[str, float | None] = field(default_factory=dict)  # over known values
    signal_unknown: dict[str, int] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# -- weights and scoring -----------------------------------------------------------------------------


class StepLimited(Protocol):
    """What the efficiency signal needs of an agent profile (the gateway's ``[[profiles]]`` entries)."""

    name: str
    max_steps: int


def step_limits(profiles: Iterable[StepLimited]) -> dict[str, int]:
    """Each agent profile's ``max_steps``, by name: what the efficiency signal scales an agent run's steps by."""
    return {p.name: p.max_steps for p in profiles}


def signal_weights(settings: RewardSettings | Mapping[str, float]) -> dict[str, float]:
    """A weight for every registered signal (0 for ones the config does not weight).

    A configured weight naming no registered signal is an error: its module was probably not imported.
    """
    configured = settings.weights() if isinstance(settings, RewardSettings) else dict(settings)
    unknown = sorted(n for n in configured if n not in SIGNALS)
    if unknown:
        raise RewardError(f"[rewards] weights signals that are not registered: {', '.join(unknown)} "
                          f"(registered: {', '.join(SIGNALS)}); import the module that registers them")
    return {name: float(configured.get(name, 0.0)) for name in SIGNALS}


def combine(values: Mapping[str, float | None], weights: Mapping[str, float]) -> float | None:
    """The weighted total, unknown signals left out and the known weights renormalised (see the module)."""
    names = sorted(weights)
    known = [n for n in names if values.get(n) is not None]
    if not known:
        return None
    full = sum(abs(weights[n]) for n in names)
    known_abs = sum(abs(weights[n]) for n in known)
    if known_abs == 0:
        return 0.0
    return sum(weights[n] * values[n] for n in known) * (full / known_abs)  # type: ignore[operator]


def _checked(name: str, value: Any, trajectory_id: str) -> float | None:
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number) or not -1e-9 <= number <= 1 + 1e-9:
        raise RewardError(f"signal {name!r} gave {value!r} for trajectory {trajectory_id}; "
                          "a signal gives a number in [0, 1] or None")
    return min(1.0, max(0.0, number))


def score(view: TrajectoryView, settings: RewardSettings | Mapping[str, float]) -> RewardResult:
    """Run every registered signal over one trajectory and weigh them."""
    weights = signal_weights(settings)
    values: dict[str, float | None] = {}
    per_step: dict[str, dict[int, float]] = {}
    for name, fn in SIGNALS.items():
        try:
            values[name] = _checked(name, fn(view), view.id)
            steps = getattr(fn, "per_step", None)
            if steps is not None:
                per_step[name] = {int(seq): v for seq, value in steps(view).items()
                                  if (v := _checked(name, value, view.id)) is not None}
        except RewardError:
            raise
        except Exception as exc:
            raise RewardError(f"signal {name!r} failed on trajectory {view.id}: {exc}") from exc
    return RewardResult(view.id, combine(values, weights), values, per_step, weights)


# -- loading -----------------------------------------------------------------------------------------


def _step_limit(trajectory: Trajectory, step_limits: Mapping[str, int] | None) -> int:
    """The run's own limit where it shows, then its profile's (``step_limits``), then a default."""
    run = trajectory.run
    if run is not None:
        if run.termination_reason == MAX_STEPS and run.steps:
            return run.steps  # it stopped exactly at its (maybe tightened) limit
        limit = (step_limits or {}).get(run.profile)
        if limit:
            return int(limit)
    meta = trajectory.metadata or {}
    limit = meta.get("max_steps") if isinstance(meta, dict) else None
    if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0:
        return limit
    return DEFAULT_STEP_LIMIT


def view_of(t: Trajectory, *, step_limits: Mapping[str, int] | None = None) -> TrajectoryView:
    """Everything signals see of a trajectory. ``step_limits`` maps agent profiles to their ``max_steps``
    (from ``[[profiles]]``)."""
    state = t.run.state if t.run else {}
    steps = t.steps
    last = next((c for c in reversed(t.calls) if c.reply is not None), None)
    messages = [*last.messages, last.reply] if last else list(state.get("messages") or [])
    if state.get("final") is not None:
        final: str | None = state["final"]
    else:
        reply = last.reply if last else None
        final = content_text(reply.get("content")) if reply and not reply.get("tool_calls") else None
    return TrajectoryView(
        id=t.id, source=t.source, status=t.status,
        termination_reason=t.termination_reason or (t.run.termination_reason if t.run else None),
        messages=messages, tool_calls=t.tool_calls, final_answer=final, steps=len(steps),
        step_seqs=[c.seq for c in steps], step_limit=_step_limit(t, step_limits),
        feedback=[f for f in t.feedback if f.source != ENGINE], task_id=t.task_id,
        profile=t.run.profile if t.run else None, metadata=t.metadata)


async def load_view(store: TrajectoryStore, trajectory_id: str, *,
                    step_limits: Mapping[str, int] | None = None) -> TrajectoryView | None:
    """``view_of`` a stored trajectory; None when there is no such trajectory, or it holds no conversation to reward
    (a prompt completed, texts embedded)."""
    t = await store.get_trajectory(trajectory_id, all_tenants=True)
    return None if t is None or t.format not in CONVERSATIONS else view_of(t, step_limits=step_limits)


# -- storing -----------------------------------------------------------------------------------------


def result_statements(result: RewardResult) -> list[Statement]:
    """Replace the engine's rows of a trajectory with ``result`` and set its ``final_reward``."""
    return feedback.replacing(result.trajectory_id, ENGINE, result.rows(), result.total, set_final_reward=True)


async def store_result(store: TrajectoryStore, result: RewardResult) -> None:
    await store.write(WriteOp(statements=result_statements(result)))


class _Totals:
    def __init__(self, weights: dict[str, float]) -> None:
        self.summary = RewardSummary(weights=weights)
        self.rewards: list[float] = []
        self.values: dict[str, list[float]] = {n: [] for n in weights}

    def add(self, result: RewardResult) -> None:
        s = self.summary
        s.count += 1
        s.unknown_success += int(result.success_unknown)
        if result.total is not None:
            self.rewards.append(result.total)
        for name, value in result.signals.items():
            if value is None:
                s.signal_unknown[name] = s.signal_unknown.get(name, 0) + 1
            else:
                self.values.setdefault(name, []).append(value)

    def done(self) -> RewardSummary:
        s = self.summary
        s.mean_reward = math.fsum(self.rewards) / len(self.rewards) if self.rewards else None
        s.signal_means = {n: math.fsum(v) / len(v) if v else None for n, v in self.values.items()}
        s.signal_unknown = {n: s.signal_unknown.get(n, 0) for n in self.values}
        return s


async def recompute(store: TrajectoryStore, filters: Filters, settings: RewardSettings, *,
                    step_limits: Mapping[str, int] | None = None,
                    progress: Callable[[int, int], None] | None = None, batch: int = 64) -> RewardSummary:
    """Score every selected trajectory and store the results (replacing the engine's earlier ones).

    ``progress(done, total)`` is called after each trajectory. Writes go through the store's writer,
    ``batch`` trajectories per transaction. Trajectories still running are skipped.
    """
    weights = signal_weights(settings)  # fails before anything is read when a weight names no signal
    ids = await store.select_ids(filters)
    totals = _Totals(weights)
    pending: list[Statement] = []
    in_batch = 0
    for i, tid in enumerate(ids, 1):
        view = await load_view(store, tid, step_limits=step_limits)
        if view is None or view.status in IN_FLIGHT:
            totals.summary.skipped += 1
        else:
            result = score(view, weights)
            totals.add(result)
            pending.extend(result_statements(result))
            in_batch += 1
            if in_batch >= batch:
                await store.write(WriteOp(statements=pending))
                pending, in_batch = [], 0
        if progress is not None:
            progress(i, len(ids))
    if pending:
        await store.write(WriteOp(statements=pending))
    return totals.done()
