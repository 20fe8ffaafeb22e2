"""Finding: a plain (non-streamed) generation went on after its client had left, and any ``max_tokens`` was taken.

With ``max_tokens: 400`` and a 3 s client timeout the embedded model went on for 113 s; ``max_tokens: 10**9`` kept
both cores busy for minutes for nobody. Now a plain request's generation is cancelled when its client goes (as a
stream's already was: ``gateway/streaming.unless_disconnected``), and a limit the context cannot hold is a 400.
"""

from __future__ import annotations

import os
import sqlite3
import time

import httpx
import pytest

from tests.processes import GatewayProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
TICKS = os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory):
    gw = GatewayProcess('[store]\npath = "harness.db"\n', tmp_path_factory.mktemp("disconnect")).start(timeout=300)
    yield gw
    gw.stop()


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime and stime


def _long(max_tokens: int) -> dict:
    # ignore_eos: the model may not stop by itself before max_tokens, which is what the attack relies on
    return {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a very long story."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def test_a_plain_generation_stops_when_its_client_leaves(embedded: GatewayProcess) -> None:
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(embedded.url + "/v1/chat/completions", json=_long(1500), timeout=httpx.Timeout(10, read=2.0))
    time.sleep(0.5)  # the disconnect reaches the engine between two steps
    before = _cpu_seconds(embedded.proc.pid)
    time.sleep(4)
    spent = _cpu_seconds(embedded.proc.pid) - before
    # Generating on would take a core or more for the whole window (1,500 tokens take over a minute here).
    assert spent < 1.0, f"the gateway spent {spent:.2f} CPU seconds in 4 s after its client left"
    r = httpx.post(embedded.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200
    time.sleep(0.5)  # the disconnected exchange is recorded in the background
    with sqlite3.connect(embedded.db) as db:
        status, error, latency = db.execute(
            "SELECT status, error, latency_ms FROM model_calls WHERE status = 'client_disconnected'").fetchone()
    assert "before the answer" in error and latency < 5000


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_limit_the_context_cannot_hold_is_refused(embedded: GatewayProcess, field: str) -> None:
    started = time.monotonic()
    r = httpx.post(embedded.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], field: 10**9})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["code"] == "context_length_exceeded"
    assert "8192" in error["message"] and "at most" in error["message"]
    assert time.monotonic() - started < 10  # refused before generating anything
    fits = httpx.post(embedded.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], field: 4, "temperature": 0})
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] <= 4
