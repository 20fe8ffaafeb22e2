"""A replay-train run's row as the run writes it: curves kept short, stages written in order as they end, and a
store that cannot be written to never stopping the run."""

from __future__ import annotations

from pathlib import Path

from replay import training_runs
from replay.settings import StoreSettings
from replay.store import TrajectoryStore
from training.run_record import MAX_POINTS, RunRecord, downsample


def test_a_short_curve_is_kept_and_a_long_one_averaged_down() -> None:
    assert downsample([(1, 2.0), (2, 1.5)]) == [[1, 2.0], [2, 1.5]]
    long = [(step, float(step % 2)) for step in range(1, 2001)]  # noise between 0 and 1
    points = downsample(long)
    assert len(points) == MAX_POINTS
    assert all(y == 0.5 for _, y in points)  # each mean of 4 steps: the trend, not one side of the noise
    assert points[0] == [2.5, 0.5] and points[-1] == [1998.5, 0.5]
    assert len(downsample(long[:MAX_POINTS + 1])) == MAX_POINTS


async def test_stages_written_as_they_end_land_in_order_and_a_failure_keeps_the_curves(tmp_path: Path) -> None:
    settings = StoreSettings(path=str(tmp_path / "h.db"))
    record = await RunRecord.start(settings, name="tools", mode="sft", run_dir=tmp_path / "run")
    stages: list[dict] = []
    for name in ("select", "reward", "build"):  # three writes under way at once: the last one written is the newest
        stages.append({"stage": name, "seconds": 1.0})
        record.stage_ended(stages)
    record.sft([3.0, 2.0, 1.0], [])
    await record.fail(RuntimeError("out of memory"), stages)
    store = TrajectoryStore(settings.location)
    await store.start()
    try:
        row = await training_runs.get(store, record.run_id)
    finally:
        await store.close()
    assert row.status == "failed" and row.error == "out of memory" and row.run_dir == str(tmp_path / "run")
    assert [s["stage"] for s in row.stages] == ["select", "reward", "build"]
    assert row.metrics == {"curves": {"loss": [[1, 3.0], [2, 2.0], [3, 1.0]], "reward": [], "validation": []}}


async def test_a_store_that_cannot_be_written_to_does_not_stop_the_run(tmp_path: Path) -> None:
    settings = StoreSettings(path=str(tmp_path / "no such folder" / "h.db"))
    record = await RunRecord.start(settings, name="tools", mode="sft", run_dir=tmp_path)
    assert record.run_id is None
    record.stage_ended([{"stage": "select", "seconds": 1.0}])
    await record.fail(KeyboardInterrupt(), [])  # nothing raised: there is no row to update
