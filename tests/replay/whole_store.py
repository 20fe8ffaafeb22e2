"""A store with a row in every table, written through the store's real API: what the copy tests move around."""

from __future__ import annotations

import sqlite3
import time
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import psycopg

from replay import approvals, bot_messages, feedback, hashing, keys, runs, sessions, stored_responses, training_runs
from replay.adapters import AdapterRegistry
from replay.copy_ends import tables
from replay.records import CallRecord, TrajectoryRef, WriteOp, new_id
from replay.store import TrajectoryStore
from tests.replay.builders import agent_trajectory, tool_row
from tests.stores import rows

# Text keys whose byte order (SQLite's, and ``COLLATE "C"``) differs from a natural-language collation's.
NONCES = ("Zulu", "alpha", "Beta", "yak", "Éclair", "écru", "0-first", "_under")


@dataclass
class Built:
    trajectories: list[str]  # every trajectory, the deleted run's excepted
    searchable: dict[str, str]  # a word in a trajectory's messages (and in its siblings' alone) -> that trajectory
    events_high_water: int  # the largest events id ever given out (a deleted run's included)


async def build(path: Path, *, agents: int = 4) -> Built:
    store = TrajectoryStore(str(path))
    await store.start()
    try:
        return await _fill(store, str(path), agents)
    finally:
        await store.close()


async def _fill(store: TrajectoryStore, location: str, agents: int) -> Built:
    searchable: dict[str, str] = {}
    for i in range(agents):
        word = f"zebra{i}"
        tid = await agent_trajectory(
            store, f"What is {i}+{i}? Ångström {word}", final=str(2 * i), logprobs=True,
            reward=[0.1 + 0.2, 1e-300, -2.5e300, None][i % 4], tenant="acme" if i % 2 else None,
            tool_rows=[[tool_row("call_1", True), tool_row("call_2", i % 2 == 0)], [tool_row("call_3", True)]],
            metadata=f'{{"attempt": {i}}}')
        searchable[word] = tid
        await feedback.add(store, tid, source="user", name="thumbs", value=1.0 / 3, comment="ok ✓")
        await feedback.add(store, tid, source="verifier", name="correct", label="yes", model_call_seq=1)

    # n > 1 choices: one call, three trajectories of one group
    messages = [{"role": "user", "content": "pick a number, quokka"}]
    prefix = hashing.prefix_hashes(messages)
    ref = await store.stitch(session_key=None, prefix=prefix, anchor=prefix[0], tenant=None)
    await store.record(CallRecord(
        trajectory=ref, request_messages=messages, request_prefix=prefix, status="ok", prompt_tokens=4,
        response={"id": "x", "object": "chat.completion", "model": "m", "choices": [
            {"index": i, "message": {"role": "assistant", "content": f"{i}"}, "finish_reason": "stop"}
            for i in range(3)]},
        completion_token_ids=[[1], [2, 2], [3, 3, 3]], latency_ms=12.5, ttft_ms=3.25))
    searchable["quokka"] = ref.id

    run_id, high_water = await _agent_run(store, "kept")
    gone, high_water = await _agent_run(store, "deleted")
    await store.delete(ids=[gone])  # its events' ids stay given out: the counter stays above the largest left

    key_id = await keys.create(store, tenant="acme", name="ci", capture=True, secret_hash="h" * 64,
                               default_model="base-m", allow_model_override=True)
    await keys.revoke(store, key_id)
    await sessions.create(store, session_hash="s" * 64, key_id=key_id, key_hash="h" * 64, tenant="acme", admin=False,
                          csrf="token ✓", now=time.time(), expires_at=time.time() + 3600)
    for n, nonce in enumerate(NONCES):
        assert await keys.claim_nonce(store, nonce, now=1_000_000.0 + n, keep_seconds=1e9)

    message = await bot_messages.add(store, platform="wecom", external_id="ext-1", conversation_id="c1",
                                     user_id="u1", text="héllo", callback_url="https://example.invalid/cb")
    assert message is not None
    await store.write(WriteOp(statements=[bot_messages.conversation_statement(message, run_id),
                                          bot_messages.running_statement(message["id"], run_id)]))
    await bot_messages.set_outcome(store, message["id"], status=bot_messages.ANSWERED, reply="4",
                                   harness={"steps": 2}, model_call_seq=0)
    await store.write(WriteOp(statements=[stored_responses.statement(
        {"id": "resp_1", "object": "response", "output": []}, trajectory_id=run_id, tenant=None, messages=messages)]))

    registry = AdapterRegistry(location)
    registry.register("sql", "base-m", "/adapters/sql/1", metrics={"accuracy": 0.75})
    registry.promote("sql", 1)
    registry.register("sql", "base-m", lambda v: f"/adapters/sql/{v}", uploaded=True)
    training_run = await training_runs.start(store, name="sql", mode="sft+rl", host="trainer ✓", run_dir="/runs/sql")
    await training_runs.finish(store, training_run, stages=[{"stage": "select", "seconds": 0.5, "trajectories": 4}],
                               metrics={"curves": {"loss": [[1, 2.5], [2, 1e-300]]}, "gate": {"passed": True}},
                               adapter_version=1)

    trajectories = [t.id for t in await store.list_trajectories(all_tenants=True, limit=10_000)]
    return Built(trajectories, searchable, high_water)


async def _agent_run(store: TrajectoryStore, word: str) -> tuple[str, int]:
    """An agent run: its trajectory, a model call, events, a held tool call and its final state; the largest
    events id afterwards."""
    run_id, at = new_id(), time.time()
    start = runs.RunStart(run_id=run_id, profile="calc", status="running", state={"messages": [], "step": 0},
                          source="agent", tenant=None, key_id=None, requested_model="base-m", base_model="base-m",
                          message_count=1, metadata={"word": word}, at=at)
    await store.write(WriteOp(statements=runs.start_statements(start)))
    request = [{"role": "user", "content": f"run {word}"}]
    await store.write(WriteOp(records=[CallRecord(
        trajectory=TrajectoryRef(id=run_id, seq=0, is_new=False), request_messages=request,
        request_prefix=hashing.prefix_hashes(request), status="ok", source="agent", requested_model="base-m",
        response={"id": "y", "object": "chat.completion", "model": "m", "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "4"}, "finish_reason": "stop"}]},
        tool_calls=[tool_row("call_9", True)])]))
    await store.write(WriteOp(statements=[
        *(runs.event_statement(run_id, step=s, state=state, data={"step": s, "word": word}, at=at + s)
          for s, state in enumerate(("plan", "execute", "observe", "final"))),
        approvals.hold_statement(run_id, approval_id=new_id(), step=1, call_id="call_9", tool="shell",
                                 arguments={"cmd": "ls"}, at=at, expires_at=at + 3600),
        *runs.progress_statements(runs.RunProgress(run_id=run_id, status="completed", termination_reason=None,
                                                   steps=2, state={"final": "4"}, result={"answer": "4"},
                                                   at=at + 4))]))
    [(largest,)] = await rows(store, "SELECT MAX(id) FROM events")
    return run_id, largest


def counts(location: str) -> dict[str, int]:
    """Rows per table of a store, read directly (every table 0 in a PostgreSQL database not migrated yet)."""
    if location.startswith("postgresql://"):
        with psycopg.connect(location) as conn:
            last = tables()[-1].name  # the last migration creates it
            if conn.execute("SELECT to_regclass(%s) IS NULL", (last,)).fetchone()[0]:
                return {t.name: 0 for t in tables()}
            return {t.name: conn.execute(f"SELECT COUNT(*) FROM {t.name}").fetchone()[0] for t in tables()}
    with closing(sqlite3.connect(location)) as conn:
        return {t.name: conn.execute(f"SELECT COUNT(*) FROM {t.name}").fetchone()[0] for t in tables()}
