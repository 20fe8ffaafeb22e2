"""The Anthropic Messages API <-> chat completions translation (pure): requests, answers, streams both ways,
errors, sessions and side requests. Every Message and event the gateway makes is also checked against the
``anthropic`` SDK's own types."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from anthropic.types import ErrorResponse, Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from gateway.errors import APIError
from gateway.protocol.anthropic import (
    MessageAccumulator,
    MessageStream,
    chat_to_message,
    error_body,
    error_type_for,
    estimate_tokens,
    message_to_chat,
    messages_to_chat,
    session_id,
    side_request_kind,
    validate_messages_request,
)
from gateway.protocol.sse import encode_named_event, parse_events

EVENT = TypeAdapter(RawMessageStreamEvent)
WRITE = {"name": "write_file", "description": "Write a file.",
         "input_schema": {"type": "object", "properties": {"path": {"type": "string"}, "text": {"type": "string"}},
                          "required": ["path", "text"]}}


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None,
          usage: dict[str, Any] | None = None) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"id": "c1", "object": "chat.completion.chunk", "choices": choices, "usage": usage}


def streamed(chunks: list[dict[str, Any]], **kw: Any) -> tuple[MessageStream, list[dict[str, Any]]]:
    stream = MessageStream(message_id="msg_1", model="claude-test", **kw)
    events = stream.start()
    for c in chunks:
        events += stream.feed(c)
    events += stream.finish()
    for event in events:
        if event["type"] != "ping":  # the SDK's event union leaves pings out (its stream skips them)
            EVENT.validate_python(event)
    return stream, events


# -- requests: Messages -> chat ---------------------------------------------------------------------------------

def test_text_and_system_prompts_as_a_string_or_blocks() -> None:
    for system in ("Be brief.", [{"type": "text", "text": "Be", "cache_control": {"type": "ephemeral"}},
                                 {"type": "text", "text": "brief."}]):
        body = {"model": "claude-x", "max_tokens": 50, "system": system, "temperature": 0.2, "top_p": 0.9,
                "top_k": 5, "stop_sequences": ["END"], "stream": True, "metadata": {"user_id": "u1"},
                "messages": [{"role": "user", "content": "Hi"},
                             {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
                             {"role": "user", "content": [{"type": "text", "text": "Again",
                                                           "cache_control": {"type": "ephemeral"}}]}]}
        out = messages_to_chat(body)
        system_text = "Be brief." if isinstance(system, str) else "Be\nbrief."
        assert out.body == {"model": "claude-x", "max_tokens": 50, "temperature": 0.2, "top_p": 0.9, "top_k": 5,
                            "stop": ["END"], "stream": True, "messages": [
                                {"role": "system", "content": system_text}, {"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again"}]}
        # cache_control is a hint a chat backend does not take: left out, not reported as lost.
        assert out.dropped == []


def test_tools_choices_and_parallel_use() -> None:
    base = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "go"}], "tools": [WRITE]}
    out = messages_to_chat({**base, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}})
    assert out.body["tools"] == [{"type": "function", "function": {
        "name": "write_file", "description": "Write a file.", "parameters": WRITE["input_schema"]}}]
    assert out.body["tool_choice"] == "required" and out.body["parallel_tool_calls"] is False
    assert messages_to_chat({**base, "tool_choice": {"type": "auto"}}).body["tool_choice"] == "auto"
    assert messages_to_chat({**base, "tool_choice": {"type": "none"}}).body["tool_choice"] == "none"
    named = messages_to_chat({**base, "tool_choice": {"type": "tool", "name": "write_file"}}).body
    assert named["tool_choice"] == {"type": "function", "function": {"name": "write_file"}}
    # A server tool has no chat counterpart: dropped and named, the function tools kept.
    served = messages_to_chat({**base, "tools": [WRITE, {"type": "web_search_20250305", "name": "web_search"}]})
    assert [t["function"]["name"] for t in served.body["tools"]] == ["write_file"]
    assert served.dropped == ["tool:web_search_20250305"]


def test_tool_use_and_tool_results_with_errors_and_content_arrays() -> None:
    body = {"model": "m", "max_tokens": 9, "tools": [WRITE], "messages": [
        {"role": "user", "content": "write two files"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Writing."},
            {"type": "tool_use", "id": "toolu_1", "name": "write_file", "input": {"path": "a", "text": "1"}},
            {"type": "tool_use", "id": "toolu_2", "name": "write_file", "input": {"path": "/", "text": "2"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "wrote a"},
                                                                          {"type": "text", "text": "1 byte"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "is a directory", "is_error": True},
            {"type": "text", "text": "and then?"}]}]}
    messages = messages_to_chat(body).body["messages"]
    assert messages[1] == {"role": "assistant", "content": "Writing.", "tool_calls": [
        {"id": "toolu_1", "type": "function", "function": {"name": "write_file",
                                                           "arguments": '{"path":"a","text":"1"}'}},
        {"id": "toolu_2", "type": "function", "function": {"name": "write_file",
                                                           "arguments": '{"path":"/","text":"2"}'}}]}
    # Results answer the calls just before them, ahead of the user's own words.
    assert messages[2:] == [{"role": "tool", "tool_call_id": "toolu_1", "content": "wrote a\n1 byte"},
                            {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: is a directory"},
                            {"role": "user", "content": "and then?"}]


def test_thinking_in_the_history_becomes_reasoning_and_what_chat_cannot_take_is_named() -> None:
    body = {"model": "m", "max_tokens": 9, "thinking": {"type": "enabled", "budget_tokens": 1024},
            "context_management": {"edits": []}, "messages": [
                {"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "add them", "signature": "EqQBCkgIARAB"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "text", "text": "4"}]},
                {"role": "user", "content": [{"type": "text", "text": "sure?"},
                                             {"type": "document", "source": {"type": "text", "data": "x"}}]}]}
    out = messages_to_chat(body)
    assert out.body["messages"][1] == {"role": "assistant", "content": "4", "reasoning_content": "add them"}
    assert out.body["messages"][2] == {"role": "user", "content": "sure?"}
    assert out.dropped == ["field:context_management", "field:thinking", "thinking_signature",
                           "block:redacted_thinking", "block:document"]


def test_images_become_image_parts() -> None:
    body = {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}]}]}
    assert messages_to_chat(body).body["messages"] == [{"role": "user", "content": [
        {"type": "text", "text": "what is it?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}}]}]


# -- answers: chat -> Messages, and an upstream's Message back to chat ----------------------------------------

def test_a_completion_becomes_a_message_with_thinking_text_and_tool_use() -> None:
    completion = {"id": "c", "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "Let me write it.", "reasoning_content": "a file is needed",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "write_file", "arguments": '{"path": "a", "text": "1"}'}}]}}],
        "usage": {"prompt_tokens": 30, "completion_tokens": 12, "prompt_tokens_details": {"cached_tokens": 10}}}
    message = chat_to_message(completion, message_id="msg_1", model="claude-x")
    Message.model_validate(message)
    assert message["content"] == [
        {"type": "thinking", "thinking": "a file is needed", "signature": ""},
        {"type": "text", "text": "Let me write it."},
        {"type": "tool_use", "id": "call_1", "name": "write_file", "input": {"path": "a", "text": "1"}}]
    assert (message["stop_reason"], message["stop_sequence"]) == ("tool_use", None)
    assert message["usage"] == {"input_tokens": 20, "output_tokens": 12, "cache_creation_input_tokens": 0,
                                "cache_read_input_tokens": 10}
    # And back: the record of an upstream's Message is the same chat completion.
    back = message_to_chat(message)
    assert back["choices"][0]["message"] == completion["choices"][0]["message"] | {
        "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "write_file", "arguments": '{"path":"a","text":"1"}'}}]}
    assert back["choices"][0]["finish_reason"] == "tool_calls"
    assert back["usage"]["prompt_tokens"] == 30 and back["usage"]["prompt_tokens_details"]["cached_tokens"] == 10


@pytest.mark.parametrize(("finish", "matched", "stops", "expected"), [
    ("stop", None, None, ("end_turn", None)),
    ("length", None, None, ("max_tokens", None)),
    ("stop", "END", ["END"], ("stop_sequence", "END")),
    ("stop", "</s>", ["END"], ("end_turn", None)),  # the model's own end, not one of the request's sequences
    ("content_filter", None, None, ("refusal", None)),
])
def test_stop_reasons(finish: str, matched: str | None, stops: list[str] | None, expected: tuple) -> None:
    completion = {"choices": [{"index": 0, "finish_reason": finish, "matched_stop": matched,
                               "message": {"role": "assistant", "content": "x"}}]}
    message = chat_to_message(completion, message_id="m", model="m", stop_sequences=stops)
    assert (message["stop_reason"], message["stop_sequence"]) == expected


def test_an_empty_completion_is_still_a_valid_message() -> None:
    message = chat_to_message({"choices": [{"index": 0, "finish_reason": "stop",
                                            "message": {"role": "assistant", "content": None}}]},
                              message_id="m", model="m")
    Message.model_validate(message)
    assert message["content"] == [{"type": "text", "text": ""}]


# -- streams: chat chunks -> Anthropic events -----------------------------------------------------------------

def test_a_streamed_text_answer_is_anthropics_event_sequence() -> None:
    stream, events = streamed([chunk({"role": "assistant", "content": ""}), chunk({"content": "Hel"}),
                               chunk({"content": "lo"}), chunk({}, "stop"),
                               chunk(None, usage={"prompt_tokens": 7, "completion_tokens": 2})])
    assert [e["type"] for e in events] == ["message_start", "ping", "content_block_start", "content_block_delta",
                                           "content_block_delta", "content_block_stop", "message_delta",
                                           "message_stop"]
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == "Hello"
    delta = events[-2]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 2 and delta["usage"]["input_tokens"] == 7
    Message.model_validate(stream.message)
    assert stream.message["content"] == [{"type": "text", "text": "Hello"}]


def test_streamed_tool_calls_become_input_json_deltas_one_block_each() -> None:
    args_a, args_b = '{"path": "a", "text": "1"}', '{"path": "b", "text": "2"}'
    chunks = [chunk({"content": "Writing."})]
    for index, (cid, args) in enumerate((("call_a", args_a), ("call_b", args_b))):
        chunks.append(chunk({"tool_calls": [{"index": index, "id": cid, "type": "function",
                                             "function": {"name": "write_file", "arguments": ""}}]}))
        chunks += [chunk({"tool_calls": [{"index": index, "function": {"arguments": args[i:i + 5]}}]})
                   for i in range(0, len(args), 5)]
    chunks.append(chunk({}, "tool_calls"))
    stream, events = streamed(chunks)
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [(e["index"], e["content_block"]["type"]) for e in starts] == [(0, "text"), (1, "tool_use"),
                                                                          (2, "tool_use")]
    assert starts[1]["content_block"] == {"type": "tool_use", "id": "call_a", "name": "write_file", "input": {}}
    for index, args in ((1, args_a), (2, args_b)):
        parts = [e["delta"] for e in events if e["type"] == "content_block_delta" and e["index"] == index]
        assert all(p["type"] == "input_json_delta" for p in parts) and len(parts) == 6
        assert "".join(p["partial_json"] for p in parts) == args
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1, 2]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    assert [b.get("input") for b in stream.message["content"]] == [None, json.loads(args_a), json.loads(args_b)]


def test_streamed_reasoning_becomes_a_thinking_block_before_the_text() -> None:
    _, events = streamed([chunk({"reasoning_content": "think"}), chunk({"reasoning_content": "ing"}),
                          chunk({"content": "4"}), chunk({}, "stop")])
    blocks = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert blocks == ["thinking", "text"]
    thinking = [e["delta"] for e in events if e["type"] == "content_block_delta" and e["index"] == 0]
    assert thinking == [{"type": "thinking_delta", "thinking": "think"}, {"type": "thinking_delta",
                                                                          "thinking": "ing"}]


def test_a_stream_error_is_an_error_event() -> None:
    stream = MessageStream(message_id="m", model="m")
    [event] = stream.error("overloaded_error", "try later")
    ErrorResponse.model_validate(event)
    assert event == {"type": "error", "error": {"type": "overloaded_error", "message": "try later"}}


# -- an Anthropic upstream's stream read while passed on ------------------------------------------------------

UPSTREAM_EVENTS = [
    {"type": "message_start", "message": {"id": "msg_u", "type": "message", "role": "assistant", "model": "claude-u",
                                          "content": [], "stop_reason": None, "stop_sequence": None,
                                          "usage": {"input_tokens": 12, "output_tokens": 1}}},
    {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "",
                                                                  "signature": ""}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "hmm"}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "EqQBCkgIAR=="}},
    {"type": "content_block_stop", "index": 0},
    {"type": "content_block_start", "index": 1, "content_block": {"type": "future_block", "payload": [1, 2]}},
    {"type": "content_block_delta", "index": 1, "delta": {"type": "future_delta", "x": 1}},
    {"type": "content_block_stop", "index": 1},
    {"type": "content_block_start", "index": 2, "content_block": {"type": "tool_use", "id": "toolu_1",
                                                                  "name": "write_file", "input": {}}},
    {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": '{"path":'}},
    {"type": "content_block_delta", "index": 2, "delta": {"type": "input_json_delta", "partial_json": ' "a"}'}},
    {"type": "content_block_stop", "index": 2},
    {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
     "usage": {"output_tokens": 40}},
    {"type": "message_stop"},
]


def test_an_upstream_stream_split_anywhere_is_kept_byte_for_byte_and_read_whole() -> None:
    wire = b"".join(encode_named_event(e["type"], e) for e in UPSTREAM_EVENTS) + b": comment\r\n\r\n"
    for size in (1, 7, 64, len(wire)):
        acc, kept, buffer = MessageAccumulator(), [], b""
        for i in range(0, len(wire), size):
            events, buffer = parse_events(buffer + wire[i:i + size])
            for raw, event in events:
                kept.append(raw)
                if event is not None:
                    acc.add(event)
        assert b"".join(kept) == wire and buffer == b""
        message = acc.message
        assert message["content"][0] == {"type": "thinking", "thinking": "hmm", "signature": "EqQBCkgIAR=="}
        assert message["content"][1] == {"type": "future_block", "payload": [1, 2]}
        assert message["content"][2]["input"] == {"path": "a"}
        assert message["stop_reason"] == "tool_use" and message["usage"] == {"input_tokens": 12, "output_tokens": 40}
        recorded = message_to_chat(message)["choices"][0]
        assert recorded["message"]["reasoning_content"] == "hmm" and recorded["finish_reason"] == "tool_calls"


def test_an_upstream_error_event_is_kept() -> None:
    acc = MessageAccumulator()
    acc.add({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
    assert acc.error == {"type": "overloaded_error", "message": "Overloaded"} and acc.message is None


# -- errors, validation, counting ------------------------------------------------------------------------------

def test_errors_in_anthropics_shape() -> None:
    assert error_body(429, "slow down") == {"type": "error", "error": {"type": "rate_limit_error",
                                                                       "message": "slow down"}}
    assert [error_type_for(s) for s in (400, 401, 403, 404, 413, 422, 500, 502, 503, 529)] == [
        "invalid_request_error", "authentication_error", "permission_error", "not_found_error", "request_too_large",
        "invalid_request_error", "api_error", "api_error", "overloaded_error", "overloaded_error"]
    for status in (400, 401, 429, 500, 529):
        ErrorResponse.model_validate(error_body(status, "x"))


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"model": "m", "max_tokens": 5, "messages": []}, "messages"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "bot", "content": "x"}]}, "messages.0.role"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"text": "x"}]}]},
     "messages.0.content.0.type"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": "{}"}]}]}, "messages.0.content.0.input"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool"}},
     "tool_choice.name"),
    ({"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "temperature": 3},
     "temperature"),
])
def test_what_the_gateway_cannot_read_is_a_400_naming_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as info:
        validate_messages_request(body)
    assert info.value.status_code == 400 and info.value.param == param


def test_unknown_fields_and_blocks_are_never_errors() -> None:
    validate_messages_request({"model": "m", "max_tokens": 5, "brand_new_field": {"a": 1}, "tools": [
        {"type": "brand_new_tool_2027", "config": {}}], "messages": [{"role": "user", "content": [
            {"type": "brand_new_block", "anything": True}]}]})
    validate_messages_request({"model": "m", "messages": [{"role": "user", "content": "x"}]}, counting=True)


def test_the_estimate_grows_with_the_request() -> None:
    small = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    large = {**small, "system": "x" * 400, "tools": [WRITE]}
    assert 1 <= estimate_tokens(small) < estimate_tokens(large)
    assert estimate_tokens(large) >= 100 + len(orjson.dumps([WRITE])) // 4


# -- Claude Code's habits ----------------------------------------------------------------------------------------

def test_the_session_comes_from_the_header_or_metadata_in_either_release_shape() -> None:
    sid = "4f1c0c56-0000-4000-8000-000000000001"
    v2 = {"metadata": {"user_id": json.dumps({"device_id": "d", "account_uuid": "", "session_id": sid})}}
    v1 = {"metadata": {"user_id": f"user_abc_account__session_{sid}"}}
    assert session_id(v2, {}) == sid and session_id(v1, {}) == sid
    assert session_id(v1, {"x-claude-code-session-id": "from-header"}) == "from-header"
    assert session_id({"metadata": {"user_id": "someone"}}, {}) is None
    assert session_id({"metadata": {"user_id": "{not json"}}, {}) is None
    assert session_id({}, {}) is None


def test_side_requests_are_recognised_and_turns_are_not() -> None:
    turn = {"model": "m", "max_tokens": 9, "system": "You are Claude Code.", "tools": [WRITE],
            "messages": [{"role": "user", "content": "fix the bug"}]}
    assert side_request_kind(turn) is None
    title = {"model": "m", "max_tokens": 9, "system": "Generate a concise title.", "messages": [
        {"role": "user", "content": "fix the bug"}], "output_format": {"type": "json_schema", "schema": {
            "type": "object", "properties": {"title": {"type": "string"}}}}}
    assert side_request_kind(title) == "title"
    topic = {**turn, "tools": None, "system": "Analyze if this message indicates a new conversation topic."}
    assert side_request_kind(topic) == "topic"
    quota = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "quota"}]}
    assert side_request_kind(quota) == "quota"
    summary = {**turn, "messages": [*turn["messages"], {"role": "user", "content": [
        {"type": "text", "text": "Your task is to create a detailed summary of the conversation so far."}]}]}
    assert side_request_kind(summary) == "summary"


def test_a_tool_less_turn_whose_system_prompt_mentions_titles_is_a_turn() -> None:
    turn = {"model": "m", "max_tokens": 9, "system": "Use sentence case for titles and headings.",
            "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    assert side_request_kind(turn) is None
    structured = {**turn, "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}
    assert side_request_kind(structured) == "side"
