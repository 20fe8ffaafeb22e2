"""The Responses API through a real gateway app, driven by the openai SDK's Responses client."""

import sqlite3
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from gateway.backends.base import BackendError
from tests.gateway.api.support import serve
from tests.scripted import call

pytestmark = pytest.mark.integration

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _rows(served, sql: str, args: tuple = ()) -> list[tuple]:
    db = sqlite3.connect(served.app.state.gateway.settings.store.path)
    try:
        return db.execute(sql, args).fetchall()
    finally:
        db.close()


def test_plain_and_streamed_text(tmp_path: Path) -> None:
    for served in serve(tmp_path, ["Hello there.", "Streamed hello."]):
        client = _client(served.url)
        raw = client.responses.with_raw_response.create(model="scripted-model", input="Say hello",
                                                        instructions="Be brief.")
        response = raw.parse()
        assert response.output_text == "Hello there." and response.status == "completed"
        assert response.usage.input_tokens == 10 and response.usage.output_tokens == 5
        assert served.backend.requests[0]["messages"] == [{"role": "system", "content": "Be brief."},
                                                          {"role": "user", "content": "Say hello"}]
        tid = raw.headers["x-harness-trajectory-id"]
        assert _rows(served, "SELECT n_calls FROM trajectories WHERE id = ?", (tid,)) == [(1,)]

        events = list(client.responses.create(model="scripted-model", input="Again", stream=True))
        types = [e.type for e in events]
        assert types[:2] == ["response.created", "response.in_progress"]
        assert types[-1] == "response.completed"
        for expected in ("response.output_item.added", "response.content_part.added", "response.output_text.delta",
                         "response.output_text.done", "response.content_part.done", "response.output_item.done"):
            assert expected in types
        assert [e.sequence_number for e in events] == list(range(len(events)))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text.strip() == "Streamed hello."
        assert events[-1].response.usage.total_tokens == 15


def test_function_call_round_trip_is_one_trajectory(tmp_path: Path) -> None:
    script = [call("get_weather", {"city": "Paris"}, call_id="call_w"), "It is 21 C in Paris."]
    for served in serve(tmp_path, script):
        client = _client(served.url)
        first = client.responses.with_raw_response.create(
            model="scripted-model", input="Weather in Paris?", tools=[WEATHER], prompt_cache_key="sess-1",
            stream=False)
        [item] = first.parse().output
        assert (item.type, item.name, item.call_id, item.arguments) == ("function_call", "get_weather", "call_w",
                                                                        '{"city": "Paris"}')
        # the whole history comes back, as Codex sends it over HTTP
        history = [{"role": "user", "content": "Weather in Paris?"},
                   {"type": "function_call", "call_id": "call_w", "name": "get_weather", "arguments": item.arguments},
                   {"type": "function_call_output", "call_id": "call_w", "output": "21 C"}]
        second = client.responses.with_raw_response.create(model="scripted-model", input=history, tools=[WEATHER],
                                                           prompt_cache_key="sess-1")
        assert second.parse().output_text == "It is 21 C in Paris."
        assert second.headers["x-harness-trajectory-id"] == first.headers["x-harness-trajectory-id"]
        sent = served.backend.requests[1]["messages"]
        assert sent[1]["tool_calls"][0]["id"] == "call_w"
        assert sent[2] == {"role": "tool", "tool_call_id": "call_w", "content": "21 C"}
        assert _rows(served, "SELECT n_calls FROM trajectories") == [(2,)]


def test_custom_and_namespace_tools_round_trip(tmp_path: Path) -> None:
    tools = [
        {"type": "custom", "name": "apply_patch", "description": "Apply a patch",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
        {"type": "namespace", "name": "files", "description": "File tools", "tools": [
            {"type": "function", "name": "read", "description": "Read a file",
             "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}]},
        {"type": "web_search"},
    ]
    patch = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_p", "type": "function", "function": {"name": "apply_patch",
                                                          "arguments": '{"input": "*** Begin Patch"}'}}]}
    for served in serve(tmp_path, [patch, call("files__read", {"path": "a.txt"}, call_id="call_r")]):
        client = _client(served.url)
        first = client.responses.create(model="scripted-model", input="patch it", tools=tools)
        [custom] = first.output
        assert (custom.type, custom.name, custom.input, custom.call_id) == (
            "custom_tool_call", "apply_patch", "*** Begin Patch", "call_p")
        offered = {t["function"]["name"] for t in served.backend.requests[0]["tools"]}
        assert offered == {"apply_patch", "files__read"}  # web_search dropped before the backend
        events = list(client.responses.create(model="scripted-model", input="read it", tools=tools, stream=True))
        done = events[-1].response.output[0]
        assert (done.type, done.name, done.namespace, done.arguments) == (
            "function_call", "read", "files", '{"path": "a.txt"}')


def test_store_previous_response_id_and_get(tmp_path: Path) -> None:
    for served in serve(tmp_path, ["First answer.", "Second answer.", "Unstored."]):
        client = _client(served.url)
        first = client.responses.create(model="scripted-model", input="one", instructions="Old instructions.")
        second = client.responses.create(model="scripted-model", input="two", previous_response_id=first.id,
                                         instructions="New instructions.")
        assert second.output_text == "Second answer."
        assert served.backend.requests[1]["messages"] == [
            {"role": "system", "content": "New instructions."}, {"role": "user", "content": "one"},
            {"role": "assistant", "content": "First answer."}, {"role": "user", "content": "two"}]
        fetched = client.responses.retrieve(second.id)
        assert fetched.id == second.id and fetched.output_text == "Second answer."
        unstored = client.responses.create(model="scripted-model", input="x", store=False)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(unstored.id)
        with pytest.raises(openai.NotFoundError) as exc:
            client.responses.create(model="scripted-model", input="y", previous_response_id=unstored.id)
        assert exc.value.code == "previous_response_not_found"


def test_bad_requests_are_400s(tmp_path: Path) -> None:
    for served in serve(tmp_path, []):
        for body, param in (({"input": "x"}, "model"), ({"model": "scripted-model", "input": 5}, "input")):
            r = httpx.post(served.url + "/v1/responses", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        r = httpx.post(served.url + "/v1/responses", json={"model": "nope", "input": "x"})
        assert r.status_code == 404


def test_a_call_without_its_output_is_refused_in_a_continuation_too(tmp_path: Path) -> None:
    """No output is invented for a call: OpenAI answers 400, and so does the gateway, recording nothing."""
    for served in serve(tmp_path, [call("get_weather", {"city": "Paris"})]):
        client = _client(served.url)
        first = client.responses.create(model="scripted-model", input="Weather in Paris?", tools=[WEATHER])
        (item,) = [o for o in first.output if o.type == "function_call"]
        recorded = _rows(served, "SELECT COUNT(*) FROM trajectories")
        with pytest.raises(openai.BadRequestError) as exc:
            client.responses.create(model="scripted-model", previous_response_id=first.id, tools=[WEATHER],
                                    input=[{"role": "user", "content": "and tomorrow?"}])
        assert exc.value.body["param"] == "input"
        assert exc.value.body["message"] == f"No tool output found for function call {item.call_id}."
        bare = [{"type": "function_call", "call_id": "c9", "name": "get_weather", "arguments": "{}"}]
        r = httpx.post(served.url + "/v1/responses", json={"model": "scripted-model", "input": bare})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
        assert _rows(served, "SELECT COUNT(*) FROM trajectories") == recorded
        assert len(served.backend.requests) == 1


class _Breaks:
    """A stream that sends some text, then fails."""

    def __init__(self, error: BackendError) -> None:
        self.error = error
        self.extras = None

    def __aiter__(self):
        return self._chunks()

    async def _chunks(self):
        yield {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "scripted-model",
               "choices": [{"index": 0, "delta": {"role": "assistant", "content": "partial "}, "finish_reason": None}]}
        raise self.error

    async def aclose(self) -> None:
        pass


@pytest.mark.parametrize("error, code", [
    (BackendError("upstream returned 500: boom", status_code=502), "server_error"),
    (BackendError("upstream is rate limiting: try again in 3s", status_code=429), "rate_limit_exceeded"),
    (BackendError("This model's maximum context length is 8192 tokens", status_code=400), "context_length_exceeded"),
])
def test_backend_failure_is_an_error_or_response_failed(tmp_path: Path, error: BackendError, code: str) -> None:
    for served in serve(tmp_path, [error]):
        r = httpx.post(served.url + "/v1/responses", json={"model": "scripted-model", "input": "x"})
        assert r.status_code == error.status_code and r.json()["error"]["message"] == error.message

        async def breaking(request):
            return _Breaks(error)
        served.backend.stream = breaking
        with httpx.stream("POST", served.url + "/v1/responses",
                          json={"model": "scripted-model", "input": "x", "stream": True}) as r:
            lines = list(r.iter_lines())
        events = [line[7:] for line in lines if line.startswith("event: ")]
        assert events[0] == "response.created" and "response.output_text.delta" in events
        assert events[-1] == "response.failed"
        failed = orjson.loads([line for line in lines if line.startswith("data: ")][-1][6:])
        assert failed["response"]["status"] == "failed"
        assert failed["response"]["error"] == {"code": code, "message": error.message}


def test_guard_applies_to_responses(tmp_path: Path) -> None:
    bad = call("get_weather", {"town": "Paris"}, call_id="call_bad")
    good = call("get_weather", {"city": "Paris"}, call_id="call_good")
    for served in serve(tmp_path, [bad, good]):
        events = list(_client(served.url).responses.create(model="scripted-model", input="Weather?", tools=[WEATHER],
                                                           stream=True))
        [item] = events[-1].response.output
        assert item.call_id == "call_good"
        assert "arguments.city" in served.backend.requests[1]["messages"][-1]["content"]


def test_agent_profile_through_responses(served) -> None:
    raw = httpx.post(served.url + "/v1/responses", json={"model": "agent:calc", "input": "What is 6*7?"})
    body = raw.json()
    assert body["output"][0]["content"][0]["text"] == "The answer is 42."
    assert body["harness"]["status"] == "completed" and body["harness"]["tool_calls"] == 1
    events = list(_client(served.url).responses.create(model="agent:calc", input="6*7?", stream=True))
    assert events[-1].type == "response.completed"
    assert events[-1].response.model_extra["harness"]["steps"] == 2
