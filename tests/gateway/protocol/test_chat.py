import pytest

from gateway.errors import APIError
from gateway.protocol.chat import ChunkAccumulator, ChunkRelay, validate_chat_request

OK = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_valid_request_keeps_unknown_fields() -> None:
    parsed = validate_chat_request({**OK, "logit_bias": {"1": 2}, "stream": True})
    assert parsed.stream and parsed.model == "m"


TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = {"role": "assistant", "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]}


@pytest.mark.parametrize("body, param, code", [
    ({"model": "m"}, "messages", "missing_required_parameter"),
    ({**OK, "messages": []}, "messages", "invalid_value"),
    ({**OK, "messages": "hi"}, "messages", "invalid_type"),
    ({**OK, "temperature": "hot"}, "temperature", "invalid_type"),
    ({**OK, "temperature": "1"}, "temperature", "invalid_type"),
    ({**OK, "n": 0}, "n", "invalid_value"),
    ({**OK, "n": 1.5}, "n", "invalid_type"),
    ({**OK, "stream": "yes"}, "stream", "invalid_type"),
    ({**OK, "stream": 1}, "stream", "invalid_type"),
    ({**OK, "max_tokens": "10"}, "max_tokens", "invalid_type"),
    ({**OK, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({**OK, "messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
    ({**OK, "messages": [{"role": "user", "content": [{"type": "video", "video": "x"}]}]},
     "messages[0].content[0].type", "invalid_value"),
    ({**OK, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0].text", "missing_required_parameter"),
    ({**OK, "messages": [{"role": "user", "content": [{"text": "x"}]}]},
     "messages[0].content[0].type", "missing_required_parameter"),
    ({**OK, "messages": [{"role": "user", "content": "x"}, CALL, {"role": "tool", "content": "3"}]},
     "messages[2].tool_call_id", "missing_required_parameter"),
    ({**OK, "messages": [{"role": "user", "content": "x"}, CALL]}, "messages[1].role", "invalid_value"),
    ({**OK, "messages": [{"role": "user", "content": "x"}, CALL, {"role": "user", "content": "y"}]},
     "messages[1].role", "invalid_value"),
    ({**OK, "messages": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c9", "content": "3"}]},
     "messages[1].role", "invalid_value"),
    ({**OK, "messages": [{"role": "user", "content": "x"}, {**CALL, "tool_calls": [{"id": "c1"}]}]},
     "messages[1].tool_calls[0].type", "missing_required_parameter"),
    ({**OK, "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name",
     "invalid_value"),
    ({**OK, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools[0].function.parameters", "invalid_value"),
    ({**OK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}},
     "tool_choice.function.name", "invalid_value"),
    ({**OK, "tools": TOOLS, "tool_choice": "always"}, "tool_choice", "invalid_value"),
    ({**OK, "tool_choice": "required"}, "tool_choice", "invalid_value"),
    ({**OK, "response_format": {"type": "yaml"}}, "response_format.type", "invalid_value"),
    ({**OK, "response_format": {"type": "json_schema"}}, "response_format.json_schema", "missing_required_parameter"),
    ({**OK, "stop": ["a", "b", "c", "d", "e"]}, "stop", "invalid_value"),
])
def test_invalid_requests_name_the_field(body: dict, param: str, code: str) -> None:
    with pytest.raises(APIError) as exc:
        validate_chat_request(body)
    assert exc.value.status_code == 400
    assert (exc.value.param, exc.value.code) == (param, code), exc.value.message
    assert exc.value.body()["error"]["type"] == "invalid_request_error"


def test_a_coerced_type_is_named_as_openai_names_it() -> None:
    with pytest.raises(APIError) as exc:
        validate_chat_request({**OK, "stream": "yes"})
    assert exc.value.message == "Invalid type for 'stream': expected a boolean, but got a string instead."


def test_a_paired_history_and_a_named_tool_pass() -> None:
    body = {**OK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}},
            "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}, CALL,
                         {"role": "tool", "tool_call_id": "c1", "content": "3"},
                         {"role": "assistant", "content": "3"}, {"role": "user", "content": "thanks"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": {}}}}
    assert validate_chat_request(body).tool_choice == {"type": "function", "function": {"name": "add"}}


def test_non_object_body() -> None:
    with pytest.raises(APIError, match="JSON object"):
        validate_chat_request([1, 2])


def test_accumulator_rebuilds_text_and_tool_calls() -> None:
    acc = ChunkAccumulator()
    base = {"id": "c1", "created": 1, "model": "m", "object": "chat.completion.chunk"}
    acc.add({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
    acc.add({**base, "choices": [{"index": 0, "delta": {"content": "Hel"}}]})
    acc.add({**base, "choices": [{"index": 0, "delta": {"content": "lo"}}]})
    acc.add({**base, "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": ""}}]}}]})
    acc.add({**base, "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": '{"x": '}}]}}]})
    acc.add({**base, "choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": "1}"}}]}, "finish_reason": "tool_calls"}]})
    acc.add({**base, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}})
    out = acc.completion()
    assert out["id"] == "c1" and out["usage"]["total_tokens"] == 7
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Hello"
    assert choice["message"]["tool_calls"] == [
        {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]


def test_time_to_first_token_counts_generated_output_only() -> None:
    from gateway.protocol.chat import carries_output

    def chunk(delta: dict, **choice: object) -> dict:
        return {"choices": [{"index": 0, "delta": delta, **choice}]}

    assert not carries_output(chunk({"role": "assistant", "content": ""}))
    assert not carries_output(chunk({}, finish_reason="stop")) and not carries_output({"choices": [], "usage": {}})
    assert carries_output(chunk({"content": "Hi"})) and carries_output(chunk({"reasoning_content": "hm"}))
    assert carries_output(chunk({"tool_calls": [{"index": 0, "function": {"name": "f"}}]}))


# -- ChunkRelay: which chunks of a stream go out at once and which wait ----------------------------------------

def _chunk(delta: dict | None = None, finish: str | None = None, usage: dict | None = None) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": choices,
            **({"usage": usage} if usage else {})}


def test_the_finishing_chunk_and_what_follows_wait_for_the_commit() -> None:
    relay = ChunkRelay(1, guarded=False, include_usage=False)
    sent = [relay.feed(c) for c in (_chunk({"role": "assistant", "content": ""}), _chunk({"content": "Hi"}),
                                    _chunk({}, "stop"), _chunk(None, usage={"prompt_tokens": 3}))]
    assert [s is not None for s in sent] == [True, True, False, False]
    assert relay.held == [_chunk({}, "stop")]  # the usage chunk is not for a client that did not ask
    assert relay.acc.completion()["usage"] == {"prompt_tokens": 3}
    asked = ChunkRelay(1, guarded=False, include_usage=True)
    for c in (_chunk({"content": "Hi"}, "stop"), _chunk(None, usage={"prompt_tokens": 3})):
        asked.feed(c)
    assert len(asked.held) == 2


def test_guarded_tool_call_parts_wait_for_the_guard_and_text_streams() -> None:
    relay = ChunkRelay(1, guarded=True, include_usage=False)
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "add", "arguments": ""}}
    assert relay.feed(_chunk({"content": "Adding."})) == _chunk({"content": "Adding."})
    assert relay.feed(_chunk({"tool_calls": [call]})) is None
    assert relay.feed(_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]})) is None
    assert relay.feed(_chunk({}, "tool_calls")) is None
    assert len(relay.call_parts) == 2 and relay.held == [_chunk({}, "tool_calls")]
    relay.release_calls(None)  # checked and passed: the parts as the backend sent them, before the finish
    assert [c["choices"][0]["delta"].get("tool_calls") is not None for c in relay.held] == [True, True, False]

    retried = ChunkRelay(1, guarded=True, include_usage=False)
    retried.feed(_chunk({"tool_calls": [call]}))
    retried.feed(_chunk({}, "tool_calls"))
    whole = [{"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]
    retried.release_calls(whole)  # a retry's calls, whole, in one chunk framed like the stream's
    first = retried.held[0]
    assert first["id"] == "c" and first["choices"][0]["delta"]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'
