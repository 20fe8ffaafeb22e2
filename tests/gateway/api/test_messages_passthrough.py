"""``/v1/messages`` passed through to an Anthropic-native upstream (``kind = "anthropic"``, a stand-in on a loopback
port): the request's bytes reach it as sent, its answer reaches the client byte for byte (thinking signatures, a
block type no release has yet, the stream's own framing), the headers that shape the answer are forwarded and the
client's key is not, and the call is still recorded."""

import json
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from gateway.app import build_app
from gateway.config import load_settings
from tests.gateway.api.support import store_rows
from tests.standin import ServerThread
from tests.standins.anthropic import FUTURE_BLOCK, SIGNATURE, TEXT, THINKING, AnthropicUpstream

pytestmark = pytest.mark.integration

MODEL = "claude-up-1"
UPSTREAM_KEY = "sk-ant-upstream-secret"
CLIENT_KEY = "sk-client"
SESSION = "7c1d5e2a-0f5b-4c55-9d8e-3b1f2a6c9e10"

CONFIG = """
[store]
path = "{db}"

[[backends]]
name = "anthropic"
kind = "anthropic"
base_url = "{url}"
api_key_env = "UPSTREAM_KEY"
models = ["{model}"]
max_retries = 2

[routing.aliases]
"claude-*" = "{model}"
"""


class Served:
    def __init__(self, url: str, upstream: AnthropicUpstream, db: Path) -> None:
        self.url, self.upstream, self.db = url, upstream, db

    def rows(self, sql: str, args: tuple = ()) -> list[tuple]:
        return store_rows(self.db, sql, args)

    def post(self, body: bytes, *, path: str = "/v1/messages", **headers: str) -> httpx.Response:
        return httpx.post(self.url + path, content=body, timeout=30, headers={
            "content-type": "application/json", "x-api-key": CLIENT_KEY, **headers})


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    upstream = AnthropicUpstream()
    with ServerThread(upstream.app) as up:
        cfg = tmp_path / "h.toml"
        db = tmp_path / "h.db"
        cfg.write_text(CONFIG.format(db=db, url=up.url, model=MODEL))
        app = build_app(load_settings(cfg, environ={"UPSTREAM_KEY": UPSTREAM_KEY}))
        with ServerThread(app, lifespan="on") as server:
            yield Served(server.url, upstream, db)


def request_bytes(stream: bool, text: str = "Say hello") -> bytes:
    """A request as a new Claude Code release might send it: unknown top-level fields and blocks, cache_control,
    a thinking block with its signature from an earlier turn, written with its own spacing and key order."""
    return json.dumps({
        "model": "claude-opus-9-9", "max_tokens": 32000, "stream": stream,
        "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": SESSION})},
        "thinking": {"type": "enabled", "budget_tokens": 2048},
        "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
        "brand_new_field_2027": {"x": [1, 2]},
        "system": [{"type": "text", "text": "You are helpful.", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "earlier thought", "signature": "Sig+/earlier=="},
                {"type": "brand_new_block", "data": "opaque"},
                {"type": "text", "text": "Hello."}]},
            {"role": "user", "content": [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]}],
    }, indent=1, ensure_ascii=False).encode() + b"\n"


def test_a_plain_answer_goes_both_ways_byte_for_byte(served: Served) -> None:
    body = request_bytes(stream=False)
    reply = served.post(body, path="/v1/messages?beta=true", **{
        "anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking-2025-05-14,context-1m-2025-08-07",
        "x-claude-code-session-id": SESSION})
    assert reply.status_code == 200, reply.text
    [sent] = served.upstream.requests
    assert sent["raw"] == body
    assert sent["query"] == "beta=true"
    headers = sent["headers"]
    assert headers["anthropic-version"] == "2023-06-01"
    assert headers["anthropic-beta"] == "interleaved-thinking-2025-05-14,context-1m-2025-08-07"
    assert headers["x-api-key"] == UPSTREAM_KEY and "authorization" not in headers
    expected = served.upstream.message(json.loads(body))
    expected["id"] = "msg_up_1"
    assert reply.content == json.dumps(expected, separators=(",", ":")).encode()
    message = reply.json()
    assert message["content"][0]["signature"] == SIGNATURE and message["content"][1] == FUTURE_BLOCK
    assert reply.headers["request-id"] == "req_up_1"
    assert reply.headers["anthropic-ratelimit-requests-remaining"] == "99"

    # Recorded as any call is: the answer in the store's chat format, the session stitched by its id.
    tid = reply.headers["x-harness-trajectory-id"]
    assert served.rows("SELECT session_key, requested_model, n_calls FROM trajectories WHERE id = ?", (tid,)) == [
        (f"claude:{SESSION}", "claude-opus-9-9", 1)]
    [(status, response_keys)] = served.rows("SELECT status, response_messages FROM model_calls WHERE trajectory_id=?",
                                            (tid,))
    assert status == "ok"
    [answer] = [json.loads(b) for (b,) in served.rows("SELECT body FROM blobs WHERE hash = ?",
                                                       (json.loads(response_keys)[0],))]
    assert answer == {"role": "assistant", "content": TEXT, "reasoning_content": THINKING}
    # And kept as it came: the request as sent, the Message as answered (signature and unknown block included).
    stored = httpx.get(f"{served.url}/v1/trajectories/{tid}").json()
    assert stored["format"] == "anthropic"
    native = stored["calls"][0]["native"]
    assert native["request"] == json.loads(body) and native["response"] == expected


def test_a_streamed_answer_is_relayed_byte_for_byte(served: Served) -> None:
    body = request_bytes(stream=True)
    with httpx.stream("POST", served.url + "/v1/messages", content=body, timeout=30, headers={
            "content-type": "application/json", "authorization": f"Bearer {CLIENT_KEY}"}) as reply:
        assert reply.status_code == 200
        assert reply.headers["content-type"].startswith("text/event-stream")
        got = b"".join(reply.iter_raw())
    expected = served.upstream.message(json.loads(body))
    expected["id"] = "msg_up_1"
    wire = b"".join(_collect(AnthropicUpstream._stream(expected)))
    assert got == wire
    assert served.upstream.requests[0]["raw"] == body
    assert "authorization" not in served.upstream.requests[0]["headers"]

    # The SDK reads it whole, signature and all.
    client = anthropic.Anthropic(base_url=served.url, api_key=CLIENT_KEY, max_retries=0)
    with client.messages.stream(model="claude-sonnet-9", max_tokens=64,
                                messages=[{"role": "user", "content": "again"}]) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "future_block", "text"]
    assert final.content[0].signature == SIGNATURE and final.content[2].text == TEXT
    rows = served.rows("SELECT status, stream, ttft_ms IS NOT NULL FROM model_calls ORDER BY created_at")
    assert rows == [("ok", 1, 1), ("ok", 1, 1)]


def _collect(agen) -> list[bytes]:
    import asyncio

    async def run() -> list[bytes]:
        return [part async for part in agen]
    return asyncio.run(run())


def test_upstream_errors_are_handed_back_and_overload_is_retried(served: Served) -> None:
    refused = served.post(request_bytes(stream=False, text="fail:400"))
    assert refused.status_code == 400
    assert refused.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                         "message": "upstream says 400"}}
    assert refused.headers["request-id"] == "req_up_err"
    streamed = served.post(request_bytes(stream=True, text="fail:413"))
    assert streamed.status_code == 413 and streamed.json()["error"]["message"] == "upstream says 413"
    assert [s for (s,) in served.rows("SELECT status FROM model_calls ORDER BY created_at")] == ["error", "error"]

    # 529 once: retried before anything reached the client.
    again = served.post(request_bytes(stream=False, text="overloaded-once"))
    assert again.status_code == 200 and again.json()["content"][2]["text"] == TEXT
    assert len(served.upstream.requests) == 4


def test_count_tokens_is_the_upstreams_count(served: Served) -> None:
    body = json.dumps({"model": "claude-opus-9-9", "messages": [{"role": "user", "content": "hi"}],
                       "new_count_field": True}).encode()
    reply = served.post(body, path="/v1/messages/count_tokens?beta=true", **{"anthropic-beta": "token-counting-2024"})
    assert reply.status_code == 200 and reply.json() == {"input_tokens": 1234}
    assert served.upstream.requests[-1]["raw"] == body
    assert served.upstream.requests[-1]["headers"]["anthropic-beta"] == "token-counting-2024"


def test_an_anthropic_model_is_not_served_on_chat_completions(served: Served) -> None:
    client = openai.OpenAI(base_url=served.url + "/v1", api_key=CLIENT_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "wrong_api"
    assert served.upstream.requests == []
