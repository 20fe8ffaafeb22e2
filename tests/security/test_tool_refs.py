"""Finding: tool parameters with ``$defs``/``$ref`` were refused when constrained.

With ``tool_choice`` naming the tool (or ``required``, or ``constrain_tool_calls``), a tool whose parameters refer
to their own ``$defs`` got a 400 ``Pointer '/$defs/c' does not exist``, though the same schema worked as a
``response_format``: a call's grammar nests the parameters under ``/properties/arguments``, where ``#/$defs/...``
pointed at nothing. Now the parameters' local references are rewritten to where they sit.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

from tests.processes import GatewayProcess

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
PARAMETERS = {
    "type": "object",
    "properties": {"city": {"$ref": "#/$defs/c"}, "unit": {"$ref": "#/definitions/unit"}},
    "required": ["city", "unit"], "additionalProperties": False,
    "$defs": {"c": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}},
    "definitions": {"unit": {"enum": ["c", "f"]}},
}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                         "parameters": PARAMETERS}}
# Refers to its own root: a tree of any depth.
TREE = {"type": "object", "properties": {"label": {"type": "string", "maxLength": 8},
                                         "children": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
        "required": ["label"], "additionalProperties": False}


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory):
    gw = GatewayProcess('[store]\npath = "harness.db"\n', tmp_path_factory.mktemp("tool-refs")).start(timeout=300)
    yield gw
    gw.stop()


def _chat(gw: GatewayProcess, **body: Any) -> httpx.Response:
    return httpx.post(gw.url + "/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": "What is the weather in Oslo?"}],
        "max_tokens": 48, "temperature": 0, **body})


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_tool_whose_parameters_use_defs_can_be_constrained(embedded: GatewayProcess, choice: Any) -> None:
    r = _chat(embedded, tools=[TOOL], tool_choice=choice, parallel_tool_calls=False)
    assert r.status_code == 200, r.text
    body = r.json()["choices"][0]
    assert body["finish_reason"] == "tool_calls"
    [call] = body["message"]["tool_calls"]
    jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS)


def test_constrained_tool_calls_accept_defs_and_a_reference_to_the_root(embedded: GatewayProcess) -> None:
    tree = {"type": "function", "function": {"name": "make_tree", "parameters": TREE}}
    r = _chat(embedded, tools=[TOOL, tree], constrain_tool_calls=True, max_tokens=8)
    assert r.status_code == 200, r.text
    named = _chat(embedded, tools=[TOOL, tree], tool_choice={"type": "function", "function": {"name": "make_tree"}},
                  parallel_tool_calls=False)
    assert named.status_code == 200, named.text
    choice = named.json()["choices"][0]
    if choice["finish_reason"] == "tool_calls":  # a deep tree may run past max_tokens
        jsonschema.validate(json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]), TREE)


def test_the_same_schema_works_as_a_response_format(embedded: GatewayProcess) -> None:
    r = _chat(embedded, response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": PARAMETERS}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), PARAMETERS)
