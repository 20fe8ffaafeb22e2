"""Run leases in the store (``replay/runs.py``), on SQLite and PostgreSQL: who carries a run on, and until when."""

from __future__ import annotations

import asyncio
import time

from replay import runs
from replay.records import WriteOp
from replay.store import TrajectoryStore
from tests.stores import rows

A, B = runs.Lease("host:1:a", 30.0), runs.Lease("host:2:b", 30.0)


async def _run(store: TrajectoryStore, run_id: str, *, status: str = "running", lease: runs.Lease | None = None,
               at: float = 1000.0) -> None:
    await store.write(WriteOp(statements=runs.start_statements(runs.RunStart(
        run_id=run_id, profile="p", status=status, state={}, source="agent", tenant=None, key_id=None,
        requested_model="agent:p", base_model="m", message_count=1, metadata=None, at=at, lease=lease))))


async def _lease(store: TrajectoryStore, run_id: str) -> tuple[str | None, float | None]:
    [found] = await rows(store, "SELECT lease_owner, lease_expires_at FROM agent_runs WHERE id = ?", run_id)
    return found


async def _progress(store: TrajectoryStore, run_id: str, status: str, lease: runs.Lease, at: float) -> None:
    await store.write(WriteOp(statements=runs.progress_statements(runs.RunProgress(
        run_id=run_id, status=status, termination_reason=None, steps=1, state={}, result={}, at=at, lease=lease))))


async def test_a_lease_is_taken_when_free_mine_or_expired_and_released_only_by_its_holder(store) -> None:
    await _run(store, "r")
    assert await _lease(store, "r") == (None, None)  # a run started without a lease is free
    assert await runs.acquire(store, "r", A, now=1000.0)
    assert await _lease(store, "r") == (A.owner, 1030.0)
    assert not await runs.acquire(store, "r", B, now=1029.9)  # A's is live
    assert await runs.acquire(store, "r", A, now=1010.0)  # A's own: refreshed
    assert await _lease(store, "r") == (A.owner, 1040.0)
    await runs.release(store, "r", B.owner)  # not B's to release
    assert await _lease(store, "r") == (A.owner, 1040.0)
    assert await runs.acquire(store, "r", B, now=1040.0)  # expired: B takes it over
    assert not await runs.acquire(store, "r", A, now=1041.0)
    await runs.release(store, "r", A.owner)  # A's release after losing it leaves B's lease alone
    assert await _lease(store, "r") == (B.owner, 1070.0)
    await runs.release(store, "r", B.owner)
    assert await _lease(store, "r") == (B.owner, None)  # free; B is named as the last to carry it
    assert await runs.acquire(store, "r", A, now=1041.0)
    assert not await runs.acquire(store, "nope", A, now=1041.0)


async def test_a_run_starts_leased_a_step_keeps_it_and_a_pause_or_end_releases_it(store) -> None:
    await _run(store, "r", lease=A, at=1000.0)
    assert await _lease(store, "r") == (A.owner, 1030.0)
    await _progress(store, "r", "running", A, at=1020.0)
    assert await _lease(store, "r") == (A.owner, 1050.0)
    await _progress(store, "r", "running", B, at=1021.0)  # a step by a process that lost the lease takes nothing
    assert await _lease(store, "r") == (A.owner, 1050.0)
    await _progress(store, "r", "pending_approval", A, at=1022.0)
    assert await _lease(store, "r") == (A.owner, None)
    await _progress(store, "r", "running", B, at=1023.0)  # a conversation's next turn, elsewhere, takes it
    assert await _lease(store, "r") == (B.owner, 1053.0)
    await _progress(store, "r", "completed", B, at=1024.0)
    assert await _lease(store, "r") == (B.owner, None)


async def test_renewal_extends_the_owners_held_leases_on_unfinished_runs_only(store) -> None:
    for run_id, status in (("running", "running"), ("paused", "pending_approval"), ("stopped", "interrupted"),
                           ("done", "completed")):
        await _run(store, run_id, status=status, lease=A)
    await _run(store, "theirs", lease=B)
    await _run(store, "released", lease=A)
    await runs.release(store, "released", A.owner)
    assert await runs.renew(store, A, now=2000.0) == 3
    assert sorted(await rows(store, "SELECT id, lease_owner, lease_expires_at FROM agent_runs")) == [
        ("done", A.owner, 1030.0), ("paused", A.owner, 2030.0), ("released", A.owner, None),
        ("running", A.owner, 2030.0), ("stopped", A.owner, 2030.0), ("theirs", B.owner, 1030.0)]


async def test_orphans_are_running_runs_whose_lease_was_released_or_expired_elsewhere(store) -> None:
    await _run(store, "live", lease=B, at=1000.0)
    await _run(store, "dead", lease=B, at=900.0)  # B's expired at 930
    await _run(store, "mine", lease=A, at=900.0)  # this process's own, renewed late
    await _run(store, "dropped", lease=A, at=990.0)
    await runs.release(store, "dropped", A.owner)  # let go without ending it (a failed resume)
    await _run(store, "never", at=950.0)  # started without a lease
    await _run(store, "paused", status="pending_approval", at=800.0)
    found = await runs.orphaned(store, owner=A.owner, now=1000.0)
    assert found == [{"id": "dead", "lease_owner": B.owner}, {"id": "never", "lease_owner": None},
                     {"id": "dropped", "lease_owner": A.owner}]


async def test_a_run_nobody_can_carry_on_is_interrupted_unless_it_stopped_already(store) -> None:
    await _run(store, "left")
    await _run(store, "paused")
    await _progress(store, "paused", "pending_approval", A, at=1001.0)
    for run_id in ("left", "paused"):
        await runs.interrupt(store, run_id, at=2000.0)
    assert sorted(await rows(store, "SELECT r.id, r.status, t.status AS of_trajectory FROM agent_runs r "
                                    "JOIN trajectories t ON t.id = r.id")) == [
        ("left", "interrupted", "interrupted"), ("paused", "pending_approval", "pending_approval")]


async def test_of_many_processes_racing_for_one_free_lease_exactly_one_wins(store_location: str, store) -> None:
    # A second store on the same database stands for another process: its own connections (its own pool).
    other = TrajectoryStore(store_location)
    await other.start()
    try:
        for n in range(10):
            run_id = f"race-{n}"
            await _run(store, run_id, lease=runs.Lease("dead", 1.0), at=time.time() - 60)  # its owner died
            now = time.time()
            contenders = [runs.Lease(f"p{i}", 30.0) for i in range(16)]
            won = await asyncio.gather(*(runs.acquire(store if i % 2 else other, run_id, lease, now=now)
                                         for i, lease in enumerate(contenders)))
            assert sum(won) == 1, won
            [(owner,)] = await rows(store, "SELECT lease_owner FROM agent_runs WHERE id = ?", run_id)
            assert owner == contenders[won.index(True)].owner
    finally:
        await other.close()
