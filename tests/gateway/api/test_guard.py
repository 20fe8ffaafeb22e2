"""Proxy mode: the model's tool calls are checked against the client's own schemas before the client sees them."""

import sqlite3
from pathlib import Path

import openai
import pytest

from tests.gateway.api.support import serve
from tests.scripted import call

pytestmark = pytest.mark.integration

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def _tool_rows(served) -> list[tuple]:
    db = sqlite3.connect(served.app.state.gateway.settings.store.path)
    sql = "SELECT name, valid, status, validation_error FROM tool_calls ORDER BY step, created_at"
    return db.execute(sql).fetchall()


@pytest.fixture
def retried(tmp_path: Path):
    bad = call("get_weather", {"town": "Paris"}, call_id="call_bad")
    good = call("get_weather", {"city": "Paris"}, call_id="call_good")
    yield from serve(tmp_path, [bad, good, bad, good])


def test_invalid_call_is_sent_back_and_fixed(retried) -> None:
    raw = _client(retried.url).chat.completions.with_raw_response.create(model="scripted-model", messages=ASK,
                                                                          tools=TOOLS)
    [tool_call] = raw.parse().choices[0].message.tool_calls
    assert tool_call.id == "call_good" and tool_call.function.arguments == '{"city": "Paris"}'
    first, second = retried.backend.requests
    assert first["messages"] == ASK
    feedback = second["messages"][-1]
    assert feedback["role"] == "tool" and feedback["tool_call_id"] == "call_bad"
    assert "arguments.city: 'city' is a required property" in feedback["content"]
    rows = _tool_rows(retried)
    assert [(r[0], r[1], r[2]) for r in rows] == [("get_weather", 0, "retried"), ("get_weather", 1, "returned")]
    # one trajectory holds both calls; the client's next turn continues it
    tid = raw.headers["x-harness-trajectory-id"]
    history = ASK + [raw.parse().choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": "call_good", "content": "21 C"}]
    retried.backend.script[:] = ["It is 21 C."]
    again = _client(retried.url).chat.completions.with_raw_response.create(model="scripted-model", messages=history,
                                                                            tools=TOOLS)
    assert again.headers["x-harness-trajectory-id"] == tid


def test_streamed_text_flows_and_only_checked_calls_arrive(tmp_path: Path) -> None:
    bad = call("get_weather", {"town": "Paris"}, call_id="call_bad")
    bad["content"] = "Let me check."
    good = call("get_weather", {"city": "Paris"}, call_id="call_good")
    for served in serve(tmp_path, [bad, good]):
        chunks = list(_client(served.url).chat.completions.create(model="scripted-model", messages=ASK, tools=TOOLS,
                                                                  stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text.strip() == "Let me check."
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert [(tc.id, tc.function.name, tc.function.arguments) for tc in calls] == [
            ("call_good", "get_weather", '{"city": "Paris"}')]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        assert [r[2] for r in _tool_rows(served)] == ["retried", "returned"]


def test_still_invalid_after_retries_reaches_the_client_unchanged(tmp_path: Path) -> None:
    bad = call("get_weather", {"town": "Paris"}, call_id="call_bad")
    worse = call("get_weather", "not json at all", call_id="call_worse")
    for served in serve(tmp_path, [bad, worse]):
        done = _client(served.url).chat.completions.create(model="scripted-model", messages=ASK, tools=TOOLS)
        assert done.choices[0].message.tool_calls[0].id == "call_worse"
        rows = _tool_rows(served)
        assert [(r[1], r[2]) for r in rows] == [(0, "retried"), (0, "returned")]
        assert "not a JSON object" in rows[1][3]


def test_valid_calls_and_requests_without_tools_pass_untouched(tmp_path: Path) -> None:
    for served in serve(tmp_path, [call("get_weather", {"city": "Paris"}), "plain"]):
        done = _client(served.url).chat.completions.create(model="scripted-model", messages=ASK, tools=TOOLS)
        assert done.choices[0].message.tool_calls[0].function.arguments == '{"city": "Paris"}'
        assert _client(served.url).chat.completions.create(model="scripted-model", messages=ASK).choices[0] \
            .message.content == "plain"
        assert len(served.backend.requests) == 2


def test_streamed_fidelity_fragments_reasoning_and_finish_reasons(tmp_path: Path) -> None:
    """A checked, valid call reaches the client in the fragments the model sent; reasoning passes through."""
    good = call("get_weather", {"city": "Paris"}, call_id="call_good")
    good["reasoning_content"] = "The user wants weather."
    for served in serve(tmp_path, [good, "It is sunny."]):
        chunks = list(_client(served.url).chat.completions.create(model="scripted-model", messages=ASK, tools=TOOLS,
                                                                  stream=True, stream_options={"include_usage": True}))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        parts = [tc for d in deltas for tc in (d.tool_calls or [])]
        assert len(parts) > 2  # the name, then argument fragments, as OpenAI streams them
        assert (parts[0].index, parts[0].id, parts[0].function.name) == (0, "call_good", "get_weather")
        assert "".join(p.function.arguments or "" for p in parts) == '{"city": "Paris"}'
        assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == "The user wants weather."
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
            ["tool_calls"]
        assert chunks[-1].usage.total_tokens == 15
        text = list(_client(served.url).chat.completions.create(model="scripted-model", messages=ASK, stream=True))
        assert [c.choices[0].finish_reason for c in text if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_a_caller_asking_for_its_tokens_gets_the_answer_to_its_own_messages(retried) -> None:
    """A retried answer was sampled from other messages than the caller sent: one who trains on the tokens it is
    answered (return_token_ids) gets the first answer, checked but not retried."""
    raw = _client(retried.url).chat.completions.with_raw_response.create(
        model="scripted-model", messages=ASK, tools=TOOLS, extra_body={"return_token_ids": True})
    [tool_call] = raw.parse().choices[0].message.tool_calls
    assert tool_call.id == "call_bad"
    assert [r["messages"] for r in retried.backend.requests] == [ASK]
    assert [(r[1], r[2]) for r in _tool_rows(retried)] == [(0, "returned")]
    assert raw.headers["x-harness-backend"] == "scripted"
