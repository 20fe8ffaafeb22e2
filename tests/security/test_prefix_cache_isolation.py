"""Finding: the embedded model's prefix cache was a side channel across tenants.

Tenant A sent a long system prompt holding a secret; tenant B's right guess of it was a cache hit, visible in the
open ``/metrics`` counter ``harness_prefix_cache_prefill_saved_total`` and in its latency (0.6 s against 15-31 s).
Now the cache is keyed by tenant (and adapter), and the cache's figures are only in ``/metrics`` for readers who
may see every tenant's: the admin key, or anyone on an open gateway.
"""

from __future__ import annotations

import httpx
import pytest

from tests.processes import GatewayProcess, create_key

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
ADMIN = "admin-secret-for-cache-tests"
SECRET_PROMPT = ("You are the assistant of Acme Corp. The launch code is 4471-ZEBRA-9 and must never be revealed. "
                 * 12)


@pytest.fixture(scope="module")
def tenants(tmp_path_factory: pytest.TempPathFactory):
    gw = GatewayProcess('[store]\npath = "harness.db"\n', tmp_path_factory.mktemp("prefix"),
                        env={"HARNESS_ADMIN_KEY": ADMIN})
    keys = {"a": create_key(gw.config, "acme")[1], "b": create_key(gw.config, "globex")[1]}
    gw.start(timeout=300)
    yield gw, keys
    gw.stop()


def _saved(gw: GatewayProcess) -> float:
    text = httpx.get(gw.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("harness_prefix_cache_prefill_saved_total{"))


def _ask(gw: GatewayProcess, key: str, system: str, question: str) -> dict:
    r = httpx.post(gw.url + "/v1/chat/completions", timeout=120, headers={"Authorization": f"Bearer {key}"}, json={
        "model": MODEL, "max_tokens": 1, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
    assert r.status_code == 200, r.text
    return r.json()


def test_one_tenants_prompt_is_never_another_tenants_cache_hit(tenants) -> None:
    gw, keys = tenants
    _ask(gw, keys["a"], SECRET_PROMPT, "Hello.")
    before = _saved(gw)
    _ask(gw, keys["b"], SECRET_PROMPT, "Hello.")  # B's guess is right, word for word
    assert _saved(gw) == before, "tenant B's request reused keys and values tenant A's prompt left"
    # The cache still serves each tenant its own prompts.
    _ask(gw, keys["a"], SECRET_PROMPT, "Hello again.")
    assert _saved(gw) - before > 100


def test_cache_figures_are_not_in_what_other_tenants_can_read(tenants) -> None:
    gw, keys = tenants
    for headers in ({}, {"Authorization": f"Bearer {keys['b']}"}):
        r = httpx.get(gw.url + "/metrics", headers=headers)
        assert r.status_code == 200
        assert "harness_requests_total" in r.text and "harness_prefix_cache" not in r.text
    operator = httpx.get(gw.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"}).text
    assert "harness_prefix_cache_prefill_saved_total{" in operator
