"""``POST /v1/embeddings`` through a real gateway process in front of the stand-in upstream, driven by the real
openai SDK: the client gets its vectors, the store the call without them."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.gateway.api.native_calls import CHAT_ONLY, MODEL, chat_only_backend, client, rows, stored_call
from tests.processes import GatewayProcess, upstream_config
from tests.standin import StandIn

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gw(standin: tuple[StandIn, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    proc = GatewayProcess(upstream_config(standin[1], extra=chat_only_backend(standin[1])),
                          tmp_path_factory.mktemp("embeddings")).start()
    yield proc
    proc.stop()


def test_embeddings_reach_the_client_and_are_recorded_without_vectors(gw: GatewayProcess, standin) -> None:
    raw = client(gw).embeddings.with_raw_response.create(model=MODEL, input=["first text", "second text"],
                                                         dimensions=4, encoding_format="float", user="u-1")
    tid = raw.headers["x-harness-trajectory-id"]
    answer = raw.parse()
    assert [d.embedding for d in answer.data] == [[0.0, 0.1, 0.2, 0.3], [1.0, 1.1, 1.2, 1.3]]
    assert answer.usage.prompt_tokens == 4
    sent = standin[0].calls[-1]
    assert (sent["input"], sent["dimensions"], sent["encoding_format"], sent["user"]) == \
        (["first text", "second text"], 4, "float", "u-1")
    call = stored_call(gw, tid)
    assert (call["api"], call["status"], call["backend"], call["model"]) == ("embeddings", "ok", "standin", MODEL)
    assert (call["prompt_tokens"], call["completion_tokens"]) == (4, 0) and call["latency_ms"] > 0
    assert call["messages"] == [] and call["replies"] == []
    assert call["request"]["input"] == ["first text", "second text"]
    assert call["response"]["data"] == [{"object": "embedding", "index": 0, "dimensions": 4},
                                        {"object": "embedding", "index": 1, "dimensions": 4}]
    assert call["response"]["usage"] == {"prompt_tokens": 4, "total_tokens": 4}
    # no vector anywhere in the store, not even in a body kept whole
    assert not any(b"1.3" in body for (body,) in rows(gw, "SELECT body FROM blobs"))


def test_base64_vectors_pass_through_and_are_counted(gw: GatewayProcess) -> None:
    raw = client(gw).embeddings.with_raw_response.create(model=MODEL, input=[[1, 2], [3]], dimensions=6)
    answer = raw.parse()  # the SDK asks for base64 and decodes it
    assert len(answer.data) == 2 and len(answer.data[1].embedding) == 6
    assert answer.data[1].embedding[0] == pytest.approx(1.0)
    call = stored_call(gw, raw.headers["x-harness-trajectory-id"])
    assert [d["dimensions"] for d in call["response"]["data"]] == [6, 6]
    assert all("embedding" not in d for d in call["response"]["data"])


def test_a_model_whose_backend_does_not_serve_embeddings_is_a_404(gw: GatewayProcess) -> None:
    with pytest.raises(openai.NotFoundError) as unsupported:
        client(gw).embeddings.create(model=CHAT_ONLY, input="hi")
    error = unsupported.value.body
    assert (error["code"], error["param"]) == ("unsupported_api", "model")
    assert CHAT_ONLY in error["message"] and "/v1/embeddings" in error["message"]
    with pytest.raises(openai.NotFoundError) as unknown:
        client(gw).embeddings.create(model="nope", input="hi")
    assert unknown.value.body["code"] == "model_not_found"


def test_an_upstream_error_is_answered_and_recorded(gw: GatewayProcess) -> None:
    with pytest.raises(openai.APIStatusError) as failed:
        client(gw).embeddings.create(model=MODEL, input="status:503")
    assert failed.value.status_code == 503
    call = stored_call(gw, failed.value.response.headers["x-harness-trajectory-id"])
    assert (call["api"], call["status"], call["response"]) == ("embeddings", "error", None)


@pytest.mark.parametrize("body, param", [
    (b'{"model": "stand-in-model"}', "input"),
    (b'{"model": "stand-in-model", "input": {"text": "x"}}', "input"),
    (b'{"model": "stand-in-model", "input": "x", "encoding_format": "hex"}', "encoding_format"),
    (b'{"model": "stand-in-model", "input": "x", "dimensions": 0}', "dimensions"),
    (b'{"model": "stand-in-model", "input": "x", "user": 5}', "user"),
])
def test_a_bad_body_is_a_400_naming_the_field(gw: GatewayProcess, body: bytes, param: str) -> None:
    r = httpx.post(gw.url + "/v1/embeddings", content=body, headers={"content-type": "application/json"},
                   timeout=10)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["param"] == param
