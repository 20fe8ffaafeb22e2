"""A replay-train run as the store keeps it (``replay.training_runs``): its row is started with the run, given
each stage as it ends, and finished with what the console draws, or failed with why.

``metrics`` of a finished run:

- ``curves.loss``: SFT's loss, ``[step, loss]`` per optimizer step;
- ``curves.reward``: RL's mean training reward, ``[step, reward]`` per step;
- ``curves.validation``: every validation in run order (SFT's checkpoints, correction and expert rounds, RL's
  checkpoints), each ``{"label", "stage", "metrics", "action"}``;
- ``reports``: the before/after table, one ``{"role", "model", "metrics", "episodes", "seconds"}`` per model
  (reference, "before RL" where RL started from neither, candidate);
- ``gate``: the gate's decision (``Decision.as_dict``); ``registered``: the version it became; ``rl``,
  ``expert``, ``correction``: what those stages did.

Curves longer than ``MAX_POINTS`` are stored averaged over equal runs of steps.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from replay import training_runs
from replay.settings import StoreSettings
from replay.store import TrajectoryStore

if TYPE_CHECKING:
    from replay.adapters import AdapterVersion
    from training.evaluate import Report
    from training.gate import Decision

log = structlog.get_logger()

MAX_POINTS = 500
Point = tuple[float, float]


def downsample(points: Sequence[Point], limit: int = MAX_POINTS) -> list[list[float]]:
    """``points`` as they are when there are at most ``limit``, else ``limit`` means of equal runs of them: a noisy
    loss keeps its trend, which every n-th point alone would not."""
    if len(points) <= limit:
        return [[x, y] for x, y in points]
    out = []
    for i in range(limit):
        bucket = points[i * len(points) // limit:(i + 1) * len(points) // limit]
        out.append([sum(x for x, _ in bucket) / len(bucket), sum(y for _, y in bucket) / len(bucket)])
    return out


class RunRecord:
    """One run's row. Writing it never stops the run: a store that cannot be written to loses the console its view
    of the run, while the run's folder and the registry still get its results; stopping would throw away the
    training done so far for the sake of a report."""

    def __init__(self, store: StoreSettings, run_id: str | None) -> None:
        self.store = store
        self.run_id = run_id
        self.curves: dict[str, list[Any]] = {"loss": [], "reward": [], "validation": []}
        self._stage_writes: list[asyncio.Task[None]] = []
        self._lock = asyncio.Lock()  # one write at a time, so the last one written is the newest

    @classmethod
    async def start(cls, store: StoreSettings, *, name: str, mode: str, run_dir: Path) -> RunRecord:
        record = cls(store, None)
        record.run_id = await record._write(training_runs.start, name=name, mode=mode, host=socket.gethostname(),
                                            run_dir=str(run_dir))
        return record

    # -- what the run learns as it goes -------------------------------------------------------------------------

    def sft(self, losses: Sequence[float], validation: Sequence[Report]) -> None:
        self.curves["loss"] = downsample([(step, loss) for step, loss in enumerate(losses, 1)])
        self.curves["validation"] += [{"label": r.model, "stage": "sft", "metrics": r.metrics, "action": None}
                                      for r in validation]

    def rounds(self, stage: str, rounds: Sequence[dict[str, Any]]) -> None:
        """The validations of a stage that goes in rounds (``correction``, ``expert``)."""
        self.curves["validation"] += [{"label": f"{stage} round {r['round']}", "stage": stage,
                                       "metrics": r["validation"], "action": r["action"]}
                                      for r in rounds if "validation" in r]

    def rl(self, history: Sequence[dict[str, Any]], validations: Sequence[dict[str, Any]]) -> None:
        self.curves["reward"] = downsample([(line["step"], line["reward"]) for line in history
                                            if line.get("reward") is not None])
        self.curves["validation"] += [{"label": f"RL step {v['step']}", "stage": "rl", "metrics": v["metrics"],
                                       "action": v["action"]} for v in validations]

    # -- writing --------------------------------------------------------------------------------------------------

    def stage_ended(self, stages: list[dict[str, Any]]) -> None:
        """``Stages``' callback: the row gets the stages so far, written beside the run so it never waits on it."""
        self._stage_writes = [t for t in self._stage_writes if not t.done()]
        self._stage_writes.append(asyncio.get_running_loop().create_task(self._write_stages(stages)))

    async def _write_stages(self, stages: list[dict[str, Any]]) -> None:
        async with self._lock:
            await self._update(training_runs.record_stages, stages=list(stages))

    async def finish(self, stages: list[dict[str, Any]], *, reports: Sequence[Report], decision: Decision,
                     registered: AdapterVersion, published: bool, rl: dict[str, Any] | None,
                     expert: list[dict[str, Any]] | None,
                     correction: list[dict[str, Any]] | None = None) -> None:
        """``reports``: the reference's first, the candidate's last; ``rl``, ``expert``, ``correction``: what those
        stages did."""
        roles = ["reference", *["before RL"] * (len(reports) - 2), "candidate"]
        metrics = {"curves": self.curves,
                   "reports": [{"role": role, "model": r.model, "metrics": r.metrics, "episodes": len(r.episodes),
                                "seconds": round(r.seconds, 1)} for role, r in zip(roles, reports, strict=True)],
                   "gate": decision.as_dict(),
                   "registered": {"name": registered.name, "version": registered.version,
                                  "status": registered.status, "published": published}}
        metrics.update({k: v for k, v in (("rl", rl), ("expert", expert), ("correction", correction)) if v is not None})
        await self._settle()
        await self._update(training_runs.finish, stages=list(stages), metrics=metrics,
                           adapter_version=registered.version)

    async def fail(self, error: BaseException, stages: list[dict[str, Any]]) -> None:
        message = str(error) or type(error).__name__
        drawn = {"curves": self.curves} if any(self.curves.values()) else None
        await self._settle()
        await self._update(training_runs.fail, error=message, stages=list(stages), metrics=drawn)

    async def _settle(self) -> None:
        await asyncio.gather(*self._stage_writes)
        self._stage_writes = []

    async def _update(self, change: Callable[..., Awaitable[None]], **kwargs: Any) -> None:
        if self.run_id is not None:  # else the row could not be started: there is nothing to update
            await self._write(change, self.run_id, **kwargs)

    async def _write(self, change: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        """``change`` on a store opened for it alone: a run lasts hours, longer than a connection should idle."""
        store = TrajectoryStore(self.store.location, self.store)
        try:
            await store.start()
            try:
                return await change(store, *args, **kwargs)
            finally:
                await store.close()
        except Exception as exc:
            log.warning("replay_train.record_failed", run=self.run_id, error=str(exc) or type(exc).__name__)
            return None
