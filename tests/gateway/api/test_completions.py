"""``POST /v1/completions`` through a real gateway process in front of the stand-in upstream, driven by the real
openai SDK: answers as the upstream gave them, each call recorded with its usage and its exchange as it came, never
as chat training data."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from replay.export import ExportOptions, iter_rows
from replay.filters import Filters
from replay.readonly import open_readonly
from replay.redact import Redactor
from tests.gateway.api.native_calls import CHAT_ONLY, MODEL, chat_only_backend, client, rows, stored_call
from tests.processes import GatewayProcess, create_key, upstream_config
from tests.standin import StandIn

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gw(standin: tuple[StandIn, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    proc = GatewayProcess(upstream_config(standin[1], extra=chat_only_backend(standin[1])),
                          tmp_path_factory.mktemp("completions")).start()
    yield proc
    proc.stop()


def test_a_completion_is_passed_through_and_recorded_with_its_usage(gw: GatewayProcess, standin) -> None:
    raw = client(gw).completions.with_raw_response.create(model=MODEL, prompt="Once upon a time", max_tokens=5,
                                                          temperature=0.5, stop=["\n"], echo=False)
    tid = raw.headers["x-harness-trajectory-id"]
    done = raw.parse()
    assert done.object == "text_completion"
    assert [c.text for c in done.choices] == ["echo: Once upon a time"]
    assert done.usage.prompt_tokens == 10 and done.usage.completion_tokens == 3
    sent = standin[0].calls[-1]
    assert (sent["prompt"], sent["max_tokens"], sent["temperature"], sent["stop"], sent["stream"]) == \
        ("Once upon a time", 5, 0.5, ["\n"], False)
    call = stored_call(gw, tid)
    assert (call["api"], call["status"], call["backend"], call["model"], call["stream"]) == \
        ("completions", "ok", "standin", MODEL, False)
    assert (call["prompt_tokens"], call["completion_tokens"]) == (10, 3) and call["latency_ms"] > 0
    assert call["messages"] == [] and call["replies"] == []  # nothing of it reads as a chat message
    assert call["request"]["prompt"] == "Once upon a time"
    assert call["response"]["choices"][0]["text"] == "echo: Once upon a time"
    assert rows(gw, "SELECT prompt_tokens, completion_tokens, n_calls FROM trajectories WHERE id = ?", (tid,)) == \
        [(10, 3, 1)]


def test_several_prompts_and_choices_pass_through(gw: GatewayProcess) -> None:
    done = client(gw).completions.create(model=MODEL, prompt=["first", "second"], n=2, best_of=2)
    assert [c.text for c in done.choices] == ["echo: first"] * 2 + ["echo: second"] * 2
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    tokens = client(gw).completions.create(model=MODEL, prompt=[1, 2, 3])
    assert tokens.choices[0].text == "echo: [1, 2, 3]"


def test_a_streamed_completion_is_relayed_and_recorded(gw: GatewayProcess) -> None:
    with client(gw).completions.with_streaming_response.create(model=MODEL, prompt="one two three",
                                                               stream=True) as raw:
        tid = raw.headers["x-harness-trajectory-id"]
        chunks = list(raw.parse())
    assert "".join(c.choices[0].text for c in chunks if c.choices).strip() == "echo: one two three"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.usage is None for c in chunks), "usage went to a client that did not ask for it"
    call = stored_call(gw, tid)
    assert (call["stream"], call["status"], call["prompt_tokens"], call["completion_tokens"]) == (True, "ok", 10, 3)
    assert call["response"]["choices"] == [{"index": 0, "text": "echo: one two three ", "logprobs": None,
                                            "finish_reason": "stop"}]
    with_usage = list(client(gw).completions.create(model=MODEL, prompt="count me", stream=True,
                                                    stream_options={"include_usage": True}))
    assert with_usage[-1].usage.total_tokens == 13 and with_usage[-1].choices == []


async def test_the_async_client_streams_too(gw: GatewayProcess) -> None:
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=30) as aclient:
        stream = await aclient.completions.create(model=MODEL, prompt="a b", stream=True)
        text = "".join([c.choices[0].text async for c in stream if c.choices])
    assert text.strip() == "echo: a b"


def test_an_upstream_error_maps_as_for_chat_and_is_recorded(gw: GatewayProcess) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client(gw).completions.create(model=MODEL, prompt="status:400")
    assert "stand-in failure 400" in refused.value.message
    with pytest.raises(openai.APIStatusError) as failed:
        client(gw).completions.create(model=MODEL, prompt="status:500", stream=True)
    assert failed.value.status_code == 502
    tid = failed.value.response.headers["x-harness-trajectory-id"]
    call = stored_call(gw, tid)
    assert (call["api"], call["status"], call["response"]) == ("completions", "error", None)


def test_a_model_whose_backend_does_not_serve_completions_is_a_404(gw: GatewayProcess) -> None:
    with pytest.raises(openai.NotFoundError) as unsupported:
        client(gw).completions.create(model=CHAT_ONLY, prompt="hi")
    error = unsupported.value.body
    assert (error["code"], error["param"]) == ("unsupported_api", "model")
    assert CHAT_ONLY in error["message"] and "/v1/completions" in error["message"]
    with pytest.raises(openai.NotFoundError) as unknown:
        client(gw).completions.create(model="nope", prompt="hi")
    assert unknown.value.body["code"] == "model_not_found"
    # the chat-only model still serves chat
    assert client(gw).chat.completions.create(model=CHAT_ONLY, messages=[{"role": "user", "content": "hi"}]) \
        .choices[0].message.content == "echo: hi"


@pytest.mark.parametrize("body, param", [
    (b'{"model": "stand-in-model"}', "prompt"),
    (b'{"model": "stand-in-model", "prompt": 5}', "prompt"),
    (b'{"model": "stand-in-model", "prompt": []}', "prompt"),
    (b'{"model": "stand-in-model", "prompt": ["a", [1]]}', "prompt[1]"),
    (b'{"model": "stand-in-model", "prompt": [[1], [-2]]}', "prompt[1][0]"),
    (b'{"model": "stand-in-model", "prompt": [1, 2.5]}', "prompt[1]"),
    (b'{"model": "stand-in-model", "prompt": [{}]}', "prompt[0]"),
    (b'{"model": "stand-in-model", "prompt": "x", "temperature": "hot"}', "temperature"),
    (b'{"model": "stand-in-model", "prompt": "x", "stream": "yes"}', "stream"),
    (b'{"model": "stand-in-model", "prompt": "x", "logprobs": 9}', "logprobs"),
    (b'{"model": "stand-in-model", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}', "stop"),
    (b'{"model": "stand-in-model", "prompt": "x", "n": 3, "best_of": 2}', "best_of"),
    (b'["not an object"]', None),
    (b"{not json", None),
])
def test_a_bad_body_is_a_400_naming_the_field(gw: GatewayProcess, body: bytes, param: str | None) -> None:
    r = httpx.post(gw.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=10)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param


def test_completions_and_embeddings_stay_out_of_chat_exports(gw: GatewayProcess, tmp_path: Path) -> None:
    """What exports and training read (``iter_rows``): chat calls, never a prompt or an embedding."""
    chat = client(gw).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "a chat turn"}])
    text = client(gw).completions.with_raw_response.create(model=MODEL, prompt="a raw prompt")
    vectors = client(gw).embeddings.with_raw_response.create(model=MODEL, input="some text")
    ids = {name: r.headers["x-harness-trajectory-id"] for name, r in
           (("chat", chat), ("completions", text), ("embeddings", vectors))}
    with open_readonly(gw.db) as conn:
        exported = list(iter_rows(conn, Filters(), ExportOptions(include_failed=True), Redactor(defaults=False)))
    trajectories = {row.trajectory["trajectory_id"] for row in exported}
    assert ids["chat"] in trajectories
    assert not {ids["completions"], ids["embeddings"]} & trajectories
    assert not any(b"a raw prompt" in row.messages or b"some text" in row.messages for row in exported)
    # read back whole, each names the API it came through
    for api, tid in ids.items():
        shown = httpx.get(f"{gw.url}/v1/trajectories/{tid}", timeout=10).json()
        assert shown["format"] == ("chat" if api == "chat" else api), shown


def _tokens(gw: GatewayProcess, kind: str) -> float:
    for line in httpx.get(gw.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f'harness_tokens_total{{kind="{kind}",model="{MODEL}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_tokens_are_counted_and_logged_as_for_chat(gw: GatewayProcess) -> None:
    before = _tokens(gw, "prompt"), _tokens(gw, "completion")
    raw = client(gw).completions.with_raw_response.create(model=MODEL, prompt="count these")
    tid = raw.headers["x-harness-trajectory-id"]
    assert (_tokens(gw, "prompt") - before[0], _tokens(gw, "completion") - before[1]) == (10, 3)

    def logged() -> list[dict]:
        return [entry for line in gw.log.read_text().splitlines() if line.startswith("{")
                and (entry := orjson.loads(line)).get("trajectory_id") == tid]

    deadline = time.monotonic() + 10
    while not logged() and time.monotonic() < deadline:  # the line is written once the response is out
        time.sleep(0.05)
    [entry] = logged()
    assert (entry["path"], entry["status"], entry["model"], entry["backend"], entry["prompt_tokens"],
            entry["completion_tokens"]) == ("/v1/completions", 200, MODEL, "standin", 10, 3)


def test_a_keys_calls_are_its_tenants_and_count_against_its_limits(standin: tuple[StandIn, str],
                                                                     tmp_path: Path) -> None:
    # A gateway of its own: once a key exists the shared one would, at its next key refresh, refuse the other
    # tests' keyless calls.
    gw = GatewayProcess(upstream_config(standin[1]), tmp_path).start()
    try:
        _calls_count_against_the_key(gw)
    finally:
        gw.stop()


def _calls_count_against_the_key(gw: GatewayProcess) -> None:
    key_id, key = create_key(gw.config, "acme", "--rpm", "2")
    keyed = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=30)
    text = keyed.completions.with_raw_response.create(model=MODEL, prompt="one")
    vectors = keyed.embeddings.with_raw_response.create(model=MODEL, input="two")
    for raw in (text, vectors):
        assert raw.headers["x-ratelimit-limit-requests"] == "2"
        assert rows(gw, "SELECT tenant, key_id FROM trajectories WHERE id = ?",
                    (raw.headers["x-harness-trajectory-id"],)) == [("acme", key_id)]
    with pytest.raises(openai.RateLimitError):
        keyed.completions.create(model=MODEL, prompt="three")


def test_a_stream_that_stalls_ends_with_an_error_event_and_is_recorded(gw: GatewayProcess) -> None:
    started = time.monotonic()
    with client(gw).completions.with_streaming_response.create(model=MODEL, prompt="stall", stream=True) as raw:
        tid = raw.headers["x-harness-trajectory-id"]
        with pytest.raises(openai.APIError, match="stalled"):
            list(raw.parse())
    assert time.monotonic() - started < 5  # the backend's read_timeout, 2 s
    call = stored_call(gw, tid)
    assert (call["status"], call["response"]["choices"][0]["text"]) == ("error", "echo: ")


def test_a_client_leaving_mid_stream_cancels_the_upstream_and_keeps_what_was_sent(gw: GatewayProcess,
                                                                                  standin) -> None:
    app, _ = standin
    before = app.disconnects
    with httpx.Client(timeout=10) as http, http.stream("POST", gw.url + "/v1/completions", json={
            "model": MODEL, "prompt": "stall", "stream": True}) as r:
        tid = r.headers["x-harness-trajectory-id"]
        assert next(r.iter_lines()).startswith("data: ")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not (rows(gw, "SELECT 1 FROM model_calls WHERE trajectory_id = ?", (tid,))
                                               and app.disconnects > before):
        time.sleep(0.05)
    assert app.disconnects > before, "the upstream request was not cancelled"
    call = stored_call(gw, tid)
    assert (call["status"], call["response"]["choices"][0]["text"]) == ("client_disconnected", "echo: ")
