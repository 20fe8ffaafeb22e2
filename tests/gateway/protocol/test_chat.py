import pytest

from gateway.errors import APIError
from gateway.protocol.chat import ChunkAccumulator, validate_chat_request

OK = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_valid_request_keeps_unknown_fields() -> None:
    parsed = validate_chat_request({**OK, "logit_bias": {"1": 2}, "stream": True})
    assert parsed.stream and parsed.model == "m"


@pytest.mark.parametrize("body, param, status", [
    ({"model": "m"}, "messages", 400),
    ({**OK, "messages": []}, "messages", 400),
    ({**OK, "messages": "hi"}, "messages", 400),
    ({**OK, "temperature": "hot"}, "temperature", 400),
    ({**OK, "n": 0}, "n", 400),
    ({**OK, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role", 400),
    ({**OK, "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name", 400),
    ({**OK, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools.0.function.parameters", 400),
    ({**OK, "stop": ["a", "b", "c", "d", "e"]}, "stop", 400),
])
def test_invalid_requests_name_the_field(body: dict, param: str, status: int) -> None:
    with pytest.raises(APIError) as exc:
        validate_chat_request(body)
    assert exc.value.status_code == status
    assert exc.value.param == param
    assert exc.value.body()["error"]["type"] == "invalid_request_error"


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
