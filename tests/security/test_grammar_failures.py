"""Finding: a grammar that failed returned a 200 ``stop`` whose content broke the schema.

A recursive ``$ref`` gave ``{"``, a ``$ref`` cycle ``""`` and ``pattern: ^(a{1000}){1000}$`` a lone ``"``, all with
``finish_reason: stop``. Now a grammar that fails before any output can match it is a 400 ``unsupported_schema``
(``grammar.Grammar.build`` walks the path every output must take), and one that fails during generation ends its
sequence with the finish reason ``error``; the rest of the batch goes on.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tests.processes import GatewayProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
PARAM = "response_format.json_schema.schema"
FAILING = {
    "recursive": {"$ref": "#/$defs/node", "$defs": {"node": {
        "type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}, "required": ["next"]}}},
    "cycle": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
    "exploding_pattern": {"type": "string", "pattern": "^(a{1000}){1000}$"},
}
# Fails only once the model has chosen ``x``: the lexer of ``y``'s pattern exceeds its bounds mid-way.
FAILS_LATER = {"type": "object", "properties": {"x": {"type": "boolean"},
                                                "y": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
               "required": ["x", "y"], "additionalProperties": False}


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory):
    gw = GatewayProcess('[store]\npath = "harness.db"\n', tmp_path_factory.mktemp("grammar")).start(timeout=300)
    yield gw
    gw.stop()


def _body(schema: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Answer in JSON."}],
                            "max_tokens": 16, "temperature": 0, **extra}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    return body


@pytest.mark.parametrize("name", sorted(FAILING))
def test_a_grammar_that_cannot_be_met_is_a_400(embedded: GatewayProcess, name: str) -> None:
    r = httpx.post(embedded.url + "/v1/chat/completions", json=_body(FAILING[name]), timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "unsupported_schema" and error["param"] == PARAM
    assert "cannot be enforced" in error["message"]


async def test_a_grammar_that_fails_mid_way_ends_with_an_error_finish_alone(embedded: GatewayProcess) -> None:
    async with httpx.AsyncClient(base_url=embedded.url, timeout=120) as client:
        failing, plain = await asyncio.gather(
            client.post("/v1/chat/completions", json=_body(FAILS_LATER)),
            client.post("/v1/chat/completions", json=_body()))
    assert failing.status_code == 200, failing.text
    choice = failing.json()["choices"][0]
    assert choice["finish_reason"] == "error"  # never "stop": the content does not match the schema
    assert choice["message"]["content"].startswith('{"x": ')
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice["message"]["content"])
    # The plain request batched with it generated all it asked for.
    assert plain.status_code == 200
    assert plain.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert plain.json()["usage"]["completion_tokens"] > 1


def test_a_streamed_grammar_failure_ends_with_an_error_finish(embedded: GatewayProcess) -> None:
    with httpx.stream("POST", embedded.url + "/v1/chat/completions", json=_body(FAILS_LATER, stream=True),
                      timeout=120) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    reasons = [c["finish_reason"] for chunk in chunks for c in chunk["choices"] if c.get("finish_reason")]
    assert reasons == ["error"]


def test_a_grammar_failure_leaves_a_response_incomplete(embedded: GatewayProcess) -> None:
    r = httpx.post(embedded.url + "/v1/responses", timeout=120, json={
        "model": MODEL, "input": "Answer in JSON.", "max_output_tokens": 16, "temperature": 0,
        "text": {"format": {"type": "json_schema", "name": "answer", "schema": FAILS_LATER}}})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "incomplete" and r.json()["incomplete_details"] == {"reason": "error"}
