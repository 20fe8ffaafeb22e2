"""Agent runs across gateway processes sharing one store, as real ``harness serve`` processes: an approval decided
on any replica resumes its run exactly once, and a run whose gateway was killed is taken over by a live one once
its lease expires (``replay/runs.py``, ``gateway/agent/service.py``)."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from replay import approvals
from replay.store import TrajectoryStore
from tests.processes import GatewayProcess, upstream_config
from tests.standin import ServerThread
from tests.stores import rows

pytestmark = pytest.mark.integration

ADMIN = "admin-key-for-replicas"
ENV = {"HARNESS_ADMIN_KEY": ADMIN}
HIT_SECONDS = 0.5  # how long the held tool takes: other replicas sweep several times while it runs
SLOW_SECONDS = 1.5  # the pause before a "count" run's second answer, the first time (inside read_timeout)


class Upstream:
    """The model and the held tool's target, on one loopback server.

    The model's answers follow the run's task (its user message): ``fetch:N`` calls ``http_get`` on this server's
    ``/hit/N`` (held for approval), then answers ``fetched N``; ``count:N`` calls the calculator, then answers
    ``counted N``, the first time only after ``SLOW_SECONDS``. ``/hit/N`` counts its calls: the held tool's runs.
    """

    def __init__(self) -> None:
        self.url = ""
        self.hits: collections.Counter[str] = collections.Counter()
        self.requests: list[dict[str, Any]] = []
        self.slowed: set[str] = set()
        self.app = Starlette(routes=[Route("/v1/chat/completions", self.chat, methods=["POST"]),
                                     Route("/hit/{task}", self.hit, methods=["GET"])])

    async def hit(self, request: Request) -> Response:
        await asyncio.sleep(HIT_SECONDS)
        self.hits[request.path_params["task"]] += 1
        return JSONResponse({"ok": True})

    async def chat(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        self.requests.append(body)
        task = next(m["content"] for m in body["messages"] if m["role"] == "user")
        kind, _, n = task.partition(":")
        if body["messages"][-1]["role"] == "user":
            name, arguments = (("http_get", {"url": f"{self.url}/hit/{n}"}) if kind == "fetch"
                               else ("calculator", {"expression": f"{n} + 1"}))
            message = {"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call-{kind}-{n}", "type": "function",
                "function": {"name": name, "arguments": orjson.dumps(arguments).decode()}}]}
        else:
            if kind == "count" and task not in self.slowed:
                self.slowed.add(task)
                await asyncio.sleep(SLOW_SECONDS)
            message = {"role": "assistant", "content": f"{kind}ed {n}"}
        return JSONResponse({"id": "chatcmpl-replicas", "object": "chat.completion", "created": int(time.time()),
                             "model": body.get("model"), "usage": {"prompt_tokens": 10, "completion_tokens": 3,
                                                                    "total_tokens": 13},
                             "choices": [{"index": 0, "message": message, "logprobs": None,
                                          "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}]})

    def answered(self, task: str) -> list[dict[str, Any]]:
        """The model requests of ``task``'s run that came after a tool result."""
        return [b for b in self.requests if b["messages"][-1]["role"] == "tool"
                and any(m["role"] == "user" and m["content"] == task for m in b["messages"])]


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    found = Upstream()
    with ServerThread(found.app) as server:
        found.url = server.url
        yield found


def _config(upstream: Upstream, store: str, *, lease_seconds: float = 30.0) -> str:
    return upstream_config(upstream.url, store=store, extra=f"""
[tools]
workspace = "ws"
require_approval = ["http_get"]
allow_networks = ["127.0.0.0/8"]
approval_poll_seconds = 0.1
run_lease_seconds = {lease_seconds}

[[profiles]]
name = "worker"
model = "stand-in-model"
tools = ["http_get", "calculator"]
max_steps = 4
""")


def _gateway(config: str, workdir: Path) -> GatewayProcess:
    workdir.mkdir(exist_ok=True)
    return GatewayProcess(config, workdir, env=ENV)


def _start_run(gateway: GatewayProcess, task: str) -> str:
    created = httpx.post(gateway.url + "/v1/agent/runs", json={"profile": "worker", "input": task}, timeout=10)
    assert created.status_code == 201, created.text
    return created.json()["id"]


def _wait_for(gateway: GatewayProcess, run_id: str, status: str, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while (run := httpx.get(f"{gateway.url}/v1/agent/runs/{run_id}", timeout=10).json())["status"] != status:
        assert time.monotonic() < deadline, run
        time.sleep(0.05)
    return run


def _log(gateway: GatewayProcess) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in gateway.log.read_text().splitlines() if line.startswith("{")]


def _query(location: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    async def read() -> list[tuple[Any, ...]]:
        store = TrajectoryStore(location)
        await store.start()
        try:
            return await rows(store, sql, *args)
        finally:
            await store.close()

    return asyncio.run(read())


def _decide_in_store(location: str, approval_ids: list[str]) -> None:
    """Approve as ``harness approvals approve`` does: in the store, leaving the run to the replicas' sweeps."""
    async def decide() -> None:
        store = TrajectoryStore(location)
        await store.start()
        try:
            decided = await asyncio.gather(*(approvals.decide(store, i, approve=True, reason=None, by="cli",
                                                              now=time.time()) for i in approval_ids))
            assert all(changed for _, changed in decided)
        finally:
            await store.close()

    asyncio.run(decide())


def test_an_approval_decided_on_any_replica_resumes_its_run_exactly_once(upstream, postgres, tmp_path: Path) -> None:
    db = postgres.database()
    config = _config(upstream, f'url = "{db}"')
    a, b = _gateway(config, tmp_path / "a"), _gateway(config, tmp_path / "b")
    try:
        a.start()
        b.start()
        tasks = [f"fetch:{n}" for n in range(10)]
        run_ids = {task: _start_run(a, task) for task in tasks}  # all started on A, where they pause
        held = {task: _wait_for(a, run_id, "pending_approval")["approvals"][0]["id"]
                for task, run_id in run_ids.items()}
        assert not upstream.hits

        def approve_on_b(task: str) -> None:
            decided = httpx.post(f"{b.url}/admin/approvals/{held[task]}/approve", timeout=10,
                                 headers={"Authorization": f"Bearer {ADMIN}"})
            assert decided.status_code == 200, decided.text

        # Five approved through B's admin API at once: B resumes each at once while A's sweep finds it settled.
        with ThreadPoolExecutor(5) as pool:
            list(pool.map(approve_on_b, tasks[:5]))
        # Five approved in the store, as the command line does: the two replicas' sweeps race for each.
        _decide_in_store(db, [held[task] for task in tasks[5:]])

        for task, run_id in run_ids.items():
            run = _wait_for(b, run_id, "completed")
            assert run["output"] == f"fetched {task.split(':')[1]}"
        time.sleep(1.0)  # both sweeps go on a while: nothing runs again
        assert upstream.hits == {task.split(":")[1]: 1 for task in tasks}  # each held call ran once
        assert all(len(upstream.answered(task)) == 1 for task in tasks)  # each run went on once
        for run_id in run_ids.values():
            assert _query(db, "SELECT status, lease_expires_at FROM agent_runs WHERE id = ?", run_id) == [
                ("completed", None)]
            assert _query(db, "SELECT status FROM tool_calls WHERE trajectory_id = ?", run_id) == [("ok",)]
            assert _query(db, "SELECT COUNT(*) FROM events WHERE trajectory_id = ? AND state = 'APPROVAL'",
                          run_id) == [(1,)]
        resumed = [e["trajectory_id"] for gateway in (a, b) for e in _log(gateway) if e["event"] == "agent.resumed"]
        assert sorted(resumed) == sorted(run_ids.values())
        carried_by = collections.Counter(owner.split(":")[1] for [(owner,)] in (
            _query(db, "SELECT lease_owner FROM agent_runs WHERE id = ?", r) for r in run_ids.values()))
        assert sum(carried_by.values()) == 10 and set(carried_by) <= {str(a.proc.pid), str(b.proc.pid)}
    finally:
        a.stop()
        b.stop()


@pytest.mark.parametrize("database", ["postgresql", "sqlite"])
def test_a_run_whose_gateway_was_killed_is_taken_over_once_its_lease_expires(upstream, request, tmp_path: Path,
                                                                             database: str) -> None:
    """On PostgreSQL a second replica takes it over; on SQLite (one process) the restarted gateway does."""
    location = request.getfixturevalue("postgres").database() if database == "postgresql" else str(
        tmp_path / "a" / "harness.db")
    config = _config(upstream, f'url = "{location}"' if database == "postgresql" else "", lease_seconds=2)
    a = _gateway(config, tmp_path / "a").start()
    b = _gateway(config, tmp_path / "b").start() if database == "postgresql" else None
    try:
        run_id = _start_run(a, "count:7")
        deadline = time.monotonic() + 10
        while not upstream.answered("count:7"):  # the calculator's step is saved; the next answer is slow
            assert time.monotonic() < deadline
            time.sleep(0.01)
        a.kill()
        killed = time.monotonic()
        b = b or _gateway(config, tmp_path / "a").start()  # SQLite: the same file, restarted
        run = _wait_for(b, run_id, "completed")
        took = time.monotonic() - killed
        # Not before A's lease ran out: renewed every 2/3 s, it expired 4/3 to 2 s after the kill.
        assert 1.2 < took < 15, took
        assert run["output"] == "counted 7"
        [(owner,)] = _query(location, "SELECT lease_owner FROM agent_runs WHERE id = ?", run_id)
        assert owner.split(":")[1] == str(b.proc.pid)
        logged = _log(b)
        assert [(e["trajectory_id"], e["last_owner"].split(":")[1]) for e in logged
                if e["event"] == "agent.run_orphaned"] == [(run_id, str(a.proc.pid))]
        assert [(e["trajectory_id"], e["status"]) for e in logged if e["event"] == "agent.resumed"] == [
            (run_id, "completed")]
        # It went on from its saved step: the calculator ran once, and the model was asked again with its result.
        assert _query(location, "SELECT name, status FROM tool_calls WHERE trajectory_id = ?", run_id) == [
            ("calculator", "ok")]
        first, again = upstream.answered("count:7")
        assert first["messages"] == again["messages"] and first["messages"][-1]["content"] == "8"
    finally:
        a.kill()
        if b is not None:
            b.stop()
