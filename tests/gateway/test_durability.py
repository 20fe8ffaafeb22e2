"""A response is never sent before its exchange is committed, and a killed gateway loses nothing it answered: on
SQLite and on PostgreSQL."""

import random
import sqlite3
import threading
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import httpx
import orjson
import psycopg
import pytest

from replay.database import for_postgres
from tests.processes import GatewayProcess, upstream_config

pytestmark = pytest.mark.integration

MODEL = "stand-in-model"
DELAY_MS = 400


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest) -> str | None:
    """The gateway's store: None for its SQLite file, else a fresh PostgreSQL database's URL."""
    return request.getfixturevalue("postgres").database() if request.param == "postgresql" else None


def _config(upstream: str, url: str | None, store: str = "") -> str:
    return upstream_config(upstream, store="\n".join(filter(None, [f'url = "{url}"' if url else "", store])))


def _rows(gw: GatewayProcess, url: str | None, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """A query on the gateway's store, read beside it (SQLite's spelling; rewritten for PostgreSQL)."""
    if url:
        with psycopg.connect(url) as conn:
            return conn.execute(for_postgres(sql), args).fetchall()
    with closing(sqlite3.connect(gw.db)) as conn:
        return conn.execute(sql, args).fetchall()


def _committed(gw: GatewayProcess, url: str | None, tid: str) -> bool:
    return _rows(gw, url, "SELECT COUNT(*) FROM model_calls WHERE trajectory_id = ? AND status = 'ok'", tid)[0][0] > 0


@pytest.fixture
def slow_writer(standin, tmp_path: Path, database: str | None):
    gw = GatewayProcess(_config(standin[1], database, f"commit_delay_ms = {DELAY_MS}"), tmp_path).start()
    gw.database = database
    yield gw
    gw.stop()


def test_body_waits_for_its_commit(slow_writer: GatewayProcess) -> None:
    for i in range(3):
        started = time.monotonic()
        r = httpx.post(slow_writer.url + "/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "messages": [{"role": "user", "content": f"durable {i}"}]})
        assert r.status_code == 200
        # checked the moment the body is in hand: the record must already be durable
        assert _committed(slow_writer, slow_writer.database, r.headers["x-harness-trajectory-id"])
        assert time.monotonic() - started >= DELAY_MS / 1000


def test_final_stream_chunk_waits_for_its_commit(slow_writer: GatewayProcess) -> None:
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", slow_writer.url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "stream durably please"}],
                "stream": True}) as r:
            tid = r.headers["x-harness-trajectory-id"]
            early = []
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = orjson.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                    assert _committed(slow_writer, slow_writer.database, tid), "final chunk arrived before the commit"
                    break
                early.append(_committed(slow_writer, slow_writer.database, tid))
    # the text itself was streamed as it came, before the commit
    assert early and not any(early)


def test_sigkill_under_load_loses_no_answered_exchange(standin, tmp_path: Path, database: str | None) -> None:
    """Killed 4 times on SQLite, 20 on PostgreSQL (a restart there is a reconnection, not a file's recovery)."""
    gw = GatewayProcess(_config(standin[1], database), tmp_path).start()
    received: list[tuple[str, str]] = []  # (trajectory id, unique text) of exchanges received in full
    lock = threading.Lock()
    stop = threading.Event()

    def client(worker: int) -> None:
        n = 0
        with httpx.Client(timeout=10) as http:
            while not stop.is_set():
                n += 1
                text = f"w{worker}-{n}"
                body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "stream": n % 2 == 0}
                try:
                    if body["stream"]:
                        with http.stream("POST", gw.url + "/v1/chat/completions", json=body) as r:
                            lines = list(r.iter_lines())
                            complete = r.status_code == 200 and "data: [DONE]" in lines
                    else:
                        r = http.post(gw.url + "/v1/chat/completions", json=body)
                        complete = r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == \
                            f"echo: {text}"
                except (httpx.HTTPError, ValueError):
                    time.sleep(0.02)
                    continue
                if complete:
                    with lock:
                        received.append((r.headers["x-harness-trajectory-id"], text))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    try:
        for _ in range(20 if database else 4):
            time.sleep(random.uniform(0.8, 1.6))
            gw.kill()
            gw.start()
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
        gw.stop()
    assert len(received) > 50, "the load never got going"
    if database:
        each = "jsonb_array_elements_text(m.request_messages::jsonb) AS j(value)"
    else:
        each = "json_each(m.request_messages) j"
        assert _rows(gw, None, "PRAGMA integrity_check") == [("ok",)]
    stored = {tid: bytes(body) for tid, body in _rows(
        gw, database, f"SELECT m.trajectory_id, b.body FROM model_calls m, {each} "
        "JOIN blobs b ON b.hash = j.value WHERE m.status = 'ok'")}
    missing = [(tid, text) for tid, text in received if tid not in stored or text.encode() not in stored[tid]]
    assert not missing, f"{len(missing)} of {len(received)} answered exchanges were lost: {missing[:5]}"
