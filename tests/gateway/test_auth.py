"""API keys, tenants, the admin key and the loopback-only open mode, on a real gateway process."""

import sqlite3
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from replay import keys
from tests.processes import GatewayProcess, create_key, harness_cli, upstream_config

pytestmark = pytest.mark.integration

MODEL = "stand-in-model"
ADMIN = "admin-secret-for-tests"


CACHE_SECONDS = 1.0


@pytest.fixture
def keyed(standin, tmp_path: Path):
    config = upstream_config(standin[1], extra=f"[server]\nauth_cache_seconds = {CACHE_SECONDS}\n")
    gw = GatewayProcess(config, tmp_path, env={"HARNESS_ADMIN_KEY": ADMIN})
    keys = {"acme": create_key(gw.config, "acme"), "globex": create_key(gw.config, "globex"),
            "quiet": create_key(gw.config, "acme", "--no-capture")}
    gw.start()
    yield gw, keys
    gw.stop()


def _chat(gw: GatewayProcess, key: str | None, text: str = "hi") -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(gw.url + "/v1/chat/completions", headers=headers,
                      json={"model": MODEL, "messages": [{"role": "user", "content": text}]})


def test_keys_are_required_once_they_exist(keyed) -> None:
    gw, keys = keyed
    r = _chat(gw, None)
    assert r.status_code == 401 and r.json()["error"]["code"] == "missing_api_key"
    assert _chat(gw, "sk-harness-wrong").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=gw.url + "/v1", api_key="nope", max_retries=0).models.list()
    assert _chat(gw, keys["acme"][1]).status_code == 200
    # stored hashed: the secret never appears in the database
    raw = Path(gw.db).read_bytes() + Path(str(gw.db) + "-wal").read_bytes() if Path(str(gw.db) + "-wal").exists() \
        else Path(gw.db).read_bytes()
    assert keys["acme"][1].encode() not in raw


def test_tenants_see_only_their_own_trajectories(keyed) -> None:
    gw, keys = keyed
    acme = _chat(gw, keys["acme"][1], "acme secret").headers["x-harness-trajectory-id"]
    globex = _chat(gw, keys["globex"][1], "globex secret").headers["x-harness-trajectory-id"]
    auth = {"Authorization": f"Bearer {keys['acme'][1]}"}
    listed = httpx.get(gw.url + "/v1/trajectories", headers=auth).json()["data"]
    assert [t["id"] for t in listed] == [acme]
    assert httpx.get(f"{gw.url}/v1/trajectories/{acme}", headers=auth).status_code == 200
    assert httpx.get(f"{gw.url}/v1/trajectories/{globex}", headers=auth).status_code == 404
    # the admin key sees all; keys do not reach admin routes
    admin = {"Authorization": f"Bearer {ADMIN}"}
    everything = httpx.get(gw.url + "/admin/trajectories", headers=admin).json()["data"]
    assert {acme, globex} <= {t["id"] for t in everything}
    r = httpx.get(gw.url + "/admin/trajectories", headers=auth)
    assert r.status_code == 401 and r.json()["error"]["code"] == "admin_key_required"
    assert httpx.get(f"{gw.url}/admin/trajectories/{globex}", headers=admin).json()["tenant"] == "globex"


def test_capture_can_be_switched_off_per_key(keyed) -> None:
    gw, keys = keyed
    r = _chat(gw, keys["quiet"][1], "off the record")
    assert r.status_code == 200 and r.headers["x-harness-trajectory-id"]
    conn = sqlite3.connect(gw.db)
    assert conn.execute("SELECT COUNT(*) FROM trajectories WHERE key_id = ?", (keys["quiet"][0],)).fetchone()[0] == 0


def test_revoked_key_stops_working(keyed) -> None:
    """Within the cache time: a revoked key keeps working at most that long."""
    gw, keys = keyed
    assert _chat(gw, keys["globex"][1]).status_code == 200
    out = harness_cli(gw.config, "keys", "revoke", keys["globex"][0])
    assert out.returncode == 0, out.stderr
    revoked = time.monotonic()
    while time.monotonic() - revoked < CACHE_SECONDS + 5 and _chat(gw, keys["globex"][1]).status_code == 200:
        time.sleep(0.05)
    honoured = time.monotonic() - revoked
    assert _chat(gw, keys["globex"][1]).status_code == 401
    assert honoured < CACHE_SECONDS + 0.5, f"a revoked key kept working for {honoured:.2f} s"
    listed = harness_cli(gw.config, "keys", "list", "--json")
    assert '"revoked_at":null' in listed.stdout and keys["globex"][0] in listed.stdout


def test_revoking_every_key_never_reopens_the_gateway(keyed) -> None:
    gw, keys = keyed
    for key_id, _ in keys.values():
        assert harness_cli(gw.config, "keys", "revoke", key_id).returncode == 0
    time.sleep(CACHE_SECONDS + 0.2)

    def refused() -> None:
        assert _chat(gw, None).status_code == 401
        assert _chat(gw, "garbage").status_code == 401
        for _, secret in keys.values():
            assert _chat(gw, secret).status_code == 401
        admin = httpx.get(gw.url + "/admin/trajectories", headers={"Authorization": f"Bearer {ADMIN}"})
        assert admin.status_code == 200

    refused()
    gw.stop()
    gw.start()  # the fact that keys were made lives in the store, not in the process
    refused()


def test_open_gateway_refuses_to_bind_beyond_loopback(tmp_path: Path) -> None:
    config = tmp_path / "h.toml"
    config.write_text('[store]\npath = "h.db"\n[server]\nhost = "0.0.0.0"\n[[backends]]\nname = "u"\n'
                      'kind = "openai"\nbase_url = "http://127.0.0.1:9/v1"\nmodels = ["m"]\n')
    out = harness_cli(config, "serve")
    assert out.returncode == 2
    assert "refusing to bind 0.0.0.0" in out.stderr


def test_feedback_goes_to_ones_own_trajectories_and_becomes_task_success(keyed) -> None:
    gw, keys = keyed
    acme = _chat(gw, keys["acme"][1], "acme question").headers["x-harness-trajectory-id"]
    mine = {"Authorization": f"Bearer {keys['acme'][1]}"}
    theirs = {"Authorization": f"Bearer {keys['globex'][1]}"}
    url = f"{gw.url}/v1/trajectories/{acme}/feedback"

    refused = httpx.post(url, headers=theirs, json={"rating": "up"})
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "not_found"
    assert httpx.post(url, json={"rating": "up"}).status_code == 401
    for body, param in (({"rating": "sideways"}, "rating"), ({"score": 1.5}, "score"),
                        ({"rating": "up", "score": 1}, "score"), ({"stars": 5}, "stars"),
                        ({"model_call_seq": -1, "rating": "up"}, "model_call_seq"), ({}, None)):
        bad = httpx.post(url, headers=mine, json=body)
        assert bad.status_code == 400, body
        assert bad.json()["error"]["type"] == "invalid_request_error" and bad.json()["error"]["param"] == param
    assert httpx.post(url, headers=mine, content=b"{not json").status_code == 400

    given = httpx.post(url, headers=mine, json={"rating": "down", "comment": "wrong total"})
    assert given.status_code == 201
    assert given.json() | {"trajectory_id": acme} == {
        "object": "trajectory.feedback", "trajectory_id": acme, "source": "user", "name": "thumbs", "value": 0.0,
        "label": "down", "comment": "wrong total", "model_call_seq": None}
    # The admin key may give feedback on any trajectory; the later verdict is the one that counts.
    assert httpx.post(url, headers={"Authorization": f"Bearer {ADMIN}"}, json={"score": 0.9}).status_code == 201
    with sqlite3.connect(gw.db) as conn:
        rows = conn.execute("SELECT source, name, value, label, comment FROM feedback WHERE trajectory_id = ? "
                            "ORDER BY created_at", (acme,)).fetchall()
    assert rows == [("user", "thumbs", 0.0, "down", "wrong total"), ("user", "score", 0.9, None, None)]

    out = harness_cli(gw.config, "replay", "rewards")
    assert out.returncode == 0, out.stderr
    with sqlite3.connect(gw.db) as conn:
        success = conn.execute("SELECT value FROM feedback WHERE trajectory_id = ? AND source = 'reward_engine' "
                               "AND name = 'task_success'", (acme,)).fetchone()
    assert success == (0.9,)


async def test_open_mode_is_loopback_only_and_ends_with_the_first_key(store) -> None:
    from starlette.datastructures import Headers

    from gateway.auth import OPEN, Authenticator
    from gateway.errors import APIError

    no_key = Headers({})
    assert await Authenticator(store, None, loopback=True, cache_seconds=0).authenticate(no_key) == OPEN
    with pytest.raises(APIError) as refused:
        await Authenticator(store, None, loopback=False, cache_seconds=0).authenticate(no_key)
    assert refused.value.status_code == 401
    auth = Authenticator(store, None, loopback=True, cache_seconds=0)
    key_id = await keys.create(store, tenant="t", name=None, capture=True, secret_hash="h")
    await keys.revoke(store, key_id)
    with pytest.raises(APIError):
        await auth.authenticate(no_key)
    with pytest.raises(APIError):
        await auth.authenticate(Headers({"authorization": "Bearer anything"}))


@pytest.mark.parametrize("mode", ["key", "admin"])
def test_metrics_can_require_a_key(standin, tmp_path: Path, mode: str) -> None:
    config = upstream_config(standin[1], extra=f'[server]\nmetrics_auth = "{mode}"\n')
    gw = GatewayProcess(config, tmp_path, env={"HARNESS_ADMIN_KEY": ADMIN})
    _, secret = create_key(gw.config, "acme")
    gw.start()
    try:
        def scrape(key: str | None) -> int:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            return httpx.get(gw.url + "/metrics", headers=headers).status_code

        assert scrape(None) == 401 and scrape("garbage") == 401
        assert scrape(ADMIN) == 200
        assert scrape(secret) == (200 if mode == "key" else 401)
    finally:
        gw.stop()


def test_the_messages_api_takes_keys_from_x_api_key_or_bearer(keyed) -> None:
    gw, keys = keyed
    ask = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(gw.url + "/v1/messages", json=ask)
    assert r.status_code == 401
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=gw.url, api_key="sk-harness-wrong", max_retries=0).messages.create(**ask)
    secret = keys["acme"][1]
    reply = anthropic.Anthropic(base_url=gw.url, api_key=secret, max_retries=0).messages.with_raw_response.create(**ask)
    assert reply.parse().content[0].type == "text"
    bearer = anthropic.Anthropic(base_url=gw.url, auth_token=secret, max_retries=0).messages.create(**ask)
    assert bearer.role == "assistant"
    db = sqlite3.connect(gw.db)
    try:
        tid = reply.headers["x-harness-trajectory-id"]
        assert db.execute("SELECT tenant FROM trajectories WHERE id = ?", (tid,)).fetchall() == [("acme",)]
    finally:
        db.close()
