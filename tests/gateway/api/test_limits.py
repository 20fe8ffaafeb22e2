"""Limits and budgets per key and per tenant, on real gateway processes in front of the stand-in upstream (which
counts 10 prompt and 3 completion tokens a call): OpenAI's headers, the 429s, the exact count under a race in one
process and across two on one Redis, agent runs and bot conversations, the price table and the usage reports."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.gateway.bot.support import bot_gateway
from tests.postgres import PostgresServer
from tests.processes import GatewayProcess, create_key, harness_cli, upstream_config
from tests.standin import StandIn

pytestmark = pytest.mark.integration

ADMIN = "limits-admin-key"
PRICES = """
[prices.stand-in-model]
input = 1.0
output = 2.0
"""


@pytest.fixture
def served(standin: tuple[StandIn, str], tmp_path: Path) -> Iterator[GatewayProcess]:
    """A gateway whose keys are looked up afresh on every request (a key's new limits count at once)."""
    config = upstream_config(standin[1], extra="[server]\nauth_cache_seconds = 0\n" + PRICES)
    proc = GatewayProcess(config, tmp_path, env={"HARNESS_ADMIN_KEY": ADMIN}).start()
    yield proc
    proc.stop()


def chat(gateway: GatewayProcess, key: str, text: str = "hi", **body: Any) -> httpx.Response:
    return httpx.post(gateway.url + "/v1/chat/completions", timeout=30, headers={"Authorization": f"Bearer {key}"},
                      json={"model": "stand-in-model", "messages": [{"role": "user", "content": text}], **body})


async def at_once(url: str, key: str, n: int, text: str = "hi") -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=n)) as client:
        return await asyncio.gather(*(client.post(
            url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
            json={"model": "stand-in-model", "messages": [{"role": "user", "content": text}]}) for _ in range(n)))


def test_requests_per_minute_answer_openais_headers_and_a_429_past_the_limit(served: GatewayProcess) -> None:
    _, key = create_key(served.config, "acme", "--rpm", "3")
    answers = [chat(served, key) for _ in range(4)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429]
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers[:3]] == ["2", "1", "0"]
    assert all(a.headers["x-ratelimit-limit-requests"] == "3" for a in answers[:3])
    reset = answers[0].headers["x-ratelimit-reset-requests"]
    assert reset.endswith("s") and 0 < int(reset.rstrip("s")) <= 60, reset  # e.g. "42s": the minute's rest
    refused = answers[3]
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert refused.json()["error"]["type"] == "requests"
    assert "requests per minute" in refused.json()["error"]["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    # The openai client reads it as a rate limit, with the headers it acts on.
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model="stand-in-model", messages=[{"role": "user", "content": "x"}])
    assert caught.value.response.headers["retry-after"]


def test_a_race_of_a_hundred_requests_for_ten_places_admits_exactly_ten(served: GatewayProcess) -> None:
    _, key = create_key(served.config, "acme", "--rpm", "10")
    answers = asyncio.run(at_once(served.url, key, 100))
    assert sorted(a.status_code for a in answers) == [200] * 10 + [429] * 90
    assert _calls(served.db) == 10  # the refused never reached the upstream nor the store


def test_concurrent_requests_past_the_limit_are_refused_until_places_come_back(served: GatewayProcess) -> None:
    _, key = create_key(served.config, "acme", "--max-concurrent", "2")
    answers = asyncio.run(at_once(served.url, key, 6, text="slow:1"))
    assert sorted(a.status_code for a in answers) == [200, 200, 429, 429, 429, 429]
    refused = next(a for a in answers if a.status_code == 429)
    assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert "concurrent requests" in refused.json()["error"]["message"]
    assert chat(served, key).status_code == 200  # both places were given back, streams too
    stream = chat(served, key, stream=True)
    assert stream.status_code == 200 and "[DONE]" in stream.text
    # Both places are free again: two slow ones at once go through, a third beside them does not.
    assert sorted(a.status_code for a in asyncio.run(at_once(served.url, key, 3, text="slow:0.5"))) == [200, 200, 429]


def test_tokens_per_minute_cap_max_tokens_hold_and_refund(served: GatewayProcess) -> None:
    _, key = create_key(served.config, "acme", "--tpm", "100")
    first = chat(served, key, max_tokens=1000)
    assert first.status_code == 200
    # The upstream was asked for what the minute leaves after the prompt, not the 1,000 asked for.
    # (The stand-in echoes the last body it got in its calls.)
    assert first.headers["x-ratelimit-limit-tokens"] == "100"
    assert int(first.headers["x-ratelimit-remaining-tokens"]) == 0  # all of it held while the call ran
    second = chat(served, key, max_tokens=1000)
    # The first spent 13 tokens: the other 87 came back, so the second could be admitted.
    assert second.status_code == 200
    assert int(second.headers["x-ratelimit-remaining-tokens"]) == 0
    assert 70 <= _last_max_tokens(served.db) < 87
    # A prompt of some 150 tokens no longer fits the minute's 74 left: a 429 on tokens.
    refused = chat(served, key, text="word " * 120)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert (error["code"], error["type"]) == ("rate_limit_exceeded", "tokens")
    assert "tokens per minute" in error["message"] and 1 <= int(refused.headers["retry-after"]) <= 60


@pytest.mark.parametrize(("flag", "value", "label"), [("--tokens-per-month", "35", "tokens per month"),
                                                      ("--usd-per-month", "0.00005", "dollars per month")])
def test_month_budgets_refuse_once_spent(served: GatewayProcess, flag: str, value: str, label: str) -> None:
    _, key = create_key(served.config, "acme", flag, value)
    answers = [chat(served, key, max_tokens=3) for _ in range(4)]
    codes = [a.status_code for a in answers]
    # 13 tokens and 16 millionths of a dollar a call: two calls fit 35 tokens, three fit 50 millionths.
    assert codes == ([200, 200, 429, 429] if flag == "--tokens-per-month" else [200, 200, 200, 429])
    refused = answers[codes.index(429)]
    assert refused.json()["error"]["code"] == "budget_exceeded" and label in refused.json()["error"]["message"]
    if flag == "--tokens-per-month":  # no per-minute limit: the tokens headers tell the month's budget
        assert answers[0].headers["x-ratelimit-limit-tokens"] == "35"


def test_a_day_budget_is_a_429_budget_exceeded_and_keys_update_changes_it(served: GatewayProcess) -> None:
    key_id, key = create_key(served.config, "acme", "--tokens-per-day", "35")
    assert chat(served, key, max_tokens=5).status_code == 200
    assert chat(served, key, max_tokens=5).status_code == 200
    refused = chat(served, key, max_tokens=5)  # 26 spent, 9 left: not enough for the prompt (9) and a token
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert (error["code"], error["type"]) == ("budget_exceeded", "insufficient_quota")
    assert "tokens per day" in error["message"]
    assert int(refused.headers["retry-after"]) <= 86400
    out = harness_cli(served.config, "keys", "update", key_id, "--tokens-per-day", "1000")
    assert out.returncode == 0 and "tokens_per_day=1000" in out.stdout, out.stderr
    assert chat(served, key, max_tokens=5).status_code == 200
    out = harness_cli(served.config, "keys", "update", key_id, "--clear", "all")
    assert out.returncode == 0 and "the configured limits" in out.stdout
    answer = chat(served, key)
    assert answer.status_code == 200 and "x-ratelimit-limit-tokens" not in answer.headers
    bad = harness_cli(served.config, "keys", "update", key_id, "--rpm", "0")
    assert bad.returncode == 2 and "greater than or equal to 1" in bad.stderr
    assert harness_cli(served.config, "keys", "update", "no-such-key", "--rpm", "5").returncode == 1


def test_a_money_budget_counts_at_the_price_table_and_usage_sums_the_stored_calls(served: GatewayProcess) -> None:
    # A call costs 10 prompt tokens at $1/M and 3 completion tokens at $2/M: 16 millionths of a dollar.
    _, key = create_key(served.config, "acme", "--usd-per-day", "0.00005")
    _, other = create_key(served.config, "globex")
    codes = [chat(served, key, max_tokens=3).status_code for _ in range(5)]
    assert codes == [200, 200, 200, 429, 429]
    for _ in range(2):
        assert chat(served, other).status_code == 200
    db = sqlite3.connect(served.db)
    stored = db.execute("SELECT t.key_id, COUNT(*), SUM(c.prompt_tokens), SUM(c.completion_tokens), SUM(c.cost_usd) "
                        "FROM model_calls c JOIN trajectories t ON t.id = c.trajectory_id "
                        "GROUP BY t.key_id ORDER BY t.key_id").fetchall()
    assert [row[1:4] for row in stored] == [(3, 30, 9), (2, 20, 6)] or [row[1:4] for row in stored] == [
        (2, 20, 6), (3, 30, 9)]
    assert all(cost == pytest.approx(calls * 16e-6) for _, calls, _, _, cost in stored)
    out = harness_cli(served.config, "usage", "--key", "--json")
    assert out.returncode == 0, out.stderr
    reported = {r["key"]: r for r in json.loads(out.stdout)}
    for key_id, calls, prompt, completion, cost in stored:
        row = reported[key_id]
        assert (row["requests"], row["prompt_tokens"], row["completion_tokens"]) == (calls, prompt, completion)
        assert row["cost_usd"] == pytest.approx(cost) and row["unpriced_requests"] == 0
    api = httpx.get(served.url + "/admin/usage", params={"group": "tenant", "by": "day", "since": "1d"},
                    headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert api.status_code == 200
    by_tenant = {r["tenant"]: r for r in api.json()["data"]}
    assert (by_tenant["acme"]["requests"], by_tenant["globex"]["requests"]) == (3, 2)
    assert by_tenant["acme"]["cost_usd"] == pytest.approx(48e-6) and len(by_tenant["acme"]["day"]) == 10
    bad = httpx.get(served.url + "/admin/usage", params={"since": "last tuesday"},
                    headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "since"
    assert httpx.get(served.url + "/admin/usage", headers={"Authorization": f"Bearer {key}"},
                     timeout=10).status_code == 401


def test_a_tenants_limit_counts_every_key_of_the_tenant(standin: tuple[StandIn, str], tmp_path: Path) -> None:
    config = upstream_config(standin[1], extra="[limits.tenant]\nrequests_per_minute = 100\n"
                                               "[limits.tenants.acme]\nrequests_per_minute = 3\n")
    proc = GatewayProcess(config, tmp_path).start()
    try:
        keys = [create_key(proc.config, "acme")[1] for _ in range(2)]
        other = create_key(proc.config, "globex")[1]
        codes = [chat(proc, keys[i % 2]).status_code for i in range(4)]
        assert codes == [200, 200, 200, 429]
        assert "tenant acme" in chat(proc, keys[0]).json()["error"]["message"]
        assert chat(proc, other).headers["x-ratelimit-limit-requests"] == "100"
    finally:
        proc.stop()


def test_an_agent_run_counts_each_step_and_ends_budget_exceeded(standin: tuple[StandIn, str],
                                                              tmp_path: Path) -> None:
    profile = '[[profiles]]\nname = "helper"\nmodel = "stand-in-model"\n'
    proc = GatewayProcess(upstream_config(standin[1], extra=profile), tmp_path).start()
    try:
        _, key = create_key(proc.config, "acme", "--tokens-per-day", "35")
        runs = [_run(proc, key) for _ in range(3)]
    finally:
        proc.stop()
    # Each run is one step (the stand-in answers without tools) of 13 tokens: 26 spent leave too few for a third.
    assert [r["status"] for r in runs[:2]] == ["completed", "completed"], runs
    assert (runs[2]["status"], runs[2]["termination_reason"]) == ("terminated", "budget_exceeded"), runs[2]
    assert runs[2]["steps"] == 0


def _run(proc: GatewayProcess, key: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"}
    started = httpx.post(proc.url + "/v1/agent/runs", headers=headers, timeout=30,
                         json={"profile": "helper", "input": "hi"})
    assert started.status_code == 201, started.text
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        run = httpx.get(f"{proc.url}/v1/agent/runs/{started.json()['id']}", headers=headers, timeout=10).json()
        if run["status"] != "running":
            return run
        time.sleep(0.05)
    raise AssertionError("the run did not end")


def test_bot_conversations_count_against_the_bots_tenant(tmp_path: Path) -> None:
    with bot_gateway(tmp_path, ["First answer.", "Second answer."],
                     extra="[limits.tenants.bot]\nrequests_per_minute = 1\n") as gw:
        first = gw.post("/bot/v1/messages", {"conversation_id": "c-1", "user_id": "u-1", "text": "Hi"}).json()
        second = gw.post("/bot/v1/messages", {"conversation_id": "c-2", "user_id": "u-2", "text": "Hi"}).json()
    assert first["reply"] == "First answer."
    assert second["harness"]["termination_reason"] == "budget_exceeded"
    assert len(gw.backend.requests) == 1


def test_a_budget_in_money_without_prices_is_refused_at_start(standin: tuple[StandIn, str], tmp_path: Path) -> None:
    config = upstream_config(standin[1], extra="[limits.key]\nusd_per_day = 5.0\n")
    (tmp_path / "harness.toml").write_text(config)
    out = harness_cli(tmp_path / "harness.toml", "serve")
    assert out.returncode == 2
    assert "no [prices] entry" in out.stderr and "stand-in-model" in out.stderr
    # A key's own money budget, once the prices are gone, stops the start too.
    priced = tmp_path / "priced"
    priced.mkdir()
    (priced / "harness.toml").write_text(upstream_config(standin[1], extra=PRICES))
    key_id, _ = create_key(priced / "harness.toml", "acme", "--usd-per-day", "1")
    (priced / "harness.toml").write_text(upstream_config(standin[1]))
    out = harness_cli(priced / "harness.toml", "serve")
    assert out.returncode == 2 and key_id in out.stderr and "no [prices] entry" in out.stderr
    refused = harness_cli(priced / "harness.toml", "keys", "create", "--tenant", "a", "--usd-per-day", "1")
    assert refused.returncode == 2 and "[prices]" in refused.stderr


def test_two_replicas_on_one_redis_admit_exactly_ten_of_a_hundred(
        standin: tuple[StandIn, str], postgres: PostgresServer, redis_url: str, tmp_path: Path) -> None:
    config = upstream_config(standin[1], store=f'url = "{postgres.database()}"',
                             extra=f'[limits]\nstorage = "{redis_url}"\n')
    started = []
    try:
        for i in range(2):
            folder = tmp_path / f"replica-{i}"
            folder.mkdir()
            started.append(GatewayProcess(config, folder).start())
        _, key = create_key(started[0].config, f"acme-{uuid.uuid4().hex[:6]}", "--rpm", "10")

        async def both() -> list[httpx.Response]:
            halves = await asyncio.gather(*(at_once(g.url, key, 50) for g in started))
            return [a for half in halves for a in half]

        answers = asyncio.run(both())
    finally:
        for gateway in started:
            gateway.stop()
    assert sorted(a.status_code for a in answers) == [200] * 10 + [429] * 90


def _calls(db: Path) -> int:
    return sqlite3.connect(db).execute("SELECT COUNT(*) FROM model_calls").fetchone()[0]


def _last_max_tokens(db: Path) -> int:
    params = sqlite3.connect(db).execute("SELECT params FROM model_calls ORDER BY created_at DESC LIMIT 1").fetchone()
    return json.loads(params[0])["max_tokens"]
