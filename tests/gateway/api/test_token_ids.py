"""``return_token_ids``: a caller that trains on its answers gets the token ids and log-probabilities of the
replica that sampled them, in one form whatever the backend (SGLang and vLLM stand-ins behind a real gateway), and
the admin may keep its calls out of the capture (``X-Harness-Capture: off``)."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import build_app
from gateway.config import Settings
from tests.standin import ServerThread
from tests.standins.common import LoRAServerStandIn
from tests.standins.sglang import SGLangStandIn
from tests.standins.vllm import VLLMStandIn

pytestmark = pytest.mark.integration

ADMIN = "admin-secret"
BASE = "qwen-test"
ASK = {"model": BASE, "messages": [{"role": "user", "content": "hi"}]}


@contextmanager
def gateway(tmp: Path, standins: dict[str, tuple[str, LoRAServerStandIn]]) -> Iterator[httpx.Client]:
    """A gateway whose model is served by every stand-in (name: (kind, stand-in)), as one pool."""
    with ExitStack() as stack:
        backends = [{"name": name, "kind": kind, "base_url": f"{stack.enter_context(ServerThread(s.app)).url}/v1",
                     "models": [BASE], "max_retries": 0} for name, (kind, s) in standins.items()]
        settings = Settings.model_validate({"store": {"path": str(tmp / "harness.db")}, "backends": backends,
                                            "routing": {"health_check_seconds": 0}})
        settings.server.admin_key = ADMIN
        server = stack.enter_context(ServerThread(build_app(settings), lifespan="on"))
        yield stack.enter_context(httpx.Client(base_url=server.url, timeout=30,
                                               headers={"Authorization": f"Bearer {ADMIN}"}))


def _upstream_bodies(standin: LoRAServerStandIn) -> list[dict[str, Any]]:
    return [body for path, body in standin.calls if path.endswith("/chat/completions")]


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_the_answer_carries_the_sampling_replicas_tokens(kind: str, tmp_path: Path) -> None:
    standin = SGLangStandIn(served_model_name=BASE) if kind == "sglang" else VLLMStandIn(served_model_name=BASE)
    with gateway(tmp_path, {"replica-a": (kind, standin)}) as client:
        response = client.post("/v1/chat/completions", json={**ASK, "return_token_ids": True})
        assert response.status_code == 200, response.text
        answer = response.json()
        plain = client.post("/v1/chat/completions", json=ASK).json()
    assert response.headers["x-harness-backend"] == "replica-a"
    (sampled, _) = standin.sampled
    choice = answer["choices"][0]
    assert answer["prompt_token_ids"] == list(range(1, 11))
    assert choice["token_ids"] == sampled["token_ids"]
    if kind == "sglang":  # SGLang's are after the temperature, vLLM's the raw model's
        assert choice["sampled_logprobs"] == sampled["logprobs"] and choice["token_logprobs"] is None
    else:
        assert choice["token_logprobs"] == sampled["logprobs"] and choice["sampled_logprobs"] is None
    # The server's own fields and the log-probabilities the caller did not ask for stay out of the answer.
    assert choice["logprobs"] is None and "meta_info" not in choice
    asked, unasked = _upstream_bodies(standin)
    assert asked["logprobs"] is True and "return_token_ids" in asked if kind == "vllm" else \
        asked["return_prompt_token_ids"] is True and "return_token_ids" not in asked
    # Nothing is asked of a replica, nor added to an answer, for a caller that did not ask.
    assert not {"logprobs", "return_token_ids", "return_prompt_token_ids", "return_meta_info"} & set(unasked)
    assert not {"prompt_token_ids", "x-harness-backend"} & (set(plain) | set(response.headers) - {
        "x-harness-backend"}) and "token_ids" not in plain["choices"][0]


def test_each_answer_names_the_replica_of_a_pool_that_sampled_it(tmp_path: Path) -> None:
    standins = {"replica-a": ("sglang", SGLangStandIn(served_model_name=BASE)),
                "replica-b": ("sglang", SGLangStandIn(served_model_name=BASE))}
    with gateway(tmp_path, standins) as client:
        answers = [client.post("/v1/chat/completions", json={**ASK, "return_token_ids": True, "logprobs": True})
                   for _ in range(8)]
    sampled = {tuple(s["token_ids"]): (name, s["logprobs"]) for name, (_, standin) in standins.items()
               for s in standin.sampled}
    assert {a.headers["x-harness-backend"] for a in answers} == set(standins)  # both replicas served
    for answer in answers:
        choice = answer.json()["choices"][0]
        assert sampled[tuple(choice["token_ids"])] == (answer.headers["x-harness-backend"], choice["sampled_logprobs"])
        assert [c["logprob"] for c in choice["logprobs"]["content"]] == choice["sampled_logprobs"]  # asked for


def test_token_ids_are_answered_for_plain_requests_only_and_must_be_a_boolean(tmp_path: Path) -> None:
    standin = SGLangStandIn(served_model_name=BASE)
    with gateway(tmp_path, {"replica-a": ("sglang", standin)}) as client:
        streamed = client.post("/v1/chat/completions", json={**ASK, "return_token_ids": True, "stream": True})
        wrong = client.post("/v1/chat/completions", json={**ASK, "return_token_ids": "yes"})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "return_token_ids"
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "return_token_ids"
    assert not _upstream_bodies(standin)


def test_the_admin_may_keep_its_calls_out_of_the_capture(tmp_path: Path) -> None:
    with gateway(tmp_path, {"replica-a": ("sglang", SGLangStandIn(served_model_name=BASE))}) as client:
        client.post("/v1/chat/completions", json=ASK, headers={"X-Harness-Capture": "off"}).raise_for_status()
        client.post("/v1/chat/completions", json={**ASK, "messages": [{"role": "user", "content": "kept"}]}) \
            .raise_for_status()
        # Any other caller (here the open access a loopback gateway without keys gives) is recorded whatever it sends.
        httpx.post(f"{client.base_url}/v1/chat/completions", headers={"X-Harness-Capture": "off"}, timeout=30,
                   json={**ASK, "messages": [{"role": "user", "content": "open"}]}).raise_for_status()
    with sqlite3.connect(tmp_path / "harness.db") as conn:
        calls = conn.execute("SELECT COUNT(*) FROM model_calls").fetchone()[0]
        texts = b" ".join(row[0] for row in conn.execute("SELECT body FROM blobs"))
    assert calls == 2 and b'"kept"' in texts and b'"open"' in texts and b'"hi"' not in texts
