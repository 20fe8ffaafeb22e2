"""Server-side agent runs over HTTP: chat completions with ``agent:<profile>``, and ``/v1/agent/runs``.

A real gateway app on a loopback port, thinking with a scripted stand-in model, using the real
calculator tool; clients are the openai SDK, LangChain and the OpenAI Agents SDK.
"""

import time

import httpx
import openai
import pytest

from tests.gateway.api.support import Served

pytestmark = pytest.mark.integration

def _client(s: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)


def test_agent_profile_through_chat_completions(served: Served) -> None:
    raw = _client(served).chat.completions.with_raw_response.create(
        model="agent:calc", messages=[{"role": "user", "content": "What is six times seven?"}])
    body = raw.http_response.json()
    assert body["choices"][0]["message"]["content"] == "The answer is 42."
    h = body["harness"]
    assert h["trajectory_id"] == raw.headers["x-harness-trajectory-id"]
    assert (h["status"], h["termination_reason"], h["steps"], h["tool_calls"], h["invalid_tool_calls"]) == \
        ("completed", None, 2, 1, 0)
    assert h["usage"]["total_tokens"] == 30
    # the model saw the real calculator's answer
    assert served.backend.requests[1]["messages"][-1] == {
        "role": "tool", "tool_call_id": served.backend.requests[1]["messages"][-2]["tool_calls"][0]["id"],
        "content": "42"}
    models = [m.id for m in _client(served).models.list().data]
    assert "agent:calc" in models


def test_streamed_run_reports_progress_in_harness_chunks(served: Served) -> None:
    chunks = list(_client(served).chat.completions.create(
        model="agent:calc", messages=[{"role": "user", "content": "6*7?"}], stream=True,
        stream_options={"include_usage": True}))
    progress = [c.model_extra["harness"] for c in chunks if not c.choices and c.model_extra.get("harness")]
    assert [p["event"] for p in progress] == ["tool_call", "tool_result"]
    assert progress[0]["name"] == "calculator" and progress[0]["arguments"] == {"expression": "6*7"}
    assert progress[1]["status"] == "ok" and progress[1]["output"] == "42"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The answer is 42."
    final = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    assert final.model_extra["harness"]["status"] == "completed"
    assert chunks[-1].usage.total_tokens == 30


def test_langchain_consumes_the_agent_stream(served: Served) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=served.url + "/v1", api_key="unused", model="agent:calc", max_retries=0)
    text = "".join(chunk.content for chunk in llm.stream("What is six times seven?"))
    assert text == "The answer is 42."
    assert llm.invoke("again?").content == "The answer is 42."


async def test_openai_agents_sdk_consumes_the_agent_stream(served: Served) -> None:
    from agents import Agent, OpenAIChatCompletionsModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
    agent = Agent(name="front", instructions="Relay the answer.",
                  model=OpenAIChatCompletionsModel(model="agent:calc", openai_client=client))
    result = Runner.run_streamed(agent, "What is six times seven?")
    events = [event async for event in result.stream_events()]
    assert events and result.final_output == "The answer is 42."
    plain = await Runner.run(agent, "And once more?")
    assert plain.final_output == "The answer is 42."
    await client.close()


def _wait(url: str, run_id: str) -> dict:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = httpx.get(f"{url}/v1/agent/runs/{run_id}").json()
        if found["status"] != "running":
            return found
        time.sleep(0.05)
    raise AssertionError("run did not finish")


def test_agent_runs_endpoint(served: Served) -> None:
    r = httpx.post(served.url + "/v1/agent/runs", json={"profile": "calc", "input": "6*7?"})
    assert r.status_code == 201
    run = _wait(served.url, r.json()["id"])
    assert run["status"] == "completed" and run["output"] == "The answer is 42." and run["steps"] == 2
    assert run["harness"]["tool_calls"] == 1
    # a request may tighten the profile's limits
    r = httpx.post(served.url + "/v1/agent/runs", json={"profile": "calc", "input": "6*7?", "limits": {"max_steps": 1}})
    run = _wait(served.url, r.json()["id"])
    assert run["status"] == "terminated" and run["termination_reason"] == "max_steps"


@pytest.mark.parametrize("body, param, code", [
    ({"input": "x"}, "profile", "missing_required_parameter"),
    ({"profile": "calc"}, "input", "missing_required_parameter"),
    ({"profile": "calc", "input": "  "}, "input", "invalid_value"),
    ({"profile": "calc", "input": 7}, "input", "invalid_type"),
    ({"profile": "calc", "input": [{"role": "user"}]}, "input[0].content", "missing_required_parameter"),
    ({"profile": "calc", "input": [{"role": "tool", "content": "3"}]}, "input[0].tool_call_id",
     "missing_required_parameter"),
    ({"profile": "calc", "input": "x", "limits": {"max_steps": "many"}}, "limits.max_steps", "invalid_type"),
    ({"profile": "calc", "input": "x", "limits": {"max_steps": -1}}, "limits.max_steps", "invalid_value"),
    ({"profile": "calc", "input": "x", "limits": {"bogus": 1}}, "limits.bogus", "invalid_value"),
])
def test_agent_runs_bad_input(served: Served, body: dict, param: str, code: str) -> None:
    r = httpx.post(served.url + "/v1/agent/runs", json=body)
    assert r.status_code == 400 and (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code), r.text


def test_unknown_profile_and_run(served: Served) -> None:
    r = httpx.post(served.url + "/v1/agent/runs", json={"profile": "nope", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        _client(served).chat.completions.create(model="agent:nope", messages=[{"role": "user", "content": "x"}])
    assert httpx.get(served.url + "/v1/agent/runs/does-not-exist").status_code == 404
