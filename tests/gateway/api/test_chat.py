"""The chat-completions surface of a real gateway process, driven by the real openai SDK."""

import asyncio
import sqlite3
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.processes import GatewayProcess, upstream_config

pytestmark = pytest.mark.integration

MODEL = "stand-in-model"


def _client(gw: GatewayProcess, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, **kw)


def _rows(gw: GatewayProcess, sql: str, args: tuple = ()) -> list[tuple]:
    db = sqlite3.connect(gw.db)
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


def test_non_streaming_round_trip_is_recorded(shared_gateway: GatewayProcess) -> None:
    raw = _client(shared_gateway).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello gateway"}])
    tid = raw.headers["x-harness-trajectory-id"]
    completion = raw.parse()
    assert completion.choices[0].message.content == "echo: hello gateway"
    [(status, n_calls, prompt, completion_tokens)] = _rows(
        shared_gateway, "SELECT status, n_calls, prompt_tokens, completion_tokens FROM trajectories WHERE id = ?",
        (tid,))
    assert (status, n_calls, prompt, completion_tokens) == ("completed", 1, 10, 3)


def test_streaming_with_and_without_usage(shared_gateway: GatewayProcess) -> None:
    client = _client(shared_gateway)
    with client.chat.completions.with_streaming_response.create(
            model=MODEL, messages=[{"role": "user", "content": "one two three"}], stream=True,
            stream_options={"include_usage": True}) as raw:
        tid = raw.headers["x-harness-trajectory-id"]
        chunks = list(raw.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip() == "echo: one two three"
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == 13
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "no usage please"}], stream=True))
    assert all(c.choices for c in chunks), "a usage chunk leaked to a client that did not ask for it"
    # usage was still recorded, because the gateway asks the upstream for it
    assert _rows(shared_gateway, "SELECT prompt_tokens FROM trajectories ORDER BY id DESC LIMIT 1") == [(10,)]
    assert _rows(shared_gateway, "SELECT stream, status FROM model_calls WHERE trajectory_id = ?",
                 (tid,)) == [(1, "ok")]


async def test_async_client_streaming_and_not(shared_gateway: GatewayProcess) -> None:
    client = openai.AsyncOpenAI(base_url=shared_gateway.url + "/v1", api_key="unused", max_retries=0)
    done = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "async"}])
    assert done.choices[0].message.content == "echo: async"
    stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a b"}],
                                                  stream=True)
    parts = [c.choices[0].delta.content async for c in stream if c.choices and c.choices[0].delta.content]
    assert "".join(parts).strip() == "echo: a b"
    results = await asyncio.gather(*[client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"parallel {i}"}]) for i in range(20)])
    assert sorted(r.choices[0].message.content for r in results) == sorted(f"echo: parallel {i}" for i in range(20))
    await client.close()


def test_tool_calls_and_parameters_pass_through(shared_gateway: GatewayProcess, standin) -> None:
    app, _ = standin
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    client = _client(shared_gateway)
    params = dict(temperature=0.3, top_p=0.9, max_tokens=17, stop=["END"], seed=7, n=1,
                  response_format={"type": "text"}, tool_choice="auto", parallel_tool_calls=False)
    done = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "tool"}], tools=tools,
                                          **params)
    call = done.choices[0].message.tool_calls[0]
    assert done.choices[0].finish_reason == "tool_calls"
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    sent = app.calls[-1]
    for key, value in params.items():
        assert sent[key] == value, key
    assert sent["tools"] == tools
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "tool"}],
                                            tools=tools, stream=True)
    deltas = [c.choices[0].delta for c in stream if c.choices]
    args = "".join(tc.function.arguments or "" for d in deltas for tc in (d.tool_calls or []))
    assert args == '{"city": "Paris"}'


@pytest.mark.parametrize("body, status, param", [
    (b"{not json", 400, None),
    (b'{"model": "stand-in-model"}', 400, "messages"),
    (b'{"model": "stand-in-model", "messages": "hi"}', 400, "messages"),
    (b'{"model": "stand-in-model", "messages": [{"role": "user", "content": "x"}], "temperature": "hot"}',
     400, "temperature"),
    (b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
    (b'{"model": "stand-in-model", "messages": [{"role": "user", "content": "x"}], "tools": '
     b'[{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]}', 400,
     "tools[0].function.parameters"),
])
def test_bad_input_gets_an_openai_error(shared_gateway: GatewayProcess, body: bytes, status: int, param) -> None:
    r = httpx.post(shared_gateway.url + "/v1/chat/completions", content=body,
                   headers={"content-type": "application/json"})
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


USER = {"role": "user", "content": "x"}
CALL = {"role": "assistant", "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("extra, param, code", [
    ({"messages": [USER, CALL, {"role": "tool", "content": "1"}]}, "messages[2].tool_call_id",
     "missing_required_parameter"),
    ({"stream": "yes"}, "stream", "invalid_type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice.function.name",
     "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"type": "hologram", "hologram": {}}]}]},
     "messages[0].content[0].type", "invalid_value"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "invalid_value"),
    ({"messages": [USER, CALL, USER]}, "messages[1].role", "invalid_value"),
])
def test_what_openai_refuses_is_refused_and_not_recorded(gateway: GatewayProcess, extra: dict, param: str,
                                                         code: str) -> None:
    r = httpx.post(gateway.url + "/v1/chat/completions",
                   json={"model": "stand-in-model", "messages": [USER], **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", param, code), err
    assert _rows(gateway, "SELECT COUNT(*) FROM trajectories") == [(0,)]


def test_unknown_top_level_fields_still_pass_through(standin, shared_gateway: GatewayProcess) -> None:
    asked = {"role": "user", "content": "pass the knob through"}
    r = httpx.post(shared_gateway.url + "/v1/chat/completions",
                   json={"model": "stand-in-model", "messages": [asked], "vendor_knob": {"depth": 3}})
    assert r.status_code == 200, r.text
    assert [c["vendor_knob"] for c in standin[0].calls if c["messages"][-1] == asked] == [{"depth": 3}]


def test_sdk_sees_bad_request_as_an_openai_error(shared_gateway: GatewayProcess) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        _client(shared_gateway).chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert exc.value.code == "model_not_found"


def test_body_over_the_limit(standin, tmp_path: Path) -> None:
    gw = GatewayProcess(upstream_config(standin[1]), tmp_path,
                        env={"HARNESS_SERVER__MAX_BODY_BYTES": "2000"}).start()
    try:
        big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}
        r = httpx.post(gw.url + "/v1/chat/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunked():
            yield b'{"model": "stand-in-model", "messages": [{"role": "user", "content": "'
            for _ in range(10):
                yield b"y" * 500
            yield b'"}]}'
        r = httpx.post(gw.url + "/v1/chat/completions", content=chunked())
        assert r.status_code == 413
        assert httpx.post(gw.url + "/v1/chat/completions",
                          json={"model": MODEL, "messages": [{"role": "user", "content": "small"}]}).status_code == 200
    finally:
        gw.stop()


@pytest.mark.parametrize("command, status, max_seconds", [
    ("status:500", 502, 3.0),   # retried, then a clear 502
    ("status:429", 429, 3.0),   # retried, then passed on so the client backs off
    ("status:400", 400, 3.0),   # the upstream's own 4xx passes through
    ("garbage", 502, 3.0),
    ("slow:30", 504, 4.5),      # read_timeout is 2 s: bounded, never a hang
])
def test_upstream_faults_map_to_clear_errors(shared_gateway: GatewayProcess, command: str, status: int,
                                             max_seconds: float) -> None:
    started = time.monotonic()
    r = httpx.post(shared_gateway.url + "/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": [{"role": "user", "content": command}]})
    assert r.status_code == status, r.text
    assert time.monotonic() - started < max_seconds
    assert r.json()["error"]["message"]
    assert r.headers["x-harness-trajectory-id"]


def test_flaky_upstream_is_retried(shared_gateway: GatewayProcess) -> None:
    r = httpx.post(shared_gateway.url + "/v1/chat/completions",
                   json={"model": MODEL, "messages": [{"role": "user", "content": f"flaky {time.time()}"}]})
    assert r.status_code == 200


def test_upstream_down_is_503(tmp_path: Path) -> None:
    from tests.standin import free_port

    gw = GatewayProcess(upstream_config(f"http://127.0.0.1:{free_port()}"), tmp_path).start()
    try:
        started = time.monotonic()
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "anyone?"}]})
        assert r.status_code == 503 and "unreachable" in r.json()["error"]["message"]
        assert time.monotonic() - started < 5
        with pytest.raises(openai.InternalServerError):
            _client(gw).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True)
    finally:
        gw.stop()


def test_stream_that_stalls_ends_with_an_error_event(gateway: GatewayProcess) -> None:
    started = time.monotonic()
    stream = _client(gateway).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "stall"}], stream=True)
    with pytest.raises(openai.APIError, match="stalled"):
        list(stream)
    assert time.monotonic() - started < 5
    assert _rows(gateway, "SELECT status FROM model_calls ORDER BY created_at DESC LIMIT 1") == [("error",)]


def test_client_disconnect_cancels_upstream_and_keeps_partial(gateway: GatewayProcess, standin) -> None:
    app, _ = standin
    before = app.disconnects
    with httpx.Client(timeout=10) as client:
        with client.stream("POST", gateway.url + "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "stall"}], "stream": True}) as r:
            tid = r.headers["x-harness-trajectory-id"]
            first = next(r.iter_lines())
            assert first.startswith("data: ")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        rows = _rows(gateway, "SELECT status FROM trajectories WHERE id = ?", (tid,))
        if rows and app.disconnects > before:
            break
        time.sleep(0.05)
    assert rows == [("client_disconnected",)]
    assert app.disconnects > before, "the upstream request was not cancelled"
    # the partial message that was streamed is kept
    shown = httpx.get(f"{gateway.url}/v1/trajectories/{tid}").json()
    [call] = shown["calls"]
    assert call["status"] == "client_disconnected"
    assert call["response"]["choices"][0]["message"]["role"] == "assistant"


def test_resent_history_is_one_trajectory_and_an_edit_forks(gateway: GatewayProcess) -> None:
    client = _client(gateway)
    history = [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"start {time.time()}"}]
    first = client.chat.completions.with_raw_response.create(model=MODEL, messages=history)
    tid = first.headers["x-harness-trajectory-id"]
    history.append(first.parse().choices[0].message.model_dump(exclude_none=True))
    history.append({"role": "user", "content": "and then?"})
    second = client.chat.completions.with_raw_response.create(model=MODEL, messages=history)
    assert second.headers["x-harness-trajectory-id"] == tid
    edited = history[:-1] + [{"role": "user", "content": "something else entirely"}]
    forked = client.chat.completions.with_raw_response.create(model=MODEL, messages=edited)
    fork_id = forked.headers["x-harness-trajectory-id"]
    assert fork_id != tid
    assert _rows(gateway, "SELECT parent_id FROM trajectories WHERE id = ?", (fork_id,)) == [(tid,)]
    assert _rows(gateway, "SELECT n_calls, message_count FROM trajectories WHERE id = ?", (tid,)) == [(2, 5)]


def test_session_header_and_prompt_cache_key_stitch(gateway: GatewayProcess) -> None:
    client = _client(gateway)
    ids = set()
    for text in ("first", "unrelated second"):  # histories that share nothing, one session
        r = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": text}], extra_headers={"X-Harness-Session": "s-42"})
        ids.add(r.headers["x-harness-trajectory-id"])
    assert len(ids) == 2  # a history that does not extend the stored one forks...
    rows = _rows(gateway, "SELECT parent_id FROM trajectories WHERE session_key = 'session:s-42' ORDER BY id")
    assert rows[1][0] is not None  # ...and records its parent
    a = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "pck"}], extra_body={"prompt_cache_key": "k1"})
    history = [{"role": "user", "content": "pck"}, {"role": "assistant", "content": "echo: pck"},
               {"role": "user", "content": "more"}]
    b = client.chat.completions.with_raw_response.create(model=MODEL, messages=history,
                                                         extra_body={"prompt_cache_key": "k1"})
    assert a.headers["x-harness-trajectory-id"] == b.headers["x-harness-trajectory-id"]


def test_models_health_and_metrics(shared_gateway: GatewayProcess) -> None:
    models = _client(shared_gateway).models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(shared_gateway.url + "/healthz").json()["status"] == "ok"
    _client(shared_gateway).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "count me"}])
    text = httpx.get(shared_gateway.url + "/metrics").text
    for name in ("harness_requests_total", "harness_request_latency_seconds_bucket", "harness_tokens_total",
                 "harness_errors_total", "harness_store_queue_depth", "harness_store_commit_seconds_bucket"):
        assert name in text, name
    assert 'harness_tokens_total{kind="prompt",model="stand-in-model"}' in text
    r = httpx.get(shared_gateway.url + "/no/such/route")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_an_upstream_reply_over_the_size_cap_is_a_502_recorded_as_an_error(standin, tmp_path: Path) -> None:
    gw = GatewayProcess(upstream_config(standin[1], backend="max_response_bytes = 1000000"), tmp_path).start()
    try:
        assert httpx.post(gw.url + "/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "big:500000"}]}).status_code == 200
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "big:2000000"}]})
        assert r.status_code == 502 and "larger than its limit of 1000000 bytes" in r.json()["error"]["message"]
        tid = r.headers["x-harness-trajectory-id"]
        assert _rows(gw, "SELECT status FROM model_calls WHERE trajectory_id = ?", (tid,)) == [("error",)]
        with httpx.stream("POST", gw.url + "/v1/chat/completions", timeout=30, json={
                "model": MODEL, "stream": True, "messages": [{"role": "user", "content": "big:3000000"}]}) as s:
            tid = s.headers["x-harness-trajectory-id"]
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        relayed = sum(len(line) for line in lines)
        assert relayed < 1_200_000, "the stream went on past the cap"
        assert any("more than its limit of 1000000 bytes" in line for line in lines[-2:]), lines[-2:]
        shown = httpx.get(f"{gw.url}/v1/trajectories/{tid}").json()
        [call] = shown["calls"]
        assert call["status"] == "error"
        assert len(call["response"]["choices"][0]["message"]["content"]) > 500_000  # the part that was relayed
    finally:
        gw.stop()
