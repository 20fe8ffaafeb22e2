"""Compaction on a chat backend through a real gateway app: a request ending in ``compaction_trigger`` and
``POST /v1/responses/compact`` are answered by the summarizer with one ``compaction`` item; a history that carries it
back gives the model the summary; the session stays one trajectory. Also: ``parallel_tool_calls: false`` allows one
tool call whatever the backend made."""

import json
import sqlite3
from pathlib import Path

import httpx
import openai
import pytest

from gateway.agent.context import SUMMARY_INSTRUCTIONS
from gateway.protocol.responses.compaction import SUMMARY_INTRO, summary_of
from tests.gateway.api.support import serve
from tests.scripted import call

pytestmark = pytest.mark.integration

THREAD = "thread-42"
SUMMARY = "The user asked for the weather in Paris; it is 21 C. Nothing is left to do."
SHELL = {"type": "function", "name": "exec_command",
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
HISTORY = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
           {"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": '{"cmd": "weather"}'},
           {"type": "function_call_output", "call_id": "c1", "output": "21 C"},
           {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is 21 C."}]}]


def _body(items: list, **more) -> dict:
    return {"model": "scripted-model", "instructions": "You are Codex.", "input": items, "tools": [SHELL],
            "store": False, "prompt_cache_key": THREAD, **more}


def _events(reply: httpx.Response) -> list[dict]:
    return [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: ")]


def _trajectories(served) -> list[tuple]:
    db = sqlite3.connect(served.app.state.gateway.settings.store.path)
    try:
        return db.execute("SELECT id, n_calls FROM trajectories").fetchall()
    finally:
        db.close()


def test_a_compaction_trigger_is_answered_with_one_item_that_later_requests_unfold(tmp_path: Path) -> None:
    for served in serve(tmp_path, [SUMMARY, "Still 21 C."]):
        reply = httpx.post(served.url + "/v1/responses", timeout=30, json=_body(
            [*HISTORY, {"type": "compaction_trigger"}], stream=True))
        assert reply.status_code == 200, reply.text
        events = _events(reply)
        assert [e["type"] for e in events] == ["response.created", "response.in_progress",
                                               "response.output_item.added", "response.output_item.done",
                                               "response.completed"]
        [item] = events[-1]["response"]["output"]
        assert item["type"] == "compaction" and summary_of(item) == SUMMARY
        assert events[-1]["response"]["usage"]["total_tokens"] == 15
        # The summarizer saw the history, none of the instructions.
        summary_request = served.backend.requests[0]["messages"]
        assert summary_request[0] == {"role": "system", "content": SUMMARY_INSTRUCTIONS}
        assert "result of c1: 21 C" in summary_request[1]["content"]
        assert "You are Codex." not in summary_request[1]["content"]

        # Codex's next request starts over from the compaction item: the model is given the summary.
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
        after = client.responses.with_raw_response.create(**_body([
            item, {"type": "message", "role": "user", "content": "And tomorrow?"}]))
        assert after.parse().output_text == "Still 21 C."
        assert served.backend.requests[1]["messages"][1:] == [
            {"role": "user", "content": SUMMARY_INTRO + SUMMARY}, {"role": "user", "content": "And tomorrow?"}]
        # One trajectory: the compaction call and the compacted history go on in the session's.
        tid = after.headers["x-harness-trajectory-id"]
        assert _trajectories(served) == [(tid, 2)]
        shown = httpx.get(f"{served.url}/v1/trajectories/{tid}", timeout=30).json()
        assert [c["request"].get("purpose", "step") for c in shown["calls"]] == ["summary", "step"]


def test_the_compact_endpoint_keeps_user_messages_and_adds_one_item(tmp_path: Path) -> None:
    for served in serve(tmp_path, [""]):  # an empty summary: the extractive one stands in
        reply = httpx.post(served.url + "/v1/responses/compact", timeout=30, json=_body(HISTORY))
        assert reply.status_code == 200, reply.text
        answer = reply.json()
        assert answer["object"] == "response.compaction"
        user, item = answer["output"]
        assert user == {**HISTORY[0], "type": "message"}
        summary = summary_of(item)
        assert summary and "called exec_command" in summary and "21 C" in summary
        tid = reply.headers["x-harness-trajectory-id"]
        shown = httpx.get(f"{served.url}/v1/trajectories/{tid}", timeout=30).json()
        assert [c["request"]["purpose"] for c in shown["calls"]] == ["summary"]


def test_codex_local_compaction_is_a_summary_call_in_the_session(tmp_path: Path) -> None:
    """Codex's own compaction (for a provider it does not take for OpenAI's): an ordinary request asking for a
    summary, then a history that starts over with Codex's summary message, stitched into the same trajectory."""
    checkpoint = "You are performing a CONTEXT CHECKPOINT COMPACTION. Create a handoff summary."
    for served in serve(tmp_path, ["It is 21 C.", SUMMARY, "Still 21 C."]):
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
        client.responses.create(**_body(HISTORY[:3]))
        client.responses.create(**_body([*HISTORY, {"type": "message", "role": "user", "content": checkpoint}]))
        restarted = client.responses.with_raw_response.create(**_body([
            HISTORY[0], {"type": "message", "role": "user", "content": "Another language model started to solve "
                         "this problem and produced a summary of its thinking process.\n" + SUMMARY}]))
        assert _trajectories(served) == [(restarted.headers["x-harness-trajectory-id"], 3)]
        shown = httpx.get(f"{served.url}/v1/trajectories/{restarted.headers['x-harness-trajectory-id']}",
                          timeout=30).json()
        assert [c["request"].get("purpose", "step") for c in shown["calls"]] == ["step", "summary", "step"]


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_allows_one_call(tmp_path: Path, stream: bool) -> None:
    two = {"role": "assistant", "content": None, "tool_calls": [
        call("exec_command", {"cmd": "ls"}, call_id="c1")["tool_calls"][0],
        call("exec_command", {"cmd": "pwd"}, call_id="c2")["tool_calls"][0]]}
    for served in serve(tmp_path, [two, dict(two)]):
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0)
        for parallel, expected in ((False, ["c1"]), (True, ["c1", "c2"])):
            body = _body([HISTORY[0]], parallel_tool_calls=parallel)
            if stream:
                events = list(client.responses.create(**body, stream=True))
                output = events[-1].response.output
                added = [e.item.call_id for e in events if e.type == "response.output_item.done"]
                assert added == expected
            else:
                output = client.responses.create(**body).output
            assert [o.call_id for o in output] == expected
            assert served.backend.requests[-1]["parallel_tool_calls"] is parallel


def test_compaction_requests_that_cannot_be_answered_are_4xx(tmp_path: Path) -> None:
    for served in serve(tmp_path, []):
        nothing = httpx.post(served.url + "/v1/responses", timeout=30,
                             json=_body([{"type": "compaction_trigger"}]))
        assert nothing.status_code == 400 and nothing.json()["error"]["param"] == "input"
        agent = httpx.post(served.url + "/v1/responses/compact", timeout=30,
                           json={**_body(HISTORY), "model": "agent:calc"})
        assert agent.status_code == 400 and "agent profile" in agent.json()["error"]["message"]
        unknown = httpx.post(served.url + "/v1/responses/compact", timeout=30,
                             json={**_body(HISTORY), "model": "no-such-model"})
        assert unknown.status_code == 404
        assert served.backend.requests == []  # nothing reached the model
