"""Finding: ``json_group_array`` and ``json_group_object`` got past ``sql_max_bytes`` and grew the gateway.

They grow their buffer row by row and check SQLite's length limit only at the end, so a recursive CTE of
100 000 rows of 262 kB reached 768 MB (``json_group_array``) and 894 MB (``json_group_object``) in the gateway
process within a 2 s timeout. Now each statement runs in a worker process under SQLite's hard heap limit and an
address-space limit (``tools/builtin/sql_worker.py``): the query fails at once with a clear error, the gateway's
memory does not move, and the store goes on recording.

A real gateway process runs an agent profile with ``sql_query``; a stand-in model calls the tool with the
attacker's query (the last user message) and then answers with the tool's result.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tests.processes import GatewayProcess, upstream_config
from tests.standin import ServerThread

pytestmark = pytest.mark.integration

MAX_MEMORY_MB = 128
_ROWS = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c LIMIT 100000) "
ATTACKS = {
    "json_group_array": _ROWS + "SELECT length(json_group_array(hex(zeroblob(131000)))) FROM c",
    "json_group_object": _ROWS + "SELECT length(json_group_object(x, hex(zeroblob(131000)))) FROM c",
    "group_concat": _ROWS + "SELECT length(group_concat(hex(zeroblob(131000)))) FROM c",
}
if sqlite3.sqlite_version_info >= (3, 45):  # the JSONB functions came with 3.45
    ATTACKS["jsonb_group_array"] = _ROWS + "SELECT length(jsonb_group_array(hex(zeroblob(131000)))) FROM c"
EXPECTED = {
    "json_group_array": f"needs more than {MAX_MEMORY_MB} MiB of memory",
    "json_group_object": f"needs more than {MAX_MEMORY_MB} MiB of memory",
    "jsonb_group_array": f"needs more than {MAX_MEMORY_MB} MiB of memory",
    # group_concat checks the length limit as it grows, so it fails on that before memory matters.
    "group_concat": "exceed the limit of 262144 bytes",
}


class SqlModel:
    """A model that calls sql_query with the user's text, then answers with what the tool returned."""

    def __init__(self) -> None:
        self.app = Starlette(routes=[Route("/v1/chat/completions", self.chat, methods=["POST"])])

    async def chat(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        last = body["messages"][-1]
        if last["role"] == "tool":
            message: dict[str, Any] = {"role": "assistant", "content": f"tool said: {last['content']}"}
        else:
            message = {"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call_{time.monotonic_ns()}", "type": "function",
                "function": {"name": "sql_query", "arguments": orjson.dumps({"query": last["content"]}).decode()}}]}
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        return Response(orjson.dumps({
            "id": "chatcmpl-sql", "object": "chat.completion", "created": int(time.time()), "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}}),
            media_type="application/json")


@pytest.fixture(scope="module")
def gateway_with_sql(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    folder = tmp_path_factory.mktemp("sql-memory")
    database = folder / "data.db"
    with sqlite3.connect(database) as connection:
        connection.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, name TEXT)")
        connection.executemany("INSERT INTO t (name) VALUES (?)", [("ada",), ("grace",)])
    connection.close()
    extra = f"""
[tools]
sql_database = "{database}"
sql_timeout = 2.0
sql_max_memory_mb = {MAX_MEMORY_MB}

[[profiles]]
name = "analyst"
model = "stand-in-model"
tools = ["sql_query"]
max_steps = 3
"""
    with ServerThread(SqlModel().app) as model:
        gw = GatewayProcess(upstream_config(model.url, extra=extra), folder).start()
        try:
            yield gw
        finally:
            gw.stop()


def _ask(gw: GatewayProcess, query: str) -> httpx.Response:
    reply = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
        "model": "agent:analyst", "messages": [{"role": "user", "content": query}]})
    assert reply.status_code == 200, reply.text
    return reply


def _answer(reply: httpx.Response) -> str:
    return reply.json()["choices"][0]["message"]["content"]


def _memory_mb(gw: GatewayProcess) -> dict[str, float]:
    assert gw.proc is not None
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{gw.proc.pid}/status").read_text().splitlines())
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM")}


def _stored(gw: GatewayProcess, trajectory_id: str) -> int:
    with sqlite3.connect(gw.db) as connection:
        found = connection.execute("SELECT count(*) FROM model_calls WHERE trajectory_id = ?",
                                   (trajectory_id,)).fetchone()[0]
    connection.close()
    return found


def _eventually_stored(gw: GatewayProcess, trajectory_id: str) -> int:
    deadline = time.monotonic() + 10
    while (found := _stored(gw, trajectory_id)) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def test_aggregates_cannot_grow_the_gateway(gateway_with_sql: GatewayProcess) -> None:
    gw = gateway_with_sql
    # Warm up (the first call starts a worker and imports what the agent path needs), then start the peak
    # afresh (5 resets VmHWM to the current RSS), so only what the attacks add counts.
    assert "[[2]]" in _answer(_ask(gw, "SELECT count(*) FROM t"))
    assert gw.proc is not None
    Path(f"/proc/{gw.proc.pid}/clear_refs").write_text("5")
    before = _memory_mb(gw)
    for name, query in ATTACKS.items():
        started = time.monotonic()
        answer = _answer(_ask(gw, query))
        assert "Tool sql_query failed: " in answer and EXPECTED[name] in answer, (name, answer)
        # It fails as the heap fills, long before the 2 s timeout (which the attack used to run into).
        assert time.monotonic() - started < 1.9, (name, time.monotonic() - started)
    after = _memory_mb(gw)
    # Before the fix the first attack alone took the gateway past 700 MB.
    assert after["VmHWM"] - before["VmRSS"] < 30, (before, after)
    assert after["VmHWM"] < 300, after


def test_the_gateway_and_its_store_go_on_after_the_attacks(gateway_with_sql: GatewayProcess) -> None:
    gw = gateway_with_sql
    for query in ATTACKS.values():
        _ask(gw, query)
    reply = _ask(gw, "SELECT name FROM t ORDER BY id")
    assert '[["ada"], ["grace"]]' in _answer(reply)
    # The store is in the same process as the tool was before the fix: its commits still go through.
    assert _eventually_stored(gw, reply.headers["x-harness-trajectory-id"]) >= 2
    assert httpx.get(gw.url + "/healthz").status_code == 200
