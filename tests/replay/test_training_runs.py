"""Replay-train runs in the store: started, given their stages, finished or failed, listed newest first by keyset
(on SQLite and on PostgreSQL)."""

from __future__ import annotations

import time

from replay import training_runs
from replay.store import TrajectoryStore

STAGES = [{"stage": "select", "seconds": 0.5, "trajectories": 40}, {"stage": "sft", "seconds": 61.25, "tokens": 9000}]
METRICS = {"curves": {"loss": [[1, 2.5], [2, 1.75]], "reward": [], "validation": []},
           "reports": [{"role": "reference", "model": "base", "metrics": {"success_rate": 0.25}},
                       {"role": "candidate", "model": "tools (candidate)", "metrics": {"success_rate": 0.5}}],
           "gate": {"passed": True, "checks": [{"name": "success gain", "bound": 0.0625}]}}


async def test_a_run_starts_running_records_its_stages_and_finishes_with_its_metrics(store: TrajectoryStore) -> None:
    before = time.time()
    run_id = await training_runs.start(store, name="tools", mode="sft", host="trainer-1", run_dir="/runs/tools-1")
    started = await training_runs.get(store, run_id)
    assert started is not None and started.status == training_runs.RUNNING and not started.finished
    assert (started.name, started.mode, started.host, started.run_dir) == ("tools", "sft", "trainer-1", "/runs/tools-1")
    assert started.stages == [] and started.metrics is None and started.adapter_version is None
    assert before <= started.created_at == started.updated_at <= time.time()

    await training_runs.record_stages(store, run_id, STAGES[:1])
    assert (await training_runs.get(store, run_id)).stages == STAGES[:1]
    await training_runs.record_stages(store, run_id, STAGES)
    assert (await training_runs.get(store, run_id)).stages == STAGES

    await training_runs.finish(store, run_id, stages=STAGES + [{"stage": "register", "seconds": 0.25}],
                               metrics=METRICS, adapter_version=3)
    done = await training_runs.get(store, run_id)
    assert done.status == training_runs.COMPLETED and done.finished and done.error is None
    assert done.metrics == METRICS and done.adapter_version == 3
    assert [s["stage"] for s in done.stages] == ["select", "sft", "register"]
    assert done.updated_at >= done.created_at

    # A stage write that arrives late leaves a finished run as it is.
    await training_runs.record_stages(store, run_id, STAGES[:1])
    assert len((await training_runs.get(store, run_id)).stages) == 3


async def test_a_failed_run_keeps_its_message_stages_and_curves(store: TrajectoryStore) -> None:
    run_id = await training_runs.start(store, name="tools", mode="rl", host=None, run_dir=None)
    await training_runs.fail(store, run_id, error="no trajectories match the filters", stages=STAGES[:1],
                             metrics={"curves": {"loss": [[1, 2.0]]}})
    failed = await training_runs.get(store, run_id)
    assert failed.status == training_runs.FAILED and failed.finished
    assert failed.error == "no trajectories match the filters"
    assert failed.stages == STAGES[:1] and failed.metrics == {"curves": {"loss": [[1, 2.0]]}}
    assert failed.host is None and failed.adapter_version is None
    other = await training_runs.start(store, name="tools", mode="rl", host=None, run_dir=None)
    await training_runs.fail(store, other, error="stopped", stages=[])
    assert (await training_runs.get(store, other)).metrics is None


async def test_runs_are_listed_newest_first_a_page_at_a_time(store: TrajectoryStore) -> None:
    ids = [await training_runs.start(store, name=f"run-{i}", mode="sft", host="h", run_dir=None) for i in range(5)]
    newest_first = list(reversed(ids))
    first = await training_runs.list_runs(store, limit=2)
    assert [r.id for r in first] == newest_first[:2] and [r.name for r in first] == ["run-4", "run-3"]
    second = await training_runs.list_runs(store, before=first[-1].id, limit=2)
    assert [r.id for r in second] == newest_first[2:4]
    rest = await training_runs.list_runs(store, before=second[-1].id, limit=10)
    assert [r.id for r in rest] == newest_first[4:]
    assert await training_runs.list_runs(store, before=rest[-1].id) == []
    assert [r.id for r in await training_runs.list_runs(store)] == newest_first


async def test_an_unknown_run_is_none(store: TrajectoryStore) -> None:
    assert await training_runs.get(store, "01HZZZZZZZZZZZZZZZZZZZZZZZ") is None
    assert await training_runs.list_runs(store) == []
