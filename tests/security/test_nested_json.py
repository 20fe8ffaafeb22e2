"""Finding: deeply nested JSON failed the store's group commit and took other tenants' exchanges with it.

A ``response_format`` schema nested 128 to 900 levels passed the door, failed where it was written out again
(orjson writes at most 254 levels) and failed the whole batch it was committed in. Now nesting is bounded where
the body is read (``gateway/protocol/nesting.py``), and a write the store cannot take fails alone
(``replay/writer.py``): the rest of its batch is committed.
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any

import httpx
import pytest

from tests.processes import GatewayProcess, create_key, upstream_config
from tests.security.support import stored_calls

pytestmark = pytest.mark.integration

MODEL = "stand-in-model"
DEPTHS = (64, 128, 200, 450, 900, 1500)


def _schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.fixture(scope="module")
def tenants(standin, tmp_path_factory: pytest.TempPathFactory):
    # Commits wait a little so that concurrent exchanges share batches, as they do under load.
    config = upstream_config(standin[1], store="commit_delay_ms = 20")
    gw = GatewayProcess(config, tmp_path_factory.mktemp("nested"))
    keys = {"attacker": create_key(gw.config, "attacker")[1], "victim": create_key(gw.config, "victim")[1]}
    gw.start()
    yield gw, keys
    gw.stop()


def _post(gw: GatewayProcess, key: str, body: dict[str, Any], path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(gw.url + path, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)


def _victims(gw: GatewayProcess, key: str, n: int, *, stream: bool = False) -> list[httpx.Response]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "plain"}], "stream": stream}
    with cf.ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda i: _post(gw, key, {**body, "messages": [
            {"role": "user", "content": f"plain {i}"}]}), range(n)))


def test_nested_schemas_are_refused_at_the_door_and_other_tenants_lose_nothing(tenants) -> None:
    gw, keys = tenants

    def attack(depth: int) -> httpx.Response:
        # Written by hand: the standard library's encoder recurses past its limit on the deepest of these.
        schema = '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth
        raw = (f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}], "response_format": '
               f'{{"type": "json_schema", "json_schema": {{"name": "deep", "schema": {schema}}}}}}}')
        return httpx.post(gw.url + "/v1/chat/completions", content=raw.encode(), timeout=30, headers={
            "Authorization": f"Bearer {keys['attacker']}", "content-type": "application/json"})

    with cf.ThreadPoolExecutor(4) as pool:
        attacks = [pool.submit(attack, d) for d in DEPTHS * 4]
        plain = _victims(gw, keys["victim"], 40)
    for done in attacks:
        r = done.result()
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "nesting_too_deep"
        assert r.json()["error"]["param"] in ("response_format", None)
    assert [r.status_code for r in plain] == [200] * len(plain)
    for r in plain:
        assert stored_calls(gw.db, r.headers["x-harness-trajectory-id"]) == 1
    assert "store.commit_failed" not in gw.log.read_text()


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": _schema(40)}}]}, "tools"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "metadata": {"a": _nested(80)}}, "metadata"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "f", "arguments": "[" * 100 + "]" * 100}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "f", "arguments": "[" * 5000 + "]" * 5000}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}, "messages"),
    ("/v1/responses", {"model": MODEL, "input": [
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{\"a\": " * 90 + "1" + "}" * 90},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}]}, "input"),
    ("/v1/responses", {"model": MODEL, "input": "hi", "text": {"format": {
        "type": "json_schema", "name": "deep", "schema": _schema(60)}}}, "text"),
    ("/v1/agent/runs", {"model": MODEL, "input": "hi", "metadata": {"a": _nested(100)}}, "metadata"),
])
def test_every_json_bearing_field_is_bounded(tenants, path: str, body: dict[str, Any], param: str) -> None:
    gw, keys = tenants
    r = _post(gw, keys["attacker"], body, path)
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {"message": r.json()["error"]["message"], "type": "invalid_request_error",
                                 "param": param, "code": "nesting_too_deep"}


def test_bodies_nested_past_what_json_readers_take_are_refused_too(tenants) -> None:
    gw, keys = tenants
    raw = b'{"model": "stand-in-model", "messages": [], "x": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    r = httpx.post(gw.url + "/v1/chat/completions", content=raw, timeout=30,
                   headers={"Authorization": f"Bearer {keys['attacker']}", "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "nesting_too_deep"


@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_answer_nested_too_deeply_is_a_bad_gateway(tenants, stream: bool) -> None:
    gw, keys = tenants
    r = _post(gw, keys["attacker"], {"model": MODEL, "stream": stream,
                                     "messages": [{"role": "user", "content": "deep:300"}]})
    if stream:
        assert r.status_code == 200 and "nested more than 64 levels" in r.text and "[DONE]" not in r.text, r.text
    else:
        assert r.status_code == 502 and "nested more than 64 levels" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("stream", [False, True])
def test_an_exchange_the_store_cannot_take_fails_alone(tenants, stream: bool) -> None:
    """The failure is injected from upstream: a token count larger than an SQLite integer, so the record's row
    fails inside the transaction, in the middle of other tenants' batches."""
    gw, keys = tenants

    def unstorable(i: int) -> httpx.Response:
        return _post(gw, keys["attacker"], {"model": MODEL, "stream": stream,
                                            "messages": [{"role": "user", "content": "overflow"}]})

    with cf.ThreadPoolExecutor(4) as pool:
        bad = [pool.submit(unstorable, i) for i in range(12)]
        plain = _victims(gw, keys["victim"], 40, stream=stream)
    for done in bad:
        r = done.result()
        if stream:  # the stream's finishing events are not sent: an error event takes their place
            assert r.status_code == 200 and "record_failed" in r.text and "[DONE]" not in r.text, r.text
        else:
            assert r.status_code == 502 and r.json()["error"]["code"] == "record_failed", r.text
    for r in plain:
        assert r.status_code == 200, r.text
        assert stored_calls(gw.db, r.headers["x-harness-trajectory-id"]) == 1
    log = gw.log.read_text()
    assert "store.record_rejected" in log and "store.commit_failed" not in log
