"""Stitching on a store two processes write at once (PostgreSQL): a conversation whose requests land on different
processes is one trajectory, also when both extend it at the same moment. Each process here is a real Python
process with its own ``TrajectoryStore`` on one database, as two gateway replicas are."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from replay import hashing
from replay.records import CallRecord
from replay.store import TrajectoryStore
from tests.postgres import PostgresServer

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SYSTEM = {"role": "system", "content": "You are terse."}
OPENING = [SYSTEM, {"role": "user", "content": "hi"}]

# One replica: at START (a wall-clock time both share), COUNT requests at once continue the conversation whose
# history is argv's; a second later, while all are still in flight in both processes, each records its answer.
# Prints one JSON line per request: [trajectory id, seq, is_new].
REPLICA = """
import asyncio, json, sys, time
from replay import hashing
from replay.records import CallRecord
from replay.store import TrajectoryStore

url, name, start, count = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
history = json.loads(sys.argv[5])

async def stitch(store, i):
    messages = history + [{"role": "user", "content": f"{name} asks {i}"}]
    prefix = hashing.prefix_hashes(messages)
    ref = await store.stitch(session_key=None, prefix=prefix, anchor=prefix[hashing.anchor_index(messages)],
                             tenant=None)
    return messages, prefix, ref

async def record(store, i, messages, prefix, ref):
    answer = {"role": "assistant", "content": f"{name} answer {i}"}
    await store.record(CallRecord(trajectory=ref, request_messages=messages, request_prefix=prefix, status="ok",
                                  response={"choices": [{"index": 0, "message": answer, "finish_reason": "stop"}]}))

async def main():
    store = TrajectoryStore(url)
    await store.start()
    await asyncio.sleep(max(0.0, start - time.time()))
    stitched = await asyncio.gather(*(stitch(store, i) for i in range(count)))
    await asyncio.sleep(max(0.0, start + 1.0 - time.time()))
    await asyncio.gather(*(record(store, i, *one) for i, one in enumerate(stitched)))
    await store.close()
    for _, _, ref in stitched:
        print(json.dumps([ref.id, ref.seq, ref.is_new]))

asyncio.run(main())
"""


def _race(url: str, history: list[dict], count: int) -> list[list]:
    start = time.time() + 2.0  # both processes up and connected before it
    procs = [subprocess.Popen([sys.executable, "-c", REPLICA, url, name, str(start), str(count), json.dumps(history)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                              env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
             for name in ("a", "b")]
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr
        out += [json.loads(line) for line in stdout.splitlines()]
    return out


async def _seed(url: str) -> str:
    store = TrajectoryStore(url)
    await store.start()
    prefix = hashing.prefix_hashes(OPENING)
    ref = await store.stitch(session_key=None, prefix=prefix, anchor=prefix[1], tenant=None)
    await store.record(CallRecord(trajectory=ref, request_messages=OPENING, request_prefix=prefix, status="ok",
                                  response={"choices": [{"index": 0, "finish_reason": "stop",
                                                         "message": {"role": "assistant", "content": "hello"}}]}))
    await store.close()
    return ref.id


async def test_two_processes_extending_one_head_at_once_share_its_trajectory(postgres: PostgresServer) -> None:
    url = postgres.database()
    tid = await _seed(url)
    history = [*OPENING, {"role": "assistant", "content": "hello"}]
    results = _race(url, history, count=10)
    # Every request continued the head as it was when it arrived: all 20 extend the one trajectory, each with a
    # sequence number of its own (claimed by compare-and-swap), none lost or doubled.
    assert {r[0] for r in results} == {tid}
    assert sorted(r[1] for r in results) == list(range(1, 21))
    store = TrajectoryStore(url)
    await store.start()
    try:
        whole = (await store.get_trajectory(tid, all_tenants=True)).to_dict()
        assert whole["n_calls"] == 21
        assert sorted(c["seq"] for c in whole["calls"]) == list(range(21))
        # The head is now one of the answers; the old head no longer extends it: a request that continues it
        # forks (a retry or an edit), recording its parent, exactly as in one process.
        late = [*history, {"role": "user", "content": "late"}]
        prefix = hashing.prefix_hashes(late)
        ref = await store.stitch(session_key=None, prefix=prefix, anchor=prefix[1], tenant=None)
        assert ref.is_new and ref.parent_id == tid
    finally:
        await store.close()


async def test_a_conversation_alternating_between_processes_stays_one_trajectory(postgres: PostgresServer) -> None:
    url = postgres.database()
    tid = await _seed(url)
    history = [*OPENING, {"role": "assistant", "content": "hello"}]
    for turn in range(6):  # each turn on the other process, each continuing the head the last one left
        name = "ab"[turn % 2]
        proc = subprocess.run([sys.executable, "-c", REPLICA, url, name, "0", "1", json.dumps(history)],
                              capture_output=True, text=True, cwd=ROOT, timeout=60,
                              env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
        assert proc.returncode == 0, proc.stderr
        [(got, seq, is_new)] = [json.loads(line) for line in proc.stdout.splitlines()]
        assert (got, seq, is_new) == (tid, turn + 1, False)
        history += [{"role": "user", "content": f"{name} asks 0"}, {"role": "assistant", "content": f"{name} answer 0"}]
