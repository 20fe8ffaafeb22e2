"""The Gateway object in-process: start-up, retention, shut-down."""

import asyncio
import time
from pathlib import Path

from gateway.app import Gateway
from gateway.config import Settings, load_settings
from replay import hashing, runs
from replay.records import CallRecord


def _settings(tmp_path: Path, store_extra: str = "") -> Settings:
    """A gateway whose only backend is never called: these tests exercise start-up and the store."""
    cfg = tmp_path / "h.toml"
    cfg.write_text(f'[store]\npath = "{tmp_path / "h.db"}"\n{store_extra}'
                   '[[backends]]\nname = "u"\nkind = "openai"\nbase_url = "http://127.0.0.1:9/v1"\nmodels = ["m"]\n')
    return load_settings(cfg, environ={})


async def test_retention_sweeps_old_trajectories_at_start(tmp_path: Path) -> None:
    settings = _settings(tmp_path, "retention_days = 1\n")
    gateway = Gateway(settings)
    await gateway.store.start()
    for text, age_days in (("ancient", 3), ("fresh", 0)):
        msgs = [{"role": "user", "content": text}]
        prefix = hashing.prefix_hashes(msgs)
        ref = await gateway.store.stitch(session_key=None, prefix=prefix, anchor=prefix[0], tenant=None)
        await gateway.store.record(CallRecord(trajectory=ref, request_messages=msgs, request_prefix=prefix,
                                              status="ok", created_at=time.time() - age_days * 86400))
    await gateway.store.close()

    gateway = Gateway(settings)
    await gateway.start()
    try:
        for _ in range(100):
            remaining = await gateway.store.list_trajectories(all_tenants=True)
            if len(remaining) == 1:
                break
            await asyncio.sleep(0.02)
        assert len(remaining) == 1
        found = await gateway.store.get_trajectory(remaining[0].id, all_tenants=True)
        assert found.calls[0].messages == [{"role": "user", "content": "fresh"}]
    finally:
        await gateway.stop()


async def test_a_run_left_running_that_nobody_can_carry_on_is_marked_interrupted(tmp_path: Path) -> None:
    from gateway.agent.loop import Profile, RunState
    from gateway.agent.recording import StoreRecorder

    settings = _settings(tmp_path)
    gateway = Gateway(settings)
    await gateway.store.start()
    recorder = StoreRecorder(gateway.store, profile=Profile(name="p", model="m"), backend="u")
    await recorder.start(RunState(run_id="left-running", profile="p", messages=[{"role": "user", "content": "x"}]))
    await gateway.store.close()  # the gateway died with the run mid-flight, holding no lease

    gateway = Gateway(settings)
    await gateway.start()
    try:
        # The first sweep takes the run over; its profile "p" is no longer configured, so it cannot go on.
        for _ in range(250):
            run = await runs.get(gateway.store, "left-running")
            if run["status"] != "running":
                break
            await asyncio.sleep(0.02)
        assert run["status"] == "interrupted" and run["lease_owner"] == gateway.agents.lease.owner
        trajectory = await gateway.store.get_trajectory("left-running", all_tenants=True)
        assert trajectory.status == "interrupted"
    finally:
        await gateway.stop()
