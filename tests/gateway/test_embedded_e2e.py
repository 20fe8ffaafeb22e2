"""End to end on the real embedded model: the default `harness serve`, driven by the openai SDK."""

import asyncio
import json
import sqlite3
import time

import jsonschema
import openai
import pydantic
import pytest

from replay.records import unpack
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


# -- what the engine honours, on the real model ---------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 40},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone.",
                                          "parameters": {"type": "object", "properties": {
                                              "timezone": {"type": "string", "maxLength": 40}},
                                              "required": ["timezone"], "additionalProperties": False}}}


class City(pydantic.BaseModel):
    # Bounded fields: a 135M model held to "a number" can write digits until max_tokens.
    name: str = pydantic.Field(max_length=30)
    country: str = pydantic.Field(max_length=30)
    is_capital: bool
    rank: int = pydantic.Field(ge=1, le=99)


def test_structured_output_parses_on_the_real_model(embedded: GatewayProcess) -> None:
    client = openai.OpenAI(base_url=embedded.url + "/v1", api_key="unused", max_retries=0)
    done = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON."}], response_format=City,
        max_tokens=80, temperature=0)
    assert isinstance(done.choices[0].message.parsed, City)
    raw = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object about cats."}], max_tokens=80,
        temperature=0.8, seed=1, response_format={"type": "json_object"})
    if raw.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(raw.choices[0].message.content), dict)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_required_or_named_tool_choice_gets_a_valid_call_on_the_real_model(embedded: GatewayProcess,
                                                                              tool_choice: object) -> None:
    client = openai.OpenAI(base_url=embedded.url + "/v1", api_key="unused", max_retries=0)
    for prompt in ("What's the weather like in Oslo?", "Tell me a joke."):
        done = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], tools=[WEATHER, CLOCK],
            tool_choice=tool_choice, parallel_tool_calls=False, max_tokens=80, temperature=0.7, seed=2)
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        [call] = choice.message.tool_calls
        tool = {"get_weather": WEATHER, "get_time": CLOCK}[call.function.name]
        assert tool_choice == "required" or call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_logprobs_on_the_real_model_are_openais_and_the_sampled_ones_recompute(embedded: GatewayProcess) -> None:
    import torch

    from gateway.backends.local.loading import load_model

    client = openai.OpenAI(base_url=embedded.url + "/v1", api_key="unused", max_retries=0)
    temperature = 0.8
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Write one sentence about the sea."}], max_tokens=16,
        temperature=temperature, seed=4, logprobs=True, top_logprobs=2)
    done = raw.parse()
    content = done.choices[0].logprobs.content
    assert len(content) == done.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)
    assert "".join(t.token for t in content).strip().startswith(done.choices[0].message.content.strip()[:10])
    db = sqlite3.connect(embedded.db)
    prompt, ids, own, sampled = (unpack(v) for v in db.execute(
        "SELECT prompt_token_ids, completion_token_ids, completion_logprobs, completion_sampled_logprobs "
        "FROM model_calls WHERE trajectory_id = ?", (raw.headers["x-harness-trajectory-id"],)).fetchone())
    assert [t.logprob for t in content] == pytest.approx(own[0], abs=1e-6)
    model = load_model().model
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids[0]])).logits[0, len(prompt) - 1:-1].float()
    target = torch.tensor(ids[0])[:, None]
    recomputed = torch.log_softmax(logits / temperature, -1).gather(1, target)[:, 0]
    assert float((recomputed - torch.tensor(sampled[0])).abs().max()) < 1e-4
    model_own = torch.log_softmax(logits, -1).gather(1, target)[:, 0]
    assert float((model_own - torch.tensor(own[0])).abs().max()) < 1e-4


def test_what_the_real_model_cannot_do_is_a_400(embedded: GatewayProcess) -> None:
    client = openai.OpenAI(base_url=embedded.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=messages, reasoning_effort="high")
    assert caught.value.body["param"] == "reasoning_effort"
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=messages, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {
                "type": "object", "dependentSchemas": {"a": {"required": ["b"]}}}}})
    assert caught.value.body["param"] == "response_format.json_schema.schema"
    assert "dependentSchemas" in caught.value.body["message"]


def test_time_to_first_token_is_the_first_content_not_the_role_chunk(embedded: GatewayProcess) -> None:
    client = openai.OpenAI(base_url=embedded.url + "/v1", api_key="unused", max_retries=0)
    started = time.perf_counter()
    first_content = None
    with client.chat.completions.with_streaming_response.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me a long story about a lighthouse. " * 30}],
            max_tokens=120, temperature=0.7, seed=5, stream=True, extra_body={"ignore_eos": True}) as raw:
        tid = raw.headers["x-harness-trajectory-id"]
        for line in raw.iter_lines():
            if first_content is None and '"content":"' in line and '"content":""' not in line:
                first_content = (time.perf_counter() - started) * 1000
        total = (time.perf_counter() - started) * 1000
    assert first_content is not None and total > 1000  # a multi-second stream
    db = sqlite3.connect(embedded.db)
    for _ in range(50):  # the record commits right after the last chunk
        row = db.execute("SELECT ttft_ms FROM model_calls WHERE trajectory_id = ?", (tid,)).fetchone()
        if row:
            break
        time.sleep(0.05)
    assert row is not None and abs(row[0] - first_content) < 50, (row, first_content, total)


def test_the_prefix_cache_saves_a_conversations_prefill_and_says_so_in_metrics(embedded: GatewayProcess) -> None:
    import httpx

    client = openai.OpenAI(base_url=embedded.url + "/v1", api_key="unused", max_retries=0)

    def metric(text: str, name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    before = httpx.get(embedded.url + "/metrics").text
    messages = [{"role": "system", "content": "You are a terse assistant. " * 20},
                {"role": "user", "content": "Name a fruit."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And a vegetable?"}]
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    after = httpx.get(embedded.url + "/metrics").text
    assert metric(after, "harness_prefix_cache_hits_total") > metric(before, "harness_prefix_cache_hits_total")
    saved = metric(after, "harness_prefix_cache_prefill_saved_total") - metric(
        before, "harness_prefix_cache_prefill_saved_total")
    assert saved >= first.usage.prompt_tokens  # the whole first turn was reused
    assert metric(after, "harness_prefix_cache_bytes") > 0
