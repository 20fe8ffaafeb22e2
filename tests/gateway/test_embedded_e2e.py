"""End to end on the real embedded model: the default `harness serve`, driven by the openai SDK."""

import asyncio
import sqlite3

import openai
import pytest

from tests.processes import GatewayProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory):
    # No [[backends]]: the gateway serves the embedded model, as `harness serve` does with no config.
    workdir = tmp_path_factory.mktemp("embedded")
    gw = GatewayProcess('[store]\npath = "harness.db"\n', workdir).start(timeout=300)
    yield gw
    gw.stop()


def test_chat_on_the_real_model_records_token_ids(embedded: GatewayProcess) -> None:
    client = openai.OpenAI(base_url=embedded.url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
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
