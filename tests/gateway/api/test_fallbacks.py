"""Fallback models through a real gateway: a model whose call fails before anything reached the client is answered
by the next configured model, which the answer names and the store records beside the failed call."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.app import build_app
from gateway.config import load_settings
from tests.standin import ServerThread, StandIn

pytestmark = pytest.mark.integration

SERVER_ERROR = (500, {"error": {"message": "the stand-in is broken", "type": "server_error", "code": None}})


@dataclass
class Served:
    url: str
    db: Path
    primary: StandIn
    secondary: StandIn

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=10)

    def ask(self, text: str = "hello", **kw: Any) -> Any:
        return self.client().chat.completions.with_raw_response.create(
            model="primary", messages=[{"role": "user", "content": text}], **kw)

    def calls(self, trajectory: str) -> list[tuple[Any, ...]]:
        db = sqlite3.connect(self.db)
        try:
            rows = db.execute("SELECT status, backend, model, stream, params FROM model_calls WHERE trajectory_id = ? "
                              "ORDER BY seq", (trajectory,)).fetchall()
        finally:
            db.close()
        return [(*row[:4], json.loads(row[4]).get("fallback_from")) for row in rows]


def backend(name: str, url: str, model: str) -> str:
    return f"""
[[backends]]
name = "{name}"
base_url = "{url}/v1"
models = ["{model}"]
read_timeout = 1.0
max_retries = 0
"""


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    primary, secondary = StandIn(), StandIn()
    with ServerThread(primary.app) as p, ServerThread(secondary.app) as s:
        config = tmp_path / "h.toml"
        # "nowhere" routes to no model: it is passed over; "small" is an alias, resolved as a requested name is.
        config.write_text(f'[store]\npath = "{tmp_path / "h.db"}"\n' + backend("p", p.url, "primary")
                          + backend("s", s.url, "secondary") + """
[routing]
health_check_seconds = 0
aliases = { small = "secondary" }
fallbacks = { primary = ["nowhere", "small"] }
""")
        with ServerThread(build_app(load_settings(config, environ={})), lifespan="on") as gateway:
            yield Served(gateway.url, tmp_path / "h.db", primary, secondary)


def test_a_server_error_falls_back_and_both_calls_are_recorded(served: Served) -> None:
    served.primary.failure = SERVER_ERROR
    raw = served.ask("hello fallback")
    completion = raw.parse()
    assert completion.model == "secondary"
    assert completion.choices[0].message.content == "echo: hello fallback"
    assert (len(served.primary.calls), len(served.secondary.calls)) == (1, 1)
    assert served.calls(raw.headers["x-harness-trajectory-id"]) == [
        ("error", "p", "primary", 0, None), ("ok", "s", "secondary", 0, "primary")]


def test_a_stream_falls_back_before_its_first_chunk(served: Served) -> None:
    served.primary.failure = SERVER_ERROR
    with served.client().chat.completions.with_streaming_response.create(
            model="primary", messages=[{"role": "user", "content": "streamed fallback"}], stream=True) as raw:
        trajectory = raw.headers["x-harness-trajectory-id"]
        chunks = list(raw.parse())
    assert {c.model for c in chunks} == {"secondary"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip() == "echo: streamed fallback"
    assert served.calls(trajectory) == [("error", "p", "primary", 1, None), ("ok", "s", "secondary", 1, "primary")]


@pytest.mark.parametrize("body", [
    {"error": {"message": "This model's maximum context length is 2048 tokens. However, you requested 4000 tokens "
               "(3000 in the messages, 1000 in the completion).", "type": "BadRequestError", "code": 400}},
    {"error": {"message": "The decoder prompt (length 4000) is longer than the maximum model length of 2048.",
               "type": "BadRequestError", "code": 400}},
    {"object": "error", "message": "The input (4000 tokens) is longer than the model's context length (2048 tokens).",
     "type": "BadRequestError", "code": 400},
    {"error": {"message": "Too long.", "type": "invalid_request_error", "code": "context_length_exceeded"}},
], ids=["vllm", "vllm-model-length", "sglang", "openai"])
def test_a_prompt_longer_than_the_context_falls_back(served: Served, body: dict[str, Any]) -> None:
    served.primary.failure = (400, body)
    assert served.ask("a long prompt").parse().choices[0].message.content == "echo: a long prompt"
    assert len(served.secondary.calls) == 1


def test_other_client_errors_do_not_fall_back(served: Served) -> None:
    served.primary.failure = (400, {"error": {"message": "temperature is out of range", "type": "invalid_request_error",
                                              "code": "invalid_value"}})
    with pytest.raises(openai.BadRequestError, match="temperature"):
        served.ask()
    assert served.secondary.calls == []


def test_when_every_fallback_fails_the_last_failure_is_answered_and_each_call_recorded(served: Served) -> None:
    served.primary.failure = served.secondary.failure = SERVER_ERROR
    with pytest.raises(openai.InternalServerError) as raised:
        served.ask("nobody answers")
    assert raised.value.status_code == 502 and raised.value.body["code"] is None
    trajectory = raised.value.response.headers["x-harness-trajectory-id"]
    assert served.calls(trajectory) == [("error", "p", "primary", 0, None), ("error", "s", "secondary", 0, "primary")]


def test_a_stream_that_fails_mid_way_does_not_fall_back(served: Served) -> None:
    stream = served.client().chat.completions.create(
        model="primary", messages=[{"role": "user", "content": "stall"}], stream=True)
    with pytest.raises(openai.APIError, match="stalled"):
        list(stream)
    assert (len(served.primary.calls), served.secondary.calls) == (1, [])
