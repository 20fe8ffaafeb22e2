"""``/v1/responses`` passed through to a Responses-native upstream (``kind = "openai-responses"``, a stand-in on a
loopback port): the request's bytes reach it as sent, its answer reaches the client byte for byte (reasoning items
with their encrypted content, custom tool calls, the stream's own framing), the upstream's key replaces the
client's, and every call is recorded: in the chat format, whole as it came, and stitched per session."""

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.app import build_app
from gateway.config import load_settings
from tests.gateway.api.support import store_rows
from tests.standin import ServerThread
from tests.standins.responses import FINAL_TEXT, REASONING_SUMMARY, ResponsesUpstream, encrypted

pytestmark = pytest.mark.integration

MODEL = "gpt-up-1"
UPSTREAM_KEY = "sk-upstream-secret"
CLIENT_KEY = "sk-client"
PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch\n"
THREAD = "019a3c1e-5b7f-7d10-9e2a-4c1b2d3e4f50"
SHELL = {"type": "function", "name": "exec_command", "description": "Run a command",
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"],
                        "additionalProperties": False}, "strict": False}
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files",
               "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}

CONFIG = """
[store]
path = "{db}"

[[backends]]
name = "hosted"
kind = "openai-responses"
base_url = "{url}/v1"
api_key_env = "UPSTREAM_KEY"
models = ["{model}"]

[routing.aliases]
"codex-*" = "{model}"
"""


class Served:
    def __init__(self, url: str, upstream: ResponsesUpstream, db: Path) -> None:
        self.url, self.upstream, self.db = url, upstream, db

    def post(self, body: bytes, path: str = "/v1/responses", **headers: str) -> httpx.Response:
        return httpx.post(self.url + path, content=body, timeout=30, headers={
            "content-type": "application/json", "authorization": f"Bearer {CLIENT_KEY}", **headers})

    def trajectory(self, tid: str) -> dict:
        return httpx.get(f"{self.url}/v1/trajectories/{tid}", timeout=30,
                         headers={"authorization": f"Bearer {CLIENT_KEY}"}).json()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    upstream = ResponsesUpstream("echo hi")
    with ServerThread(upstream.app) as up:
        cfg, db = tmp_path / "h.toml", tmp_path / "h.db"
        cfg.write_text(CONFIG.format(db=db, url=up.url, model=MODEL))
        app = build_app(load_settings(cfg, environ={"UPSTREAM_KEY": UPSTREAM_KEY}))
        with ServerThread(app, lifespan="on") as server:
            yield Served(server.url, upstream, db)


def codex_body(stream: bool, *, history: list | None = None, model: str = MODEL, tools: list | None = None) -> dict:
    """A request as Codex sends it: the whole history every turn, store false, encrypted reasoning asked for."""
    return {"model": model, "instructions": "You are a coding agent.", "stream": stream, "store": False,
            "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Run it"}]},
                      *(history or [])],
            "tools": [SHELL, APPLY_PATCH] if tools is None else tools, "tool_choice": "auto",
            "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"},
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": THREAD,
            "extra_body": {"client_metadata": {"session_id": THREAD}, "brand_new_field_2027": {"x": [1, 2.50]}}}


def raw_body(body: dict) -> dict:
    """The body as it goes on the wire (the SDK's ``extra_body`` merged in)."""
    extra = body.get("extra_body") or {}
    return {**{k: v for k, v in body.items() if k != "extra_body"}, **extra}


def wire(body: dict) -> bytes:
    """Bytes no JSON library would write: indented, keys in the order given."""
    return json.dumps(body, indent=1).encode()


async def _upstream_stream(answer: dict) -> bytes:
    return b"".join([part async for part in ResponsesUpstream._stream(answer)])


def test_streamed_answer_comes_through_byte_for_byte_and_is_recorded(served: Served) -> None:
    served.upstream.patch = PATCH  # it answers with a call of the custom apply_patch tool
    sent = wire(raw_body(codex_body(True)))
    reply = served.post(sent, session_id=THREAD, originator="codex_exec")
    assert reply.status_code == 200, reply.text
    [request] = served.upstream.requests
    assert request["raw"] == sent  # the request's bytes, as sent
    assert request["headers"]["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert (request["headers"]["session_id"], request["headers"]["originator"]) == (THREAD, "codex_exec")
    [answer] = served.upstream.answers
    assert reply.content == asyncio.run(_upstream_stream(answer))  # framing, split events, comment and all
    assert reply.headers["x-harness-guard"] == "check-only"
    assert reply.headers["x-ratelimit-remaining-requests"] == "99"

    tid = reply.headers["x-harness-trajectory-id"]
    trajectory = served.trajectory(tid)
    assert trajectory["format"] == "responses" and trajectory["session_key"] == f"cache:{THREAD}"
    [call] = trajectory["calls"]
    assert call["native"]["response"]["output"] == answer["output"]  # encrypted reasoning kept whole
    assert call["native"]["request"]["include"] == ["reasoning.encrypted_content"]
    message = call["response"]["choices"][0]["message"]
    assert message["reasoning_content"] == REASONING_SUMMARY
    [patch] = message["tool_calls"]
    assert (patch["function"]["name"], json.loads(patch["function"]["arguments"])) == ("apply_patch",
                                                                                      {"input": PATCH})
    assert answer["output"][1]["type"] == "custom_tool_call"
    assert call["request"]["messages"][0] == {"role": "system", "content": "You are a coding agent."}
    assert call["prompt_tokens"] == 21 and call["completion_tokens"] == 9
    assert trajectory["items"] == [*codex_body(True)["input"], *answer["output"]]


def test_a_session_is_one_trajectory_across_turns_and_a_compaction(served: Served) -> None:
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=CLIENT_KEY, max_retries=0)
    first = client.responses.with_raw_response.create(**codex_body(False))
    response = first.parse()
    reasoning, shell = response.output
    assert reasoning.type == "reasoning" and reasoning.encrypted_content == encrypted(1)
    assert (shell.type, shell.name) == ("function_call", "exec_command")

    # The next turn sends the reasoning item back verbatim, with the command's output.
    history = [item.model_dump(exclude_none=True) for item in response.output]
    history.append({"type": "function_call_output", "call_id": shell.call_id, "output": "hi\n"})
    second = client.responses.with_raw_response.create(**codex_body(False, history=history))
    assert second.parse().output[-1].content[0].text == FINAL_TEXT
    sent = served.upstream.requests[1]["body"]["input"]
    assert sent[1]["encrypted_content"] == encrypted(1)
    history += [item.model_dump(exclude_none=True) for item in second.parse().output]

    # Codex compacts: a compaction_trigger, answered by the upstream with one compaction item.
    compacting = client.responses.with_raw_response.create(
        **codex_body(False, history=[*history, {"type": "compaction_trigger"}]))
    [compaction] = compacting.parse().output
    assert compaction.type == "compaction"
    # The compacted history goes on in the same trajectory, though it no longer extends the last call's.
    after = client.responses.with_raw_response.create(**codex_body(False, history=[
        {"type": "compaction", "encrypted_content": compaction.encrypted_content}]))
    tids = {r.headers["x-harness-trajectory-id"] for r in (first, second, compacting, after)}
    assert len(tids) == 1, tids
    trajectory = served.trajectory(tids.pop())
    assert [c["seq"] for c in trajectory["calls"]] == [0, 1, 2, 3]
    assert trajectory["calls"][2]["request"]["purpose"] == "summary"
    kinds = [i.get("type", "message") for i in trajectory["items"]]
    assert kinds.count("compaction") == 2  # answered once, carried in the compacted history
    assert kinds.count("reasoning") == 3 and kinds.count("function_call_output") == 1  # calls 1, 2 and 4


def test_alias_names_the_upstream_model_and_refusals_pass_through(served: Served) -> None:
    body = raw_body(codex_body(False, model="codex-mini"))
    reply = served.post(wire(body))
    assert reply.status_code == 200
    assert served.upstream.requests[0]["body"] == {**body, "model": MODEL}  # every other value as it was

    refused = served.post(wire({**raw_body(codex_body(False)), "input": "fail:400"}))
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "upstream_refused"
    rows = store_rows(served.db, "SELECT status, error FROM model_calls ORDER BY created_at")
    assert rows[-1][0] == "error" and "upstream returned 400" in rows[-1][1]


def test_previous_response_id_goes_to_the_upstream_when_not_kept_here(served: Served) -> None:
    body = {"model": MODEL, "previous_response_id": "resp_only_upstream_knows",
            "input": [{"type": "function_call_output", "call_id": "call_x", "output": "42"}]}
    reply = served.post(wire(body))
    assert reply.status_code == 200, reply.text
    assert served.upstream.requests[0]["body"]["previous_response_id"] == "resp_only_upstream_knows"


def test_stored_answers_continue_by_previous_response_id_in_one_trajectory(served: Served) -> None:
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=CLIENT_KEY, max_retries=0)
    first = client.responses.with_raw_response.create(model=MODEL, input="Run it", tools=[SHELL], store=True)
    call = first.parse().output[-1]
    second = client.responses.with_raw_response.create(
        model=MODEL, previous_response_id=first.parse().id, store=True,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "hi"}])
    assert first.headers["x-harness-trajectory-id"] == second.headers["x-harness-trajectory-id"]
    fetched = client.responses.retrieve(first.parse().id)
    assert fetched.output[0].encrypted_content == encrypted(1)


def test_invalid_tool_calls_are_recorded_never_retried(served: Served) -> None:
    strict_shell = {**SHELL, "parameters": {"type": "object", "properties": {"cmd": {"type": "integer"}},
                                            "required": ["cmd"]}}
    reply = served.post(wire(raw_body(codex_body(False, tools=[strict_shell]))))
    assert reply.status_code == 200
    assert len(served.upstream.requests) == 1  # no retry: it would replay the upstream's signed reasoning
    rows = store_rows(served.db, "SELECT name, valid, status FROM tool_calls")
    assert rows == [("exec_command", 0, "returned")]


def test_compact_endpoint_passes_through(served: Served) -> None:
    body = {"model": MODEL, "input": [{"type": "message", "role": "user", "content": "Run it"}]}
    reply = served.post(wire(body), path="/v1/responses/compact")
    assert reply.status_code == 200, reply.text
    assert served.upstream.requests[0]["path"] == "/v1/responses/compact"
    answer = reply.json()
    assert answer["object"] == "response.compaction" and answer["output"][-1]["type"] == "compaction"


def test_a_chat_completion_for_a_responses_upstream_is_refused(served: Served) -> None:
    reply = httpx.post(served.url + "/v1/chat/completions", timeout=30,
                       headers={"authorization": f"Bearer {CLIENT_KEY}"},
                       json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "wrong_api"


def test_a_custom_tool_call_and_its_output_go_on_and_are_recorded(served: Served) -> None:
    served.upstream.patch = PATCH
    first = served.post(wire(raw_body(codex_body(False)))).json()
    patch_call = first["output"][1]
    history = [*first["output"], {"type": "custom_tool_call_output", "call_id": patch_call["call_id"],
                                  "output": "Done: a.txt added"}]
    reply = served.post(wire(raw_body(codex_body(False, history=history))))
    assert reply.status_code == 200, reply.text
    assert served.upstream.requests[1]["body"]["input"][-1]["type"] == "custom_tool_call_output"
    call = served.trajectory(reply.headers["x-harness-trajectory-id"])["calls"][-1]
    messages = call["request"]["messages"]
    assert messages[-2]["tool_calls"][0]["function"] == {"name": "apply_patch",
                                                          "arguments": json.dumps({"input": PATCH},
                                                                                  separators=(",", ":"))}
    assert messages[-1] == {"role": "tool", "tool_call_id": patch_call["call_id"], "content": "Done: a.txt added"}
