import json

import pytest

from gateway.agent.parsing import (
    ToolCallStreamFilter,
    parse_tool_calls,
    partial_suffix_length,
)


def test_single_block_becomes_an_openai_tool_call() -> None:
    out = parse_tool_calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    assert out.content is None
    [call] = out.tool_calls
    assert call["type"] == "function"
    assert call["id"].startswith("call_") and len(call["id"]) > len("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert out.calls[0].repaired is False


def test_several_blocks_and_prose_around_them() -> None:
    text = ('Let me check.\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>')
    out = parse_tool_calls(text)
    assert [c["function"]["name"] for c in out.tool_calls] == ["a", "b"]
    assert out.content == "Let me check.\n\n"
    assert len({c["id"] for c in out.tool_calls}) == 2


def test_unterminated_final_block_is_parsed() -> None:
    out = parse_tool_calls('<tool_call>\n{"name": "search", "arguments": {"q": "cats"}}')
    assert out.tool_calls[0]["function"]["name"] == "search"
    assert json.loads(out.tool_calls[0]["function"]["arguments"]) == {"q": "cats"}


@pytest.mark.parametrize("body", [
    '{"name": "f", "arguments": {"a": 1}}}',  # stray brace
    "{'name': 'f', 'arguments': {'a': 1}}",  # python quoting
    '{"name": "f", "arguments": {"a": 1}',  # missing brace
])
def test_small_json_faults_are_repaired_and_flagged(body: str) -> None:
    out = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert out.calls[0].repaired is True
    assert json.loads(out.calls[0].arguments) == {"a": 1}
    assert out.calls[0].raw == body


def test_arguments_given_as_a_json_string_are_decoded() -> None:
    out = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 2}"}</tool_call>')
    assert json.loads(out.calls[0].arguments) == {"a": 2}
    assert out.calls[0].repaired is False


def test_missing_arguments_mean_an_empty_object() -> None:
    out = parse_tool_calls('<tool_call>{"name": "now"}</tool_call>')
    assert out.calls[0].arguments == "{}"


@pytest.mark.parametrize("text", [
    "I would call get_weather with city Paris.",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',  # JSON outside a block is not a call
    "",
])
def test_prose_is_never_turned_into_a_call(text: str) -> None:
    out = parse_tool_calls(text)
    assert out.calls == [] and out.invalid == []
    assert out.content == (text or None)


@pytest.mark.parametrize("block", [
    "<tool_call>I am not JSON at all</tool_call>",
    '<tool_call>{"arguments": {"a": 1}}</tool_call>',  # no name
    "<tool_call></tool_call>",
])
def test_unusable_blocks_stay_content(block: str) -> None:
    out = parse_tool_calls(f"before {block} after")
    assert out.calls == []
    assert out.invalid == [block]
    assert out.content == f"before {block} after"


def test_partial_suffix_length() -> None:
    assert partial_suffix_length("hello <tool", ["<tool_call>"]) == len("<tool")
    assert partial_suffix_length("hello <", ["<tool_call>"]) == 1
    assert partial_suffix_length("hello", ["<tool_call>"]) == 0
    assert partial_suffix_length("a <tool_call>", ["<tool_call>"]) == 0  # a whole marker is not partial
    assert partial_suffix_length("xEN", ["END", "E"]) == 2


def _stream(pieces: list[str]) -> tuple[list[str], str, object]:
    f = ToolCallStreamFilter()
    released = [f.feed(p) for p in pieces]
    tail, parsed = f.finish()
    return released, tail, parsed


def test_stream_filter_never_releases_markup() -> None:
    text = 'Sure.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    released, tail, parsed = _stream(list(text))  # one character at a time
    assert "".join(released) + tail == parsed.content == "Sure.\n"
    assert "<" not in "".join(released)
    assert parsed.tool_calls[0]["function"]["name"] == "f"


def test_stream_filter_releases_plain_text_and_lookalikes() -> None:
    text = "a < b and <tool is not a call"
    released, tail, parsed = _stream([text[i:i + 3] for i in range(0, len(text), 3)])
    assert "".join(released) + tail == text == parsed.content
    assert parsed.calls == []


def test_stream_filter_drops_leading_whitespace_before_a_call() -> None:
    released, tail, parsed = _stream(["\n", " ", '<tool_call>{"name": "f"}</tool_call>'])
    assert released == ["", "", ""] and tail == ""
    assert parsed.content is None


def test_stream_filter_owes_text_after_the_blocks() -> None:
    released, tail, parsed = _stream(["Hi ", '<tool_call>{"name": "f"}</tool_call>', " bye"])
    assert "".join(released) == "Hi "
    assert tail == " bye"
    assert parsed.content == "Hi  bye"
