"""What the embedded engine honours, on the tiny random Llama: grammar-constrained output, OpenAI's logprobs with the
sampled and the model's own log-probabilities, stops at the end of the calls, and a 400 for what it cannot do."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tests.extras import skip_without

skip_without("local")

import jsonschema
import torch
from transformers import PreTrainedTokenizerBase

from gateway.backends.base import BackendError, ChatRequest
from gateway.backends.local import LocalBackend, grammar
from gateway.backends.local.grammar import matcher, output_grammar, tokenizer_for
from gateway.backends.local.loading import load_model
from gateway.backends.local.sampling import SamplingParams, shape_logits
from gateway.prompting import encode_prompt
from tests.gateway.backends.conftest import script

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["ok", "colour", "count"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1,
                                                                             "maximum": 3}},
    "required": ["unit", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"], "additionalProperties": False}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"unit": "c", "days": 2}}\n</tool_call>'


def _req(**body: Any) -> ChatRequest:
    return ChatRequest(body={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60, **body}, model="tiny")


def _schema_of(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"]["parameters"]


async def test_a_json_schema_holds_the_random_model_to_valid_json(backend: LocalBackend) -> None:
    result = await backend.chat(_req(n=6, temperature=1.0, seed=7, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}))
    for choice in result.response["choices"]:
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)
        assert choice["finish_reason"] == "stop"  # the grammar completed: nothing but the end could follow
    free = await backend.chat(_req(n=6, temperature=1.0, seed=7, max_tokens=20))
    assert not any(_is_json(c["message"]["content"]) for c in free.response["choices"])  # the mask did it


async def test_json_object_gives_an_object(backend: LocalBackend) -> None:
    result = await backend.chat(_req(temperature=1.0, seed=1, max_tokens=200, response_format={"type": "json_object"},
                                     logit_bias={"0": -100}))
    choice = result.response["choices"][0]
    if choice["finish_reason"] == "stop":  # a random model may ramble past max_tokens inside a string
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    assert choice["message"]["content"].startswith("{")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
async def test_a_required_or_named_tool_choice_always_gets_a_valid_call(backend: LocalBackend,
                                                                         tool_choice: Any) -> None:
    result = await backend.chat(_req(n=4, temperature=1.0, seed=3, tools=[WEATHER, CLOCK], tool_choice=tool_choice,
                                     parallel_tool_calls=False))
    tools = {t["function"]["name"]: t for t in (WEATHER, CLOCK)}
    for choice in result.response["choices"]:
        assert choice["finish_reason"] == "tool_calls"
        [call] = choice["message"]["tool_calls"]
        name = call["function"]["name"]
        assert name in tools and (tool_choice == "required" or name == "get_time")
        jsonschema.validate(json.loads(call["function"]["arguments"]), _schema_of(tools[name]))


def test_checked_calls_leave_text_free_but_hold_an_opened_call_to_a_tool(smol_tokenizer: PreTrainedTokenizerBase
                                                                         ) -> None:
    tokens = tokenizer_for(smol_tokenizer, len(smol_tokenizer), frozenset({smol_tokenizer.eos_token_id}))
    grammar = output_grammar(answer=None, tools=[WEATHER, CLOCK], calls="checked", parallel=True)

    def accepted(text: str) -> bool:
        m = matcher(tokens, grammar)
        return all(m.consume_token(t) for t in smol_tokenizer.encode(text, add_special_tokens=False))

    assert accepted("Just an answer, no call.")
    assert accepted("Let me look.\n" + CALL)
    assert not accepted('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"unit": "k"')
    assert not accepted('<tool_call>\n{"name": "send_mail"')
    assert output_grammar(answer=None, tools=[WEATHER], calls="free", parallel=True) is None


async def test_generation_ends_after_the_last_call_and_keeps_its_closing_tag(
        backend: LocalBackend, smol_tokenizer: PreTrainedTokenizerBase) -> None:
    def ids(text: str) -> list[int]:
        return smol_tokenizer.encode(text, add_special_tokens=False)

    chatter = " Then I will tell you all about the weather in great detail."
    script(backend, ids(CALL + "\n" + CALL + chatter) + [smol_tokenizer.eos_token_id])
    both = await backend.chat(_req(tools=[WEATHER], max_tokens=200))
    choice = both.response["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and len(choice["message"]["tool_calls"]) == 2
    assert choice["message"]["content"] is None  # the chatter after the calls was never generated
    # Generated up to the token that showed the calls were over (its text is not part of the reply).
    assert both.extras.completion_token_ids[0] == ids(CALL + "\n" + CALL + chatter)[:len(ids(CALL + "\n" + CALL)) + 1]
    script(backend, ids(CALL + "\n" + CALL + chatter) + [smol_tokenizer.eos_token_id])
    first = await backend.chat(_req(tools=[WEATHER], parallel_tool_calls=False, max_tokens=200))
    assert len(first.response["choices"][0]["message"]["tool_calls"]) == 1
    assert first.extras.completion_token_ids[0] == ids(CALL)
    # A stop string ends it too; the call it cut off still parses.
    script(backend, ids(CALL + chatter) + [smol_tokenizer.eos_token_id])
    stopped = await backend.chat(_req(tools=[WEATHER], stop=["\n</tool_call>"], max_tokens=200))
    assert [c["function"]["name"] for c in stopped.response["choices"][0]["message"]["tool_calls"]] == ["get_weather"]


async def test_logprobs_have_openais_shape_and_both_log_probabilities_are_faithful(
        backend: LocalBackend, tiny_model_dir: Path, smol_tokenizer: PreTrainedTokenizerBase) -> None:
    temperature = 0.7
    result = await backend.chat(_req(temperature=temperature, seed=11, max_tokens=12, logprobs=True, top_logprobs=3))
    extras = result.extras
    [ids], [model_lp], [sampled_lp] = (extras.completion_token_ids, extras.completion_logprobs,
                                       extras.completion_sampled_logprobs)
    content = result.response["choices"][0]["logprobs"]["content"]
    assert len(content) == len(ids) == 12
    for entry, token, lp in zip(content, ids, model_lp, strict=True):
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"} and entry["logprob"] == lp
        assert bytes(entry["bytes"]).decode("utf-8", "replace") == entry["token"]
        assert smol_tokenizer.decode([token]) in (entry["token"], entry["token"].strip())
        assert len(entry["top_logprobs"]) == 3 and entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6
    # Recomputed with one forward pass over prompt and completion: the model's own log-probabilities, and those of
    # the distribution the tokens were drawn from (here: at the request's temperature).
    model = load_model(str(tiny_model_dir)).model
    prompt = encode_prompt(smol_tokenizer, [{"role": "user", "content": "hi"}])
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
    target = torch.tensor(ids)[:, None]
    at_one = torch.log_softmax(logits, -1).gather(1, target)[:, 0]
    at_temperature = torch.log_softmax(logits / temperature, -1).gather(1, target)[:, 0]
    assert torch.allclose(at_one, torch.tensor(model_lp), atol=1e-4)
    assert torch.allclose(at_temperature, torch.tensor(sampled_lp), atol=1e-4)
    assert not torch.allclose(at_one, at_temperature, atol=1e-3)
    plain = await backend.chat(_req(temperature=0, max_tokens=4))
    assert plain.response["choices"][0]["logprobs"] is None
    assert plain.extras.completion_sampled_logprobs == [[0.0] * 4]  # greedy: the chosen token was certain


async def test_streamed_logprobs_cover_every_token_once(backend: LocalBackend) -> None:
    stream = await backend.stream(_req(temperature=1.0, seed=5, max_tokens=10, logprobs=True))
    chunks = [c async for c in stream]
    entries = [e for c in chunks for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    assert [e["logprob"] for e in entries] == stream.extras.completion_logprobs[0]
    assert len(entries) == 10


@pytest.mark.parametrize(("body", "param"), [
    ({"audio": {"voice": "alloy"}}, "audio"),
    ({"reasoning_effort": "high"}, "reasoning_effort"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"top_k": 5}, "top_k"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "dependentSchemas": {"a": {}}}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "dependentSchemas": {"a": {}}}}}], "tool_choice": "required"}, "tools"),
    ({"tool_choice": "sometimes", "tools": [WEATHER]}, "tool_choice"),
    ({"constrain_tool_calls": "yes"}, "constrain_tool_calls"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
])
async def test_what_the_engine_cannot_honour_is_a_400_naming_it(backend: LocalBackend, body: dict[str, Any],
                                                                 param: str) -> None:
    with pytest.raises(BackendError) as caught:
        await backend.chat(_req(**body))
    assert caught.value.status_code == 400 and caught.value.param == param
    if param.startswith("response_format.json_schema") or param == "tools":
        assert "dependentSchemas" in caught.value.message


async def test_penalties_and_logit_bias_change_what_is_sampled(backend: LocalBackend) -> None:
    plain = await backend.chat(_req(temperature=0, max_tokens=6))
    first = plain.extras.completion_token_ids[0][0]
    banned = await backend.chat(_req(temperature=0, max_tokens=6, logit_bias={str(first): -100}))
    assert banned.extras.completion_token_ids[0][0] != first
    # A strong bias makes greedy decoding repeat one token; penalties wear it down as it repeats.
    pushed = {"logit_bias": {"42": 20}}
    repeated = (await backend.chat(_req(temperature=0, max_tokens=24, **pushed))).extras.completion_token_ids[0]
    assert repeated == [42] * 24
    penalised = await backend.chat(_req(temperature=0, max_tokens=24, frequency_penalty=2.0, presence_penalty=2.0,
                                        **pushed))
    worn = penalised.extras.completion_token_ids[0]
    assert worn[0] == 42 and worn != repeated


def test_penalties_count_what_was_generated() -> None:
    params = SamplingParams(frequency_penalty=1.5, presence_penalty=0.5, logit_bias=((3, 4.0),))
    shaped = shape_logits(torch.zeros(8), params, [5, 5, 7])
    assert shaped.tolist() == [0.0, 0.0, 0.0, 4.0, 0.0, -3.5, 0.0, -2.0]


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True



# -- grammars that fail, and what a grammar may cost (issue 40, findings 6-8) ------------------------------------

FAILING = {
    "recursive": {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}},
                                                       "required": ["next"]}}},
    "cycle": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
    "exploding_pattern": {"type": "string", "pattern": "^(a{1000}){1000}$"},
}
# Fails only once ``x`` is written: the lexer of ``y``'s pattern runs past its bounds.
FAILS_LATER = {"type": "object", "properties": {"x": {"type": "boolean"},
                                                "y": {"type": "string", "pattern": "^(a{1000}){1000}$"}},
               "required": ["x", "y"], "additionalProperties": False}
DEFS = {"type": "object", "properties": {"c": {"$ref": "#/$defs/c"}, "u": {"$ref": "#/definitions/u"}},
        "required": ["c", "u"], "$defs": {"c": {"enum": ["x", "y"]}}, "definitions": {"u": {"type": "integer"}}}


def _answer(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}


@pytest.mark.parametrize("name", sorted(FAILING))
async def test_a_grammar_that_fails_before_any_output_matches_is_a_400(backend: LocalBackend, name: str) -> None:
    with pytest.raises(BackendError) as caught:
        await backend.chat(_req(response_format=_answer(FAILING[name])))
    assert caught.value.status_code == 400 and caught.value.code == "unsupported_schema"
    assert caught.value.param == "response_format.json_schema.schema"


async def test_a_grammar_failing_mid_way_ends_its_sequence_alone_with_an_error_finish(backend: LocalBackend) -> None:
    failing, plain = await asyncio.gather(backend.chat(_req(response_format=_answer(FAILS_LATER), temperature=1.0)),
                                          backend.chat(_req(max_tokens=12, temperature=0)))
    choice = failing.response["choices"][0]
    assert choice["finish_reason"] == "error" and choice["message"]["content"].startswith('{"x": ')
    assert plain.response["choices"][0]["finish_reason"] == "length"
    assert len(plain.extras.completion_token_ids[0]) == 12
    stream = await backend.stream(_req(response_format=_answer(FAILS_LATER), temperature=1.0))
    reasons = [c["finish_reason"] async for chunk in stream for c in chunk["choices"] if c["finish_reason"]]
    assert reasons == ["error"]


async def test_a_sequence_whose_masks_cost_too_much_ends_with_an_error_finish(
        backend: LocalBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grammar, "MASK_ALLOWANCE_SECONDS", 0.0)
    monkeypatch.setattr(grammar, "MASK_SECONDS_PER_TOKEN", 0.0)
    costly, plain = await asyncio.gather(backend.chat(_req(n=2, response_format=_answer(SCHEMA))),
                                         backend.chat(_req(max_tokens=6, temperature=0)))
    assert [c["finish_reason"] for c in costly.response["choices"]] == ["error", "error"]
    # The end of turn, the only token its mask leaves a failed sequence.
    assert [len(ids) for ids in costly.extras.completion_token_ids] == [1, 1]
    assert {ids[0] for ids in costly.extras.completion_token_ids} <= backend.loaded.stop_token_ids
    assert plain.response["choices"][0]["finish_reason"] == "length"


async def test_building_a_grammar_past_its_time_bound_is_a_400(smol_tokenizer: PreTrainedTokenizerBase,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = tokenizer_for(smol_tokenizer, len(smol_tokenizer), frozenset({smol_tokenizer.eos_token_id}))
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)},
            "required": [f"p{i}" for i in range(2000)]}
    assert await grammar.compile_grammar(lambda: tokens, 1, answer=wide, tools=None, calls="free", parallel=True)
    monkeypatch.setattr(grammar, "COMPILE_SECONDS", 0.001)
    with pytest.raises(BackendError) as caught:
        await grammar.compile_grammar(lambda: tokens, 1, answer=wide, tools=None, calls="free", parallel=True)
    assert caught.value.code == "unsupported_schema" and "took over" in caught.value.message


@pytest.mark.parametrize(("schema", "named"), [
    ({"type": "string", "pattern": "a" * 1001}, "a pattern of 1001 characters"),
    ({"type": "object", "patternProperties": {"b" * 2000: {}}}, "a pattern of 2000 characters"),
    ({"type": "array", "items": {"type": "string", "minLength": 10**9}}, "minLength 1000000000"),
    ({"type": "array", "minItems": 200_000}, "minItems 200000"),
])
def test_costs_llguidance_does_not_meter_are_refused_up_front(schema: dict[str, Any], named: str) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": schema}}}}]
    for kwargs, param in [({"answer": schema, "tools": None, "calls": "free"}, "response_format.json_schema.schema"),
                          ({"answer": None, "calls": "required", "tools": tools}, "tools"),
                          ({"answer": {"type": "object"}, "calls": "free", "tools": tools}, "tools")]:
        with pytest.raises(BackendError) as caught:
            output_grammar(parallel=True, **kwargs)
        assert caught.value.code == "unsupported_schema" and caught.value.param == param
        assert named in caught.value.message
    # Data is not a schema: a long string under enum or const is no pattern.
    assert output_grammar(answer={"enum": [{"pattern": "a" * 5000}]}, tools=None, calls="free", parallel=True)


def test_tool_parameters_refer_to_their_own_defs_and_root(smol_tokenizer: PreTrainedTokenizerBase) -> None:
    tokens = tokenizer_for(smol_tokenizer, len(smol_tokenizer), frozenset({smol_tokenizer.eos_token_id}))
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    tools = [{"type": "function", "function": {"name": "d", "parameters": DEFS}},
             {"type": "function", "function": {"name": "t", "parameters": tree}}]
    compiled = output_grammar(answer=None, tools=tools, calls="required", parallel=False)

    def accepted(text: str) -> bool:
        m = matcher(tokens, compiled)
        return all(m.consume_token(t) for t in smol_tokenizer.encode(text, add_special_tokens=False))

    call = '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>'
    assert accepted(call % ("d", '{"c": "x", "u": 3}'))
    assert not accepted(call % ("d", '{"c": "z"'))
    assert accepted(call % ("t", '{"kids": [{"kids": [{}]}]}'))
    assert DEFS["properties"]["c"] == {"$ref": "#/$defs/c"}  # the request's own schema is left as it was
