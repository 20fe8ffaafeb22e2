"""The Anthropic Messages API through a real gateway app on a scripted chat backend, driven by the anthropic SDK."""

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import pytest

from gateway.app import build_app
from gateway.backends.base import BackendError
from gateway.config import load_settings
from tests.gateway.api.support import CONFIG, store_rows
from tests.scripted import ScriptedBackend, call, serve_scripted
from tests.standin import ServerThread

pytestmark = pytest.mark.integration

ALIASES = """
[routing.aliases]
"claude-*haiku*" = "scripted-model"
"claude-*" = "scripted-model"
"""

BASH = {"name": "Bash", "description": "Run a command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
SESSION = "2d43a4e6-fd98-4aef-b828-f2f17766a4df"
METADATA = {"user_id": json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": SESSION})}


class Served:
    def __init__(self, url: str, backend: ScriptedBackend, db: Path) -> None:
        self.url, self.backend, self.db = url, backend, db

    def client(self, **kw) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=self.url, api_key="sk-test", max_retries=0, **kw)

    def rows(self, sql: str, args: tuple = ()) -> list[tuple]:
        return store_rows(self.db, sql, args)

    def params(self, trajectory_id: str) -> list[dict]:
        return [json.loads(p) for (p,) in self.rows(
            "SELECT params FROM model_calls WHERE trajectory_id = ? ORDER BY seq", (trajectory_id,))]


def serve(tmp_path: Path, script: list, backend: ScriptedBackend | None = None) -> Iterator[Served]:
    tmp_path.mkdir(exist_ok=True)
    cfg = tmp_path / "h.toml"
    db = tmp_path / "h.db"
    cfg.write_text(CONFIG.format(db=db) + ALIASES)
    app = build_app(load_settings(cfg, environ={}))
    backend = backend or ScriptedBackend(script)
    serve_scripted(app, backend)
    with ServerThread(app, lifespan="on") as server:
        yield Served(server.url, backend, db)


def test_plain_and_streamed_text(tmp_path: Path) -> None:
    for served in serve(tmp_path, ["Hello there.", "Streamed hello."]):
        client = served.client()
        raw = client.messages.with_raw_response.create(
            model="claude-opus-5-5", max_tokens=16000, system=[{"type": "text", "text": "Be brief.",
                                                                  "cache_control": {"type": "ephemeral"}}],
            messages=[{"role": "user", "content": "Say hello"}], stop_sequences=["\n\nHuman:"],
            extra_body={"temperature": 0.5, "top_k": 20})  # sampling fields this SDK version no longer types
        message = raw.parse()
        assert message.type == "message" and message.role == "assistant"
        assert [b.type for b in message.content] == ["text"] and message.content[0].text == "Hello there."
        assert message.stop_reason == "end_turn" and message.model == "claude-opus-5-5"
        assert (message.usage.input_tokens, message.usage.output_tokens) == (10, 5)
        sent = served.backend.requests[0]
        assert sent["messages"] == [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Say hello"}]
        assert (sent["temperature"], sent["top_k"], sent["stop"], sent["max_tokens"]) == (
            0.5, 20, ["\n\nHuman:"], 16000)
        tid = raw.headers["x-harness-trajectory-id"]
        assert served.rows("SELECT n_calls, requested_model, base_model FROM trajectories WHERE id = ?", (tid,)) == [
            (1, "claude-opus-5-5", "scripted-model")]
        assert served.params(tid)[0]["api"] == "anthropic"
        # The read model: format anthropic, the exchange as the client saw it beside the chat messages.
        stored = httpx.get(f"{served.url}/v1/trajectories/{tid}", headers={"authorization": "Bearer sk-test"}).json()
        assert stored["format"] == "anthropic"
        native = stored["calls"][0]["native"]
        assert native["api"] == "anthropic" and native["request"]["stop_sequences"] == ["\n\nHuman:"]
        assert native["request"]["system"][0]["cache_control"] == {"type": "ephemeral"}
        assert (native["response"]["id"], native["response"]["stop_reason"]) == (message.id, "end_turn")
        assert native["response"]["content"] == [{"type": "text", "text": "Hello there."}]
        assert stored["calls"][0]["request"]["messages"][-1] == {"role": "user", "content": "Say hello"}

        with client.messages.stream(model="claude-haiku-4-5", max_tokens=64,
                                    messages=[{"role": "user", "content": "Again"}]) as stream:
            events = [e.type for e in stream]
            final = stream.get_final_message()
        assert events[0] == "message_start" and events[-1] == "message_stop"
        assert "content_block_start" in events and "content_block_stop" in events and "message_delta" in events
        assert final.content[0].text.strip() == "Streamed hello."
        assert final.stop_reason == "end_turn" and final.usage.output_tokens == 5


def test_a_tool_use_round_trip_is_one_session_trajectory(tmp_path: Path) -> None:
    script = [call("Bash", {"command": "ls"}, call_id="toolu_01abc"), "There are two files."]
    for served in serve(tmp_path, script):
        client = served.client()
        first = client.messages.with_raw_response.create(
            model="claude-opus-5-5", max_tokens=1024, tools=[BASH], metadata=METADATA,
            tool_choice={"type": "auto", "disable_parallel_tool_use": True},
            messages=[{"role": "user", "content": "List the files."}])
        message = first.parse()
        assert message.stop_reason == "tool_use"
        [block] = message.content
        assert (block.type, block.id, block.name, block.input) == ("tool_use", "toolu_01abc", "Bash", {"command": "ls"})
        assert served.backend.requests[0]["tools"] == [{"type": "function", "function": {
            "name": "Bash", "description": "Run a command", "parameters": BASH["input_schema"]}}]
        assert served.backend.requests[0]["parallel_tool_calls"] is False

        history = [{"role": "user", "content": "List the files."},
                   {"role": "assistant", "content": [b.model_dump() for b in message.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01abc", "is_error": True,
                                                 "content": [{"type": "text", "text": "permission denied"}]},
                                                {"type": "text", "text": "Try again."}]}]
        second = client.messages.with_raw_response.create(model="claude-opus-5-5", max_tokens=1024, tools=[BASH],
                                                          metadata=METADATA, messages=history)
        assert second.parse().content[0].text == "There are two files."
        sent = served.backend.requests[1]["messages"]
        assert sent[1]["tool_calls"][0]["id"] == "toolu_01abc"
        assert sent[2] == {"role": "tool", "tool_call_id": "toolu_01abc", "content": "Error: permission denied"}
        assert sent[3] == {"role": "user", "content": "Try again."}
        tid = first.headers["x-harness-trajectory-id"]
        assert second.headers["x-harness-trajectory-id"] == tid
        assert served.rows("SELECT n_calls, session_key FROM trajectories") == [(2, f"claude:{SESSION}")]


def test_streamed_tool_use_sends_input_json_deltas(tmp_path: Path) -> None:
    args = {"command": "echo hi > marker.txt", "description": "write a marker"}
    for served in serve(tmp_path, [call("Bash", args, call_id="toolu_s1")]):
        with served.client().messages.stream(model="claude-opus-5-5", max_tokens=1024, tools=[BASH],
                                             messages=[{"role": "user", "content": "Write it."}]) as stream:
            events = list(stream)
            final = stream.get_final_message()
        deltas = [e.delta.partial_json for e in events
                  if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
        assert len(deltas) > 1 and json.loads("".join(deltas)) == args
        assert final.stop_reason == "tool_use"
        assert [(b.type, b.id, b.input) for b in final.content] == [("tool_use", "toolu_s1", args)]


def test_unknown_fields_and_blocks_are_dropped_and_recorded_for_a_chat_backend(tmp_path: Path) -> None:
    for served in serve(tmp_path, ["fine"]):
        body = {"model": "claude-opus-5-5", "max_tokens": 100, "thinking": {"type": "adaptive"},
                "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
                "output_config": {"effort": "medium"}, "a_field_from_next_year": [1, 2],
                "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"},
                                                          {"type": "hologram", "payload": {"x": 1}}]},
                             {"role": "system", "content": "A reminder from the client."},
                             {"role": "assistant", "content": [
                                 {"type": "thinking", "thinking": "hmm", "signature": "c2ln"},
                                 {"type": "text", "text": "yes?"}]},
                             {"role": "user", "content": "go on", "output_config": {"effort": "low"}}]}
        r = httpx.post(served.url + "/v1/messages?beta=true", json=body,
                       headers={"x-api-key": "sk-test", "anthropic-version": "2023-06-01",
                                "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"})
        assert r.status_code == 200, r.text
        assert r.json()["content"] == [{"type": "text", "text": "fine"}]
        sent = served.backend.requests[0]
        # The system message inside the conversation becomes context of the user message it follows.
        assert [m["role"] for m in sent["messages"]] == ["user", "assistant", "user"]
        assert sent["messages"][0]["content"] == "A reminder from the client.\n\nhi"
        assert sent["messages"][1]["reasoning_content"] == "hmm"
        for key in ("thinking", "context_management", "output_config", "a_field_from_next_year"):
            assert key not in sent
        [params] = served.params(r.headers["x-harness-trajectory-id"])
        assert {"field:thinking", "field:context_management", "field:output_config", "field:a_field_from_next_year",
                "block:hologram", "thinking_signature"} <= set(params["dropped"])


def test_errors_leave_in_anthropics_shape(tmp_path: Path) -> None:
    script = [BackendError("upstream fell over", status_code=502),
              "Partial answer that",  # then the stream's backend fails: see below
              BackendError("upstream overloaded", status_code=503)]
    for served in serve(tmp_path, script):
        client = served.client()
        with pytest.raises(anthropic.BadRequestError) as bad:
            client.messages.create(model="claude-opus-5-5", max_tokens=0, messages=[{"role": "user", "content": "x"}])
        assert bad.value.body["type"] == "error"
        assert bad.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in bad.value.message
        r = httpx.post(served.url + "/v1/messages", content=b"{not json", headers={"x-api-key": "k"})
        assert r.status_code == 400 and r.json()["type"] == "error"
        r = httpx.post(served.url + "/v1/messages", json={"model": "gpt-nothing", "max_tokens": 5,
                                                         "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
        r = httpx.get(served.url + "/v1/messages")
        assert r.status_code == 405 and r.json()["type"] == "error"

        with pytest.raises(anthropic.APIStatusError) as failed:
            client.messages.create(model="claude-opus-5-5", max_tokens=5, messages=[{"role": "user", "content": "x"}])
        assert failed.value.status_code == 502 and failed.value.body["error"]["type"] == "api_error"
        assert "upstream fell over" in failed.value.body["error"]["message"]

        ok = client.messages.create(model="claude-opus-5-5", max_tokens=5, messages=[{"role": "user", "content": "x"}])
        assert ok.content[0].text == "Partial answer that"
        r = httpx.post(served.url + "/v1/messages", json={"model": "claude-opus-5-5", "max_tokens": 5, "stream": True,
                                                         "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 503 and r.json()["error"]["type"] == "overloaded_error"
        # The chat routes keep OpenAI's envelope.
        r = httpx.post(served.url + "/v1/chat/completions", content=b"{not json")
        assert r.status_code == 400 and set(r.json()) == {"error"}


def test_a_stream_that_fails_midway_ends_with_an_error_event(tmp_path: Path) -> None:
    class Failing(ScriptedBackend):
        async def stream(self, request):
            inner = await super().stream(request)

            async def chunks():
                async for chunk in inner:
                    yield chunk
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        raise BackendError("the backend dropped the stream", status_code=502)

            class Stream:
                extras = inner.extras

                def __aiter__(self):
                    return chunks()

                async def aclose(self):
                    pass

            return Stream()

    for served in serve(tmp_path, [], Failing(["one two three"])):
        r = httpx.post(served.url + "/v1/messages", json={"model": "claude-opus-5-5", "max_tokens": 5, "stream": True,
                                                         "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[0]["type"] == "message_start" and events[-1]["type"] == "error"
        assert events[-1]["error"] == {"type": "api_error", "message": "the backend dropped the stream"}
        assert "message_stop" not in [e["type"] for e in events]
        assert served.rows("SELECT status FROM model_calls") == [("error",)]


def test_side_requests_are_labelled_and_kept_out_of_the_session(tmp_path: Path) -> None:
    summary = "<analysis>a</analysis><summary>listed files</summary>"
    for served in serve(tmp_path, ["Two files.", summary, "Still here."]):
        client = served.client()
        headers = {"x-claude-code-session-id": SESSION}
        turn = [{"role": "user", "content": "List the files."}]
        first = client.messages.with_raw_response.create(model="claude-opus-5-5", max_tokens=100, tools=[BASH],
                                                         messages=turn, extra_headers=headers)
        history = turn + [{"role": "assistant", "content": "Two files."}]
        side = client.messages.with_raw_response.create(
            model="claude-opus-5-5", max_tokens=100, tools=[BASH], extra_headers=headers,
            messages=history + [{"role": "user", "content": "Your task is to create a detailed summary of the "
                                                            "conversation so far."}])
        assert side.parse().content[0].text == summary
        title = client.messages.with_raw_response.create(
            model="claude-haiku-4-5", max_tokens=32, extra_headers=headers,
            messages=[{"role": "user", "content": "List the files."}],
            extra_body={"output_config": {"format": {"type": "json_schema", "schema": {
                "type": "object", "properties": {"title": {"type": "string"}}}}}})
        third = client.messages.with_raw_response.create(
            model="claude-opus-5-5", max_tokens=100, tools=[BASH], extra_headers=headers,
            messages=history + [{"role": "user", "content": "Anything else?"}])
        session = first.headers["x-harness-trajectory-id"]
        assert third.headers["x-harness-trajectory-id"] == session
        side_ids = {side.headers["x-harness-trajectory-id"], title.headers["x-harness-trajectory-id"]}
        assert session not in side_ids and len(side_ids) == 2
        assert served.rows("SELECT n_calls, session_key FROM trajectories WHERE id = ?", (session,)) == [
            (2, f"claude:{SESSION}")]
        assert [p.get("purpose") for p in served.params(session)] == [None, None]
        purposes = {}
        for tid in side_ids:
            [(key,)] = served.rows("SELECT session_key FROM trajectories WHERE id = ?", (tid,))
            assert key == f"claude:{SESSION}:side"
            [params] = served.params(tid)
            purposes[tid] = params["purpose"]
        assert sorted(purposes.values()) == ["summary", "title"]


def test_count_tokens_estimates_without_a_tokenizer_and_counts_with_one(tmp_path: Path) -> None:
    class Counting(ScriptedBackend):
        def count_tokens(self, messages, tools=None):
            return 1000 + len(messages) + len(tools or [])

    body = {"model": "claude-opus-5-5", "system": "Be brief.", "tools": [BASH],
            "messages": [{"role": "user", "content": "Count me " * 50}]}
    for served in serve(tmp_path, []):
        r = httpx.post(served.url + "/v1/messages/count_tokens?beta=true", json=body)
        assert r.status_code == 200 and r.headers["x-harness-token-count"] == "estimate"
        estimate = r.json()
        assert estimate["estimated"] is True and 100 < estimate["input_tokens"] < 400
        count = served.client().messages.count_tokens(model="claude-opus-5-5", messages=body["messages"])
        assert 100 < count.input_tokens < 400
    for served in serve(tmp_path / "exact", [], Counting([])):
        r = httpx.post(served.url + "/v1/messages/count_tokens", json=body)
        assert r.status_code == 200 and "x-harness-token-count" not in r.headers
        assert r.json() == {"input_tokens": 1000 + 2 + 1}
        assert served.backend.requests == []  # counting runs no model


def test_the_max_tokens_ceiling_reaches_the_backend(tmp_path: Path) -> None:
    seen = []

    class Recording(ScriptedBackend):
        async def chat(self, request):
            seen.append(request.max_tokens_ceiling)
            return await super().chat(request)

    for served in serve(tmp_path, [], Recording(["a", "b"])):
        # As Claude Code asks (an SDK refuses so large a non-streamed request; Claude Code streams it).
        httpx.post(served.url + "/v1/messages", json={"model": "claude-opus-5-5", "max_tokens": 128000,
                                                     "messages": [{"role": "user", "content": "x"}]})
        httpx.post(served.url + "/v1/chat/completions", json={"model": "scripted-model", "max_tokens": 5,
                                                              "messages": [{"role": "user", "content": "x"}]})
        assert seen == [True, False]
