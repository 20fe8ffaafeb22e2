"""The embedded model serving ``/v1/completions`` through a real gateway (a tiny random Llama): a raw prompt
completed without a chat template, plain and streamed, with max_tokens, temperature and stop honoured."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from tests.extras import skip_without

skip_without("local")

from transformers import PreTrainedTokenizerBase  # noqa: E402

from gateway.app import build_app  # noqa: E402
from gateway.config import Settings  # noqa: E402
from tests.standin import ServerThread  # noqa: E402

pytestmark = pytest.mark.integration

MODEL = "tiny"
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[tuple[str, Path]]:
    tmp = tmp_path_factory.mktemp("local-completions")
    settings = Settings.model_validate({
        "store": {"path": str(tmp / "harness.db")},
        "backends": [{"name": "local", "kind": "local", "model_path": str(tiny_model_dir), "models": [MODEL],
                      "batch_wait_ms": 5}],
    })
    with ServerThread(build_app(settings), lifespan="on") as server:
        yield server.url, tmp / "harness.db"


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def test_a_raw_prompt_is_completed_plain_and_streamed_alike(served: tuple[str, Path],
                                                           smol_tokenizer: PreTrainedTokenizerBase) -> None:
    url, db = served
    raw = _client(url).completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                                            temperature=0)
    done = raw.parse()
    prompt_ids = smol_tokenizer.encode(PROMPT)
    assert done.object == "text_completion" and done.id.startswith("cmpl-")
    assert done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(prompt_ids), 6)
    text = done.choices[0].text
    assert text
    with _client(url).completions.with_streaming_response.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                                                 temperature=0, stream=True) as streamed:
        tid = streamed.headers["x-harness-trajectory-id"]
        chunks = list(streamed.parse())
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text  # greedy: the same tokens
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)
    conn = sqlite3.connect(db)
    try:
        [(api, status, prompt, completion, messages, ids)] = conn.execute(
            "SELECT native_api, status, prompt_tokens, completion_tokens, request_messages, native_bodies "
            "FROM model_calls WHERE trajectory_id = ?", (tid,)).fetchall()
        response = orjson.loads(conn.execute("SELECT body FROM blobs WHERE hash = ?",
                                             (orjson.loads(ids)[1],)).fetchone()[0])
    finally:
        conn.close()
    assert (api, status, prompt, completion, messages) == ("completions", "ok", len(prompt_ids), 6, "[]")
    assert response["choices"][0]["text"] == text


def test_token_prompts_and_a_stop_string(served: tuple[str, Path], smol_tokenizer: PreTrainedTokenizerBase) -> None:
    client = _client(served[0])
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    as_ids = client.completions.create(model=MODEL, prompt=smol_tokenizer.encode(PROMPT), max_tokens=8,
                                       temperature=0)
    assert as_ids.choices[0].text == text
    stop = text[len(text) // 2]
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stop=[stop])
    assert stopped.choices[0].text == text[:text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    sampled = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=1.5, seed=3)
    assert sampled.usage.completion_tokens == 4


@pytest.mark.parametrize("body, param, code", [
    ({"prompt": ["one", "two"]}, "prompt", "unsupported_value"),
    ({"prompt": "x", "echo": True}, "echo", "unsupported_parameter"),
    ({"prompt": "x", "logprobs": 2}, "logprobs", "unsupported_parameter"),
    ({"prompt": "x", "suffix": "!"}, "suffix", "unsupported_parameter"),
    ({"prompt": [[1, 10**9]]}, "prompt", None),
    ({"prompt": "x", "max_tokens": 10**6}, "max_tokens", "context_length_exceeded"),
])
def test_what_the_engine_cannot_do_is_a_400(served: tuple[str, Path], body: dict, param: str,
                                           code: str | None) -> None:
    r = httpx.post(f"{served[0]}/v1/completions", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code)


def test_the_embedded_model_serves_no_embeddings(served: tuple[str, Path]) -> None:
    with pytest.raises(openai.NotFoundError) as refused:
        _client(served[0]).embeddings.create(model=MODEL, input="hello")
    assert refused.value.body["code"] == "unsupported_api"
