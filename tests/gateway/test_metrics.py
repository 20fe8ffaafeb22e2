"""``/metrics`` figures you can trust, each checked against a real gateway (a scripted backend that counts its
prompts as a tokenizer would): agent runs and the guard's retries count their tokens, request series stay few
whatever model names clients make up, and an agent run's token budget is held before each call."""

import re
import sqlite3
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.app import build_app
from gateway.config import load_settings
from tests.gateway.api.support import CONFIG as BASE_CONFIG
from tests.gateway.api.support import store_rows
from tests.scripted import ScriptedBackend, call, serve_scripted
from tests.standin import ServerThread

pytestmark = pytest.mark.integration

BUDGET = 420
CONFIG = BASE_CONFIG + f"""
[[profiles]]
name = "frugal"
model = "scripted-model"
system_prompt = "You compute."
tools = ["calculator"]
max_steps = 10
max_total_tokens = {BUDGET}
"""
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


class Served:
    def __init__(self, url: str, backend: ScriptedBackend, db: Path) -> None:
        self.url, self.backend, self.db = url, backend, db
        self.client = openai.OpenAI(base_url=url + "/v1", api_key="sk-test", max_retries=0)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics").text

    def tokens(self, kind: str) -> float:
        found = re.search(rf'harness_tokens_total{{kind="{kind}",model="scripted-model"}} (\S+)', self.metrics())
        return float(found.group(1)) if found else 0.0

    def stored_tokens(self) -> tuple[int, int]:
        [(prompt, completion)] = store_rows(self.db, "SELECT SUM(prompt_tokens), SUM(completion_tokens) "
                                                     "FROM model_calls")
        return prompt or 0, completion or 0


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    cfg = tmp_path / "h.toml"
    db = tmp_path / "h.db"
    cfg.write_text(CONFIG.replace("{db}", str(db)))
    app = build_app(load_settings(cfg, environ={}))
    backend = ScriptedBackend([], usage=(0, 40), counted=True)
    serve_scripted(app, backend)
    with ServerThread(app, lifespan="on") as server:
        yield Served(server.url, backend, db)


def test_agent_runs_and_guard_retries_count_their_tokens(served: Served) -> None:
    served.backend.script = [call("calculator", {"expression": "6*7"}), "42"]
    served.client.chat.completions.create(model="agent:calc", messages=[{"role": "user", "content": "6*7?"}])
    prompt, completion = served.stored_tokens()
    assert prompt > 0 and completion == 80
    assert (served.tokens("prompt"), served.tokens("completion")) == (prompt, completion)

    # The guard sends an invalid call back once: both calls' tokens count, not only the answer's.
    served.backend.script = [call("add", {"a": "one"}), call("add", {"a": 1, "b": 2})]
    reply = served.client.chat.completions.create(model="scripted-model", tools=[ADD],
                                                  messages=[{"role": "user", "content": "1+2"}])
    assert reply.choices[0].message.tool_calls[0].function.arguments == '{"a": 1, "b": 2}'
    prompt, completion = served.stored_tokens()
    assert completion == 80 + 2 * 40
    assert (served.tokens("prompt"), served.tokens("completion")) == (prompt, completion)


def series(text: str, name: str) -> set[str]:
    return {line.rsplit(" ", 1)[0] for line in text.splitlines() if line.startswith(name + "{")}


def test_made_up_model_names_add_no_series(served: Served) -> None:
    served.client.chat.completions.create(model="scripted-model", messages=[{"role": "user", "content": "hi"}])
    routed = 'harness_requests_total{backend="scripted",model="scripted-model",route="chat",status="200"}'
    before = served.metrics()
    for _ in range(50):  # counted once the response's last byte is out, which may be just after the client has it
        if routed in before:
            break
        time.sleep(0.02)
        before = served.metrics()
    assert routed in before
    with httpx.Client(base_url=served.url, timeout=30) as http:
        for _ in range(1000):
            r = http.post("/v1/chat/completions", json={"model": f"made-up-{uuid.uuid4().hex}",
                                                        "messages": [{"role": "user", "content": "x"}]})
            assert r.status_code == 404
    after = served.metrics()
    for name in ("harness_requests_total", "harness_request_latency_seconds_count"):
        added = {s for s in series(after, name) - series(before, name) if 'route="metrics"' not in s}
        assert len(added) <= 1, added
        assert all('model=""' in s and 'backend=""' in s for s in added), added


def test_an_agent_runs_token_budget_is_held_before_each_call(served: Served) -> None:
    served.backend.script = [call("calculator", {"expression": f"{i}+1"}) for i in range(10)]
    reply = served.client.chat.completions.with_raw_response.create(
        model="agent:frugal", messages=[{"role": "user", "content": "count up"}])
    tid = reply.headers["x-harness-trajectory-id"]
    db = sqlite3.connect(served.db)
    try:
        [(reason,)] = db.execute("SELECT termination_reason FROM trajectories WHERE id = ?", (tid,)).fetchall()
        [(spent,)] = db.execute("SELECT SUM(prompt_tokens + completion_tokens) FROM model_calls "
                                "WHERE trajectory_id = ?", (tid,)).fetchall()
    finally:
        db.close()
    assert reason == "max_total_tokens"
    assert spent <= BUDGET, f"spent {spent} of a budget of {BUDGET}"
    # The last call went with the room that was left, less than the 40 it would otherwise have used.
    assert served.backend.requests[-1]["max_tokens"] < 40
