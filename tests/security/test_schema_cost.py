"""Finding: pathological but accepted schemas slowed the whole batch.

With a 300 KB ``pattern``, ``(.*a){20}``, ``minLength: 1e9`` or 5,000 required properties, 24 tokens took 17-32 s
against 6 s unconstrained, and a plain request running alongside 12-27 s against 2 s: the grammar was compiled on
the engine's thread, between two of the batch's steps, and a long regex costs at every token more than
llguidance's fuel meters. Now what llguidance does not meter is a 400 ``unsupported_schema`` up front (a pattern
over 1,000 characters, a minimum no context holds); the grammar and its matchers are built before the job reaches
the engine, within a time bound; and each mask is bounded by llguidance's fuel and a per-sequence time budget.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest

from tests.processes import GatewayProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
WORDS = "|".join(f"w{i:05d}" for i in range(50_000))
REFUSED = {
    "pattern_300kb": {"type": "string", "pattern": "^" + "a" * 300_000 + "$"},
    "pattern_300kb_alternation": {"type": "string", "pattern": f"^({WORDS})$"},
    "min_length_1e9": {"type": "string", "minLength": 10**9},
}
ACCEPTED = {
    "dot_star_a_20": {"type": "string", "pattern": "(.*a){20}"},
    "required_5000": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(5000)},
                      "required": [f"p{i}" for i in range(5000)]},
}


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory):
    gw = GatewayProcess('[store]\npath = "harness.db"\n', tmp_path_factory.mktemp("cost")).start(timeout=300)
    yield gw
    gw.stop()


def _body(schema: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Write a long story."}],
                            "max_tokens": 24, "temperature": 0}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    return body


async def _timed(client: httpx.AsyncClient, body: dict[str, Any], delay: float = 0.0) -> tuple[float, httpx.Response]:
    await asyncio.sleep(delay)
    started = time.monotonic()
    response = await client.post("/v1/chat/completions", json=body)
    return time.monotonic() - started, response


async def _with_plain(gw: GatewayProcess, schema: dict[str, Any]) -> tuple[float, httpx.Response, float, float]:
    """The constrained request with a plain one alongside: (its time, its response, the plain one's time, the time
    of the same plain request alone)."""
    async with httpx.AsyncClient(base_url=gw.url, timeout=120) as client:
        await _timed(client, {**_body(), "max_tokens": 2})  # warm
        alone, plain = await _timed(client, _body())
        assert plain.status_code == 200
        (took, response), (beside, plain) = await asyncio.gather(_timed(client, _body(schema)),
                                                                 _timed(client, _body(), 0.2))
        assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 24
    return took, response, beside, alone


@pytest.mark.parametrize("name", sorted(REFUSED))
async def test_a_schema_whose_cost_is_unmetered_is_refused_at_once(embedded: GatewayProcess, name: str) -> None:
    took, response, beside, alone = await _with_plain(embedded, REFUSED[name])
    assert response.status_code == 400, response.text[:500]
    error = response.json()["error"]
    assert error["code"] == "unsupported_schema" and error["param"] == "response_format.json_schema.schema"
    assert len(error["message"]) < 1000  # not the 300 KB schema quoted back
    assert took < 5
    assert beside < 3 * alone + 3, f"the plain request took {beside:.1f} s beside it, {alone:.1f} s alone"


def test_a_costly_pattern_in_a_tool_is_refused_naming_the_tools(embedded: GatewayProcess) -> None:
    # Short enough for the prompt, which shows the tool, to fit the context.
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "^" + "a" * 3000 + "$"}},
        "required": ["x"]}}}
    r = httpx.post(embedded.url + "/v1/chat/completions", timeout=60,
                   json={**_body(), "tools": [tool], "tool_choice": "required"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "unsupported_schema" and r.json()["error"]["param"] == "tools"


@pytest.mark.parametrize("name", sorted(ACCEPTED))
async def test_a_costly_but_bounded_schema_does_not_hold_up_the_batch(embedded: GatewayProcess, name: str) -> None:
    took, response, beside, alone = await _with_plain(embedded, ACCEPTED[name])
    assert response.status_code == 200, response.text[:500]
    assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert took < 3 * alone + 5, f"24 constrained tokens took {took:.1f} s, 24 plain ones {alone:.1f} s"
    assert beside < 3 * alone + 3, f"the plain request took {beside:.1f} s beside it, {alone:.1f} s alone"
