"""What gateway replicas on one PostgreSQL database share, each a real ``harness serve``: a bot user's rate limit
(through Redis), webhook nonces (claimed in the database) and adapter registry changes (re-read every
``refresh_seconds``)."""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.bot.signing import signed_headers
from tests.gateway.adapters.test_lifecycle import adapter_folder
from tests.gateway.bot.support import Receiver
from tests.postgres import PostgresServer
from tests.processes import GatewayProcess, upstream_config
from tests.redis import RedisServer, require_redis
from tests.standin import ServerThread, StandIn
from tests.standins.vllm import VLLMStandIn

pytestmark = pytest.mark.integration

SECRET = "replica-bot-secret"
ADMIN = "replica-admin-key"
BASE = "qwen-test"
REFRESH = 1.0
PROFILE = """
[[profiles]]
name = "helper"
model = "stand-in-model"
[bot]
profile = "helper"
"""


def _config(standin: str, store: str, bot: str = "", extra: str = "") -> str:
    """The stand-in upstream answers the bot; ``store``: a PostgreSQL URL, or empty for the SQLite file."""
    return upstream_config(standin, store=f'url = "{store}"' if store else "", extra=extra + PROFILE + bot)


@contextmanager
def replicas(tmp_path: Path, config: str, count: int = 2) -> Iterator[list[GatewayProcess]]:
    """``count`` gateways with one configuration, each in its own folder; started one after the other."""
    started: list[GatewayProcess] = []
    try:
        for i in range(count):
            folder = tmp_path / f"replica-{i}"
            folder.mkdir()
            env = {"HARNESS_BOT_SECRET": SECRET, "HARNESS_ADMIN_KEY": ADMIN}
            started.append(GatewayProcess(config, folder, env=env).start())
        yield started
    finally:
        for gateway in started:
            gateway.stop()


def _message(user: str, n: int) -> bytes:
    return orjson.dumps({"conversation_id": f"{user}-c{n}", "user_id": user, "text": f"message {n}"})


def _post(gateway: GatewayProcess, raw: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
    headers = headers or signed_headers(SECRET.encode(), raw, time.time())
    return httpx.post(gateway.url + "/bot/v1/messages", content=raw, headers=headers, timeout=30)


def _refused(response: httpx.Response, code: str) -> bool:
    return response.status_code in (401, 429) and response.json()["error"]["code"] == code


# -- conversations ----------------------------------------------------------------------------------------------


def test_a_conversations_messages_landing_on_two_replicas_at_once_join_its_one_run_in_turn(
        standin: tuple[StandIn, str], postgres: PostgresServer, tmp_path: Path) -> None:
    """Two messages of one conversation sent at once, one to each replica, after its first, five times (the
    upstream takes 0.3 s a turn): the second replica's turn waits for the run's lease instead of carrying the run on
    beside the first, whose saved state would then lose one of the two. Each message is answered, and the run holds
    every turn."""
    url = postgres.database()

    def send(gateway: GatewayProcess) -> dict[str, Any]:
        raw = orjson.dumps({"conversation_id": "shared", "user_id": "ada", "text": "slow:0.3"})
        response = _post(gateway, raw)
        assert response.status_code in (200, 202), response.text
        return response.json()

    def answered(gateway: GatewayProcess, message: dict[str, Any]) -> dict[str, Any]:
        deadline = time.monotonic() + 30
        while message["status"] not in ("answered", "delivered") and time.monotonic() < deadline:
            time.sleep(0.1)
            message = httpx.get(f"{gateway.url}/bot/v1/messages/{message['id']}", timeout=10,
                                headers=signed_headers(SECRET.encode(), b"", time.time())).json()
        return message

    async def at_once(a: GatewayProcess, b: GatewayProcess) -> list[dict[str, Any]]:
        return list(await asyncio.gather(asyncio.to_thread(send, a), asyncio.to_thread(send, b)))

    with replicas(tmp_path, _config(standin[1], url)) as (a, b):
        first = answered(a, send(a))
        replies = [answered(a, m) for _ in range(5) for m in asyncio.run(at_once(a, b))]
        assert all(m["status"] in ("answered", "delivered") and m["reply"] == "echo: slow:0.3" for m in replies)
        import psycopg

        with psycopg.connect(url) as conn:
            [(state,)] = conn.execute("SELECT state FROM agent_runs WHERE id = %s", (first["run_id"],)).fetchall()
            assert conn.execute("SELECT COUNT(*) FROM agent_runs").fetchone()[0] == 1
    turns = [m for m in orjson.loads(state)["messages"] if m["role"] == "user"]
    assert len(turns) == 11, f"the run holds {len(turns)} of the 11 turns"


def test_a_message_a_restarting_replica_recovers_while_another_holds_it_is_answered_and_called_back_once(
        standin: tuple[StandIn, str], postgres: PostgresServer, tmp_path: Path) -> None:
    """A's first turn of a conversation is slow; its second message waits behind it, queued. B restarts meanwhile,
    and its recovery finds that message queued: both take it up, one answers it under the run's lease, and the other,
    finding it taken, leaves its delivery to that one. Each reply is called back once."""
    receiver = Receiver()
    bot = 'callback_allow_networks = ["127.0.0.0/8"]\ncallback_backoff_seconds = 0.05\nsync_timeout_seconds = 0.1\n'
    with ServerThread(receiver.app) as hook, \
            replicas(tmp_path, _config(standin[1], url := postgres.database(), bot)) as (a, b):
        def send(text: str) -> dict[str, Any]:
            raw = orjson.dumps({"conversation_id": "c", "user_id": "ada", "text": text,
                                "callback_url": hook.url + "/hook"})
            response = _post(a, raw)
            assert response.status_code == 202, response.text
            return response.json()

        first = send("slow:5")
        second = send("slow:0.2")
        assert second["status"] == "queued"
        b.stop()
        b.start()  # its recovery finds the second message queued
        receiver.wait(2, timeout=30)
        time.sleep(1.0)  # a second callback, if one were coming
        import psycopg

        with psycopg.connect(url) as conn:
            [(state,)] = conn.execute("SELECT state FROM agent_runs").fetchall()
    called = sorted(orjson.loads(body)["id"] for _, body in receiver.requests)
    assert called == sorted([first["id"], second["id"]])
    assert [m["content"] for m in orjson.loads(state)["messages"] if m["role"] == "user"] == ["slow:5", "slow:0.2"]


# -- rate limits ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("storage, accepted", [("redis", 3), ("memory://", 6)])
def test_a_users_rate_limit_counts_on_every_replica_when_they_share_redis(
        storage: str, accepted: int, request: pytest.FixtureRequest, standin: tuple[StandIn, str],
        postgres: PostgresServer, tmp_path: Path) -> None:
    """With 3 messages allowed, one user's six sent to A and B in turn: the fourth is refused wherever it lands
    when Redis counts them all; with each process counting its own, every one gets through."""
    url = request.getfixturevalue("redis_url") if storage == "redis" else storage
    user = f"u-{uuid.uuid4().hex[:8]}"  # the session's Redis is shared: a user of its own
    bot = f'rate_limit_messages = 3\nrate_limit_storage = "{url}"\n'
    with replicas(tmp_path, _config(standin[1], postgres.database(), bot)) as gateways:
        answers = [_post(gateways[n % 2], _message(user, n)) for n in range(6)]
    assert [a.status_code for a in answers] == [200] * accepted + [429] * (6 - accepted), [a.text for a in answers]
    for refused in answers[accepted:]:
        assert _refused(refused, "rate_limited")
        assert "at most 3 every 60 s" in refused.json()["error"]["message"]


def test_while_redis_hangs_or_is_down_messages_go_through_and_the_limit_returns_with_it(
        standin: tuple[StandIn, str], tmp_path: Path) -> None:
    """Fail open (``BotService.rate_limited`` says why), in about a second even when Redis hangs, logged once per
    outage; the limit is back with Redis (a restarted one empty, on the same port) without restarting the gateway."""
    redis = RedisServer(require_redis()).start()
    gateway = GatewayProcess(_config(standin[1], "", f'rate_limit_messages = 2\nrate_limit_storage = "{redis.url}"\n'),
                             tmp_path, env={"HARNESS_BOT_SECRET": SECRET})

    def sent(n: int) -> int:
        started = time.monotonic()
        status = _post(gateway, _message("ada", n)).status_code
        assert time.monotonic() - started < 2.0
        return status

    try:
        gateway.start()
        assert [sent(n) for n in range(3)] == [200, 200, 429]
        assert redis.proc is not None
        redis.proc.send_signal(signal.SIGSTOP)  # connections open, no answers: the timeouts end the wait
        assert sent(3) == 200
        redis.proc.send_signal(signal.SIGCONT)
        assert sent(4) == 429  # its counts are still there
        redis.stop()
        assert [sent(n) for n in range(5, 8)] == [200, 200, 200]
        redis.start()
        assert [sent(n) for n in range(8, 11)] == [200, 200, 429]
    finally:
        gateway.stop()
        redis.remove()
    log = gateway.log.read_text()
    assert log.count("bot.rate_limit_unavailable") == 2 and log.count("bot.rate_limit_restored") == 2, log[-3000:]


# -- webhook nonces ------------------------------------------------------------------------------------------


def test_a_signed_request_is_accepted_by_one_replica_only(standin: tuple[StandIn, str], postgres: PostgresServer,
                                                          tmp_path: Path) -> None:
    with replicas(tmp_path, _config(standin[1], postgres.database(), "rate_limit_messages = 0\n")) as (a, b):
        raw = _message("grace", 0)
        headers = signed_headers(SECRET.encode(), raw, time.time())
        assert _post(a, raw, headers).status_code == 200
        for replayed in (_post(b, raw, headers), _post(a, raw, headers)):
            assert _refused(replayed, "replayed_nonce"), replayed.text

        async def to_both(client: httpx.AsyncClient, n: int) -> list[httpx.Response]:
            raw = _message("linus", n)
            headers = signed_headers(SECRET.encode(), raw, time.time())
            return list(await asyncio.gather(*(client.post(g.url + "/bot/v1/messages", content=raw, headers=headers)
                                               for g in (a, b))))

        async def all_at_once() -> list[list[httpx.Response]]:
            async with httpx.AsyncClient(timeout=60) as client:
                return list(await asyncio.gather(*(to_both(client, n) for n in range(1, 21))))

        pairs = asyncio.run(all_at_once())
    for pair in pairs:
        accepted = [r for r in pair if r.status_code == 200]
        assert len(accepted) == 1 and any(_refused(r, "replayed_nonce") for r in pair), [r.text for r in pair]


# -- the adapter registry ------------------------------------------------------------------------------------


def _seen_after(since: float, check: Callable[[], bool]) -> float:
    """Seconds from ``since`` until ``check()`` holds; fails after twice the time allowed."""
    while not check():
        assert time.monotonic() - since < 2 * (REFRESH + 1), "not seen in time"
        time.sleep(0.05)
    return time.monotonic() - since


def test_registry_changes_made_on_one_replica_route_on_the_other_within_refresh_seconds(
        standin: tuple[StandIn, str], postgres: PostgresServer, tmp_path: Path) -> None:
    vllm = VLLMStandIn(served_model_name=BASE)
    with ServerThread(vllm.app) as upstream:
        adapters = f"""
[[backends]]
name = "vllm"
kind = "vllm"
base_url = "{upstream.url}/v1"
models = ["{BASE}"]
max_retries = 0
[routing]
refresh_seconds = {REFRESH}
"""
        with replicas(tmp_path, _config(standin[1], postgres.database(), extra=adapters)) as (a, b), \
                httpx.Client(base_url=a.url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30) as admin:

            def served_by(gateway: GatewayProcess) -> Any:
                response = httpx.post(gateway.url + "/v1/chat/completions", timeout=30, json={
                    "model": f"{BASE}:sql", "messages": [{"role": "user", "content": "hi"}]})
                return response.json()["choices"][0]["message"]["content"] if response.status_code == 200 else None

            def publish(version: int) -> float:
                """Register and promote ``version`` through A; when A answered."""
                folder = str(adapter_folder(tmp_path / f"sql-{version}"))
                registered = admin.post("/admin/adapters", json={"name": "sql", "base": BASE, "path": folder})
                assert registered.status_code == 201 and registered.json()["version"] == version, registered.text
                promoted = admin.post("/admin/adapters/sql/promote", json={"version": version})
                assert promoted.status_code == 200, promoted.text
                done = time.monotonic()
                assert served_by(a) == f"served by sql@{version}"  # A acts on its own change at once
                return done

            assert served_by(b) is None  # no such adapter yet
            first = _seen_after(publish(1), lambda: served_by(b) == "served by sql@1")
            second = _seen_after(publish(2), lambda: served_by(b) == "served by sql@2")
            listed = {card["id"] for card in httpx.get(b.url + "/v1/models", timeout=30).json()["data"]}
    assert {f"{BASE}:sql", f"{BASE}:sql@1", f"{BASE}:sql@2"} <= listed
    assert first < REFRESH + 1 and second < REFRESH + 1
