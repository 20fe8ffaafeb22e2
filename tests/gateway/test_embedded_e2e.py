"""End to end on the real embedded model: the default `harness serve`, driven by the openai SDK."""

import asyncio
import sqlite3

import openai
import pytest

from tests.processes import GatewayProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
# No [[backends]]: the embedded model is served, as `harness serve` does with no config.
PROFILE = """
[[profiles]]
name = "calc"
model = "smollm2-135m-instruct"
system_prompt = "You are a helpful assistant. Use the calculator tool for arithmetic."
tools = ["calculator"]
max_steps = 3
max_tokens = 48
temperature = 0
"""


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory):
    workdir = tmp_path_factory.mktemp("embedded")
    gw = GatewayProcess('[store]\npath = "harness.db"\n' + PROFILE, workdir).start(timeout=300)
    yield gw
    gw.stop()


def test_chat_on_the_real_model_records_token_ids(embedded: GatewayProcess) -> None:
    client = openai.OpenAI(base_url=embedded.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL, "agent:calc"]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=8,
        temperature=0)
    done = raw.parse()
    assert done.choices[0].finish_reason in ("stop", "length")
    assert done.usage.completion_tokens <= 8 and done.usage.prompt_tokens > 5
    tid = raw.headers["x-harness-trajectory-id"]
    db = sqlite3.connect(embedded.db)
    prompt_ids, completion_ids = db.execute(
        "SELECT prompt_token_ids, completion_token_ids FROM model_calls WHERE trajectory_id = ?", (tid,)).fetchone()
    assert prompt_ids and completion_ids

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Count to three."}], max_tokens=8, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens <= 8
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


async def test_concurrent_requests_on_the_real_model(embedded: GatewayProcess) -> None:
    client = openai.AsyncOpenAI(base_url=embedded.url + "/v1", api_key="unused", max_retries=0)
    results = await asyncio.gather(*[client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": f"Name a colour ({i})."}], max_tokens=6)
        for i in range(4)])
    assert all(r.choices[0].message.content is not None for r in results)
    await client.close()


def test_agent_run_on_the_real_model_ends_with_a_named_reason(embedded: GatewayProcess) -> None:
    client = openai.OpenAI(base_url=embedded.url + "/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="agent:calc", messages=[{"role": "user", "content": "What is 17 times 23?"}])
    body = raw.http_response.json()
    h = body["harness"]
    assert h["status"] in ("completed", "terminated")
    if h["status"] == "terminated":
        assert h["termination_reason"] in ("max_steps", "max_total_tokens", "deadline", "tool_failures",
                                           "loop_detected")
    assert 1 <= h["steps"] <= 4 and h["usage"]["total_tokens"] > 0
    assert isinstance(body["choices"][0]["message"]["content"], str)
    db = sqlite3.connect(embedded.db)
    tid = h["trajectory_id"]
    assert db.execute("SELECT status, steps FROM agent_runs WHERE id = ?", (tid,)).fetchone() == (h["status"],
                                                                                                  h["steps"])
    states = [r[0] for r in db.execute("SELECT state FROM events WHERE trajectory_id = ? ORDER BY id", (tid,))]
    assert states[0] == "CALL_MODEL" and states[-1] in ("FINAL", "TERMINATED")
    calls = db.execute("SELECT prompt_token_ids IS NOT NULL, completion_token_ids IS NOT NULL FROM model_calls "
                       "WHERE trajectory_id = ?", (tid,)).fetchall()
    assert len(calls) >= h["steps"] and all(a and b for a, b in calls)
    tool_rows = db.execute("SELECT COUNT(*) FROM tool_calls WHERE trajectory_id = ?", (tid,)).fetchone()[0]
    assert tool_rows == h["tool_calls"]
