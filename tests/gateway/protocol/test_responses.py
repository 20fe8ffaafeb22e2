"""The Responses API <-> chat completions translation (pure): requests, responses, streams, validation."""

from __future__ import annotations

import copy
import json
from typing import Any

import orjson
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.errors import APIError
from gateway.protocol.chat import ChunkAccumulator, validate_chat_request
from gateway.protocol.responses import (
    ResponseStream,
    ToolEntry,
    ToolMap,
    chat_to_response,
    conversation_messages,
    custom_input,
    failure_code,
    flat_name,
    output_to_chat_messages,
    responses_to_chat,
    validate_responses_request,
)
from gateway.protocol.sse import encode_event, encode_named_event

EVENT = TypeAdapter(ResponseStreamEvent)

PATCH_GRAMMAR = 'start: begin_patch hunk+ end_patch\nbegin_patch: "*** Begin Patch" LF\n'
EXEC = {"type": "function", "name": "exec_command", "description": "Run a command.", "strict": False,
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"],
                       "additionalProperties": False}}
DOCS_NS = {"type": "namespace", "name": "mcp__docs__", "description": "Docs server tools.", "tools": [
    {"type": "function", "name": "search", "description": "Search the docs.", "strict": False,
     "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}},
    {"type": "function", "name": "fetch", "description": "Fetch a page.", "strict": False, "defer_loading": True,
     "parameters": {"type": "object", "properties": {"url": {"type": "string"}}}},
]}
APPLY_PATCH = {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
               "format": {"type": "grammar", "syntax": "lark", "definition": PATCH_GRAMMAR}}
WEB_SEARCH = {"type": "web_search", "external_web_access": False}
CODEX_TOOLS = [EXEC, DOCS_NS, APPLY_PATCH, WEB_SEARCH]


def codex_request(**over: Any) -> dict[str, Any]:
    """Roughly what Codex CLI sends on its second model call of a turn."""
    body = {
        "model": "qwen", "instructions": "You are Codex.", "tools": CODEX_TOOLS, "tool_choice": "auto",
        "parallel_tool_calls": True, "reasoning": {"effort": "medium", "summary": "auto"}, "store": False,
        "stream": True, "include": ["reasoning.encrypted_content"], "prompt_cache_key": "sess-1",
        "client_metadata": {"session_id": "sess-1", "turn_id": "t1"}, "text": {"verbosity": "low"},
        "service_tier": "auto",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: none."}]},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "<environment_context>cwd=/w</environment_context>"},
                {"type": "input_text", "text": "Fix the bug."}]},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "Look first."}],
             "encrypted_content": "gAAAA"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
            {"type": "function_call", "name": "exec_command", "arguments": '{"cmd": "ls"}', "call_id": "call_1"},
            {"type": "function_call", "name": "search", "namespace": "mcp__docs__", "arguments": '{"q": "bug"}',
             "call_id": "call_2"},
            {"type": "function_call_output", "call_id": "call_1", "output": "a.py\nb.py"},
            {"type": "function_call_output", "call_id": "call_2",
             "output": [{"type": "input_text", "text": "no hits"}]},
            {"type": "web_search_call", "id": "ws_1", "status": "completed",
             "action": {"type": "search", "query": "bug"}},
            {"type": "custom_tool_call", "name": "apply_patch", "input": "*** Begin Patch\n*** End Patch",
             "call_id": "call_3"},
            {"type": "custom_tool_call_output", "call_id": "call_3", "output": "Done!"},
            {"type": "item_reference", "id": "msg_old"},
        ],
    }
    body.update(over)
    return body


def assert_calls_answered(messages: list[dict[str, Any]]) -> None:
    """The chat backends' rule: each assistant tool call is followed at once by its result."""
    for i, message in enumerate(messages):
        if message["role"] == "tool":
            j = i
            while messages[j]["role"] == "tool":
                j -= 1
            assert messages[j].get("tool_calls"), f"tool message {i} follows no call"
        for k, call in enumerate(message.get("tool_calls") or ()):
            follower = messages[i + 1 + k]
            assert follower["role"] == "tool" and follower["tool_call_id"] == call["id"]


def to_chat(body: dict[str, Any], history: list[dict[str, Any]] | None = None) -> tuple[dict[str, Any], ToolMap]:
    validate_responses_request(body)
    chat, tool_map = responses_to_chat(body, history)
    validate_chat_request(chat)  # what the gateway's chat path accepts, names and schemas included
    assert_calls_answered(chat["messages"])
    return chat, tool_map


# ------------------------------------------------------------------------------------------ requests


def test_string_input_and_instructions() -> None:
    chat, tool_map = to_chat({"model": "m", "input": "hi", "instructions": "Be brief."})
    assert chat == {"model": "m", "messages": [{"role": "system", "content": "Be brief."},
                                               {"role": "user", "content": "hi"}]}
    assert len(tool_map) == 0 and tool_map.dropped == []


def test_parameters_kept_and_dropped() -> None:
    chat, _ = to_chat(codex_request(max_output_tokens=300, temperature=0.2, top_p=0.9, metadata={"a": "b"},
                                    truncation="auto", user="u1"))
    assert chat["max_tokens"] == 300 and chat["temperature"] == 0.2 and chat["top_p"] == 0.9
    assert chat["parallel_tool_calls"] is True and chat["tool_choice"] == "auto"
    for key in ("reasoning", "store", "include", "prompt_cache_key", "client_metadata", "service_tier",
                "metadata", "truncation", "user", "text", "stream", "instructions", "input",
                "max_output_tokens", "response_format"):
        assert key not in chat


def test_codex_history_becomes_chat_messages() -> None:
    chat, _ = to_chat(codex_request())
    assert chat["messages"] == [
        {"role": "system", "content": "You are Codex."},
        {"role": "system", "content": "Sandbox: none."},
        {"role": "user", "content": "<environment_context>cwd=/w</environment_context>\nFix the bug."},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "exec_command", "arguments": '{"cmd": "ls"}'}},
            {"id": "call_2", "type": "function",
             "function": {"name": "mcp__docs__search", "arguments": '{"q": "bug"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a.py\nb.py"},
        {"role": "tool", "tool_call_id": "call_2", "content": "no hits"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_3", "type": "function",
             "function": {"name": "apply_patch", "arguments": json.dumps({"input": "*** Begin Patch\n*** End Patch"},
                                                                        separators=(",", ":"))}}]},
        {"role": "tool", "tool_call_id": "call_3", "content": "Done!"},
    ]


def test_codex_tools_translated_and_builtins_dropped() -> None:
    chat, tool_map = to_chat(codex_request(tools=[*CODEX_TOOLS, {"type": "local_shell"},
                                                  {"type": "image_generation"}, {"type": "file_search"},
                                                  {"type": "tool_search", "execution": "client"},
                                                  {"type": "something_new"}]))
    names = [t["function"]["name"] for t in chat["tools"]]
    assert names == ["exec_command", "mcp__docs__search", "mcp__docs__fetch", "apply_patch"]
    assert chat["tools"][0] == {"type": "function", "function": {
        "name": "exec_command", "description": "Run a command.", "parameters": EXEC["parameters"], "strict": False}}
    patch = chat["tools"][3]["function"]
    assert patch["parameters"]["required"] == ["input"]
    assert patch["parameters"]["properties"]["input"]["type"] == "string"
    assert patch["description"].startswith("Edit files with a patch.")
    assert "lark" in patch["description"] and PATCH_GRAMMAR in patch["description"]
    assert [t["type"] for t in tool_map.dropped] == ["web_search", "local_shell", "image_generation", "file_search",
                                                     "tool_search", "something_new"]
    assert tool_map.get("exec_command") == ToolEntry("function", "exec_command")
    assert tool_map.get("mcp__docs__search") == ToolEntry("namespace", "search", "mcp__docs__")
    assert tool_map.get("apply_patch") == ToolEntry("custom", "apply_patch")
    assert ToolMap.from_tools(CODEX_TOOLS).entries == tool_map.entries  # rebuilt later, the same names


def test_namespace_names_fit_the_chat_pattern() -> None:
    long_ns = "mcp__" + "x" * 70
    tools = [{"type": "namespace", "name": "web", "description": "", "tools": [
                 {"type": "function", "name": "run"}, {"type": "custom", "name": "sql"}]},
             {"type": "namespace", "name": long_ns, "description": "", "tools": [{"type": "function", "name": "go"}]},
             {"type": "namespace", "name": "my server", "description": "", "tools": [
                 {"type": "function", "name": "do it"}]},
             {"type": "function", "name": "web__run"}]  # collides with the flattened name above
    chat, tool_map = to_chat({"model": "m", "input": "x", "tools": tools})
    names = [t["function"]["name"] for t in chat["tools"]]
    assert names[0] == "web__run" and names[1] == "web__sql" and names[3] == "my_server__do_it"
    assert len(names[2]) <= 64 and names[4] == "web__run_2" and len(set(names)) == 5
    assert tool_map.get(names[1]) == ToolEntry("custom", "sql", "web")
    assert tool_map.get(names[2]) == ToolEntry("namespace", "go", long_ns)
    assert tool_map.get("web__run_2") == ToolEntry("function", "web__run")
    assert flat_name("tool", "mcp__srv__") == "mcp__srv__tool"


def test_additional_tools_item_adds_tools() -> None:
    body = {"model": "m", "input": [{"type": "additional_tools", "role": "developer", "tools": [EXEC]},
                                    {"role": "user", "content": "go"}]}
    chat, tool_map = to_chat(body)
    assert [t["function"]["name"] for t in chat["tools"]] == ["exec_command"]
    assert chat["messages"] == [{"role": "user", "content": "go"}]


def test_outputs_are_moved_next_to_their_calls() -> None:
    body = {"model": "m", "input": [
        {"role": "user", "content": "go"},
        {"type": "function_call", "name": "exec_command", "arguments": "{}", "call_id": "c1"},
        {"type": "function_call", "name": "exec_command", "arguments": "{}", "call_id": "c2"},
        {"type": "function_call_output", "call_id": "c2", "output": "two"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"role": "user", "content": "and?"},
        {"type": "function_call", "name": "exec_command", "arguments": "{}", "call_id": "c3"},
        {"role": "user", "content": "interrupted"},
        {"type": "function_call_output", "call_id": "c3", "output": "late"},
    ]}
    chat, _ = to_chat(body)
    roles = [(m["role"], m.get("tool_call_id"), m.get("content")) for m in chat["messages"]]
    assert roles == [
        ("user", None, "go"), ("assistant", None, None), ("tool", "c1", "one"), ("tool", "c2", "two"),
        ("user", None, "and?"), ("assistant", None, None), ("tool", "c3", "late"), ("user", None, "interrupted"),
    ]


@pytest.mark.parametrize("items, message", [
    ([{"type": "function_call", "name": "exec_command", "arguments": "{}", "call_id": "c1"}],
     "No tool output found for function call c1."),
    ([{"type": "custom_tool_call", "name": "apply_patch", "input": "x", "call_id": "c1"},
      {"role": "user", "content": "never mind"}], "No tool output found for function call c1."),
    ([{"type": "function_call_output", "call_id": "ghost", "output": "orphan"}],
     "No tool call found for function call output with call_id ghost."),
])
def test_a_call_without_its_output_or_an_output_without_its_call_is_a_400(items: list, message: str) -> None:
    """As OpenAI answers: no output is invented for a call, no output dropped for want of its call."""
    with pytest.raises(APIError) as exc:
        to_chat({"model": "m", "input": [{"role": "user", "content": "go"}, *items]})
    assert exc.value.status_code == 400 and exc.value.param == "input" and exc.value.message == message


def test_message_content_parts() -> None:
    body = {"model": "m", "input": [
        {"role": "system", "content": "sys"},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "look"},
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "high"},
            {"type": "input_image", "file_id": "file-1", "detail": "auto"},
            {"type": "input_file", "filename": "a.pdf", "file_data": "..."}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "ok"}, {"type": "refusal", "refusal": "no"}]},
        {"role": "assistant", "content": []},  # nothing in it: dropped
    ]}
    chat, _ = to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "high"}},
            {"type": "text", "text": "[file-1: image not available to this model]"},
            {"type": "text", "text": "[a.pdf: file not available to this model]"}]},
        {"role": "assistant", "content": "ok\nno"},
    ]


def test_tool_output_images_follow_as_user_message() -> None:
    body = {"model": "m", "input": [
        {"role": "user", "content": "show"},
        {"type": "function_call", "name": "view_image", "arguments": '{"path": "a.png"}', "call_id": "c1"},
        {"type": "function_call_output", "call_id": "c1", "output": [
            {"type": "input_text", "text": "here"},
            {"type": "input_image", "image_url": "data:image/png;base64,BBBB"}]},
    ]}
    chat, _ = to_chat(body)
    assert chat["messages"][2] == {"role": "tool", "tool_call_id": "c1", "content": "here"}
    assert chat["messages"][3] == {"role": "user", "content": [
        {"type": "text", "text": "Images returned by the tool calls:"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,BBBB"}}]}


def test_local_shell_and_unknown_items() -> None:
    body = {"model": "m", "input": [
        {"role": "user", "content": "ls"},
        {"type": "local_shell_call", "id": "lsh_1", "call_id": "c1", "status": "completed",
         "action": {"type": "exec", "command": ["ls"], "env": {}, "timeout_ms": None}},
        {"type": "local_shell_call_output", "id": "c1", "output": "a.py"},
        {"type": "computer_call", "call_id": "c9", "action": {"type": "click"}},
        {"type": "mcp_call", "id": "m1", "name": "x", "arguments": "{}", "server_label": "s"},
        {"type": "reasoning", "id": "rs", "summary": []},
    ]}
    chat, _ = to_chat(body)
    assert chat["messages"][1:] == [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "local_shell", "arguments": '{"command":["ls"],"env":{}}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
    ]


@pytest.mark.parametrize("choice, expected", [
    ("auto", "auto"), ("none", "none"), ("required", "required"),
    ({"type": "function", "name": "exec_command"}, {"type": "function", "function": {"name": "exec_command"}}),
    ({"type": "function", "name": "search", "namespace": "mcp__docs__"},
     {"type": "function", "function": {"name": "mcp__docs__search"}}),
    ({"type": "function", "name": "mcp__docs__search"},
     {"type": "function", "function": {"name": "mcp__docs__search"}}),
    ({"type": "custom", "name": "apply_patch"}, {"type": "function", "function": {"name": "apply_patch"}}),
    ({"type": "web_search_preview"}, "auto"),
    ({"type": "mcp", "server_label": "x"}, "auto"),
])
def test_tool_choice_mapping(choice: Any, expected: Any) -> None:
    chat, _ = to_chat(codex_request(tool_choice=choice))
    assert chat["tool_choice"] == expected


def test_a_tool_choice_naming_no_offered_tool_is_a_400() -> None:
    with pytest.raises(APIError) as exc:
        to_chat(codex_request(tool_choice={"type": "function", "name": "nope"}))
    assert (exc.value.status_code, exc.value.param) == (400, "tool_choice")
    assert exc.value.message == "Tool choice 'function' with name 'nope' not found in 'tools' parameter."


def test_allowed_tools_choice_filters_tools() -> None:
    choice = {"type": "allowed_tools", "mode": "required",
              "tools": [{"type": "function", "name": "exec_command"}, {"type": "custom", "name": "apply_patch"},
                        {"type": "web_search"}]}
    chat, _ = to_chat(codex_request(tool_choice=choice))
    assert [t["function"]["name"] for t in chat["tools"]] == ["exec_command", "apply_patch"]
    assert chat["tool_choice"] == "required"


def test_no_tools_left_means_no_tool_fields() -> None:
    chat, tool_map = to_chat({"model": "m", "input": "hi", "tools": [WEB_SEARCH], "tool_choice": "required",
                              "parallel_tool_calls": False})
    assert "tools" not in chat and "tool_choice" not in chat and "parallel_tool_calls" not in chat
    assert tool_map.dropped == [WEB_SEARCH]


@pytest.mark.parametrize("fmt, expected", [
    ({"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True},
     {"type": "json_schema", "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True}}),
    ({"type": "json_object"}, {"type": "json_object"}),
    ({"type": "text"}, None),
])
def test_text_format_mapping(fmt: dict[str, Any], expected: Any) -> None:
    chat, _ = to_chat({"model": "m", "input": "hi", "text": {"format": fmt, "verbosity": "low"}})
    assert chat.get("response_format") == expected


def test_history_goes_after_instructions_and_is_left_intact() -> None:
    history = [{"role": "developer", "content": "old dev"}, {"role": "user", "content": "q1"},
               {"role": "assistant", "content": "a1", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "exec_command", "arguments": "{}"}}]}]
    kept = copy.deepcopy(history)
    body = {"model": "m", "instructions": "new rules", "previous_response_id": "resp_1", "input": [
        {"type": "function_call_output", "call_id": "c1", "output": "out"},
        {"type": "message", "role": "user", "content": "next"}]}
    chat, _ = to_chat(body, history)
    assert history == kept
    assert [(m["role"], m.get("content")) for m in chat["messages"]] == [
        ("system", "new rules"), ("system", "old dev"), ("user", "q1"), ("assistant", "a1"), ("tool", "out"),
        ("user", "next")]
    assert conversation_messages(chat, body) == chat["messages"][1:]
    assert conversation_messages(chat, {"model": "m"}) == chat["messages"]


def test_nothing_to_send_is_a_400() -> None:
    with pytest.raises(APIError) as exc:
        responses_to_chat({"model": "m", "input": [{"type": "reasoning", "summary": []}]})
    assert exc.value.status_code == 400 and exc.value.param == "input"


# ----------------------------------------------------------------------------------------- responses

COMPLETION = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 5, "model": "qwen",
    "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "Let me check.", "reasoning_content": "User wants a fix.",
        "tool_calls": [
            {"id": "call_a", "type": "function", "function": {"name": "exec_command", "arguments": '{"cmd":"ls"}'}},
            {"id": "call_b", "type": "function", "function": {"name": "mcp__docs__search", "arguments": '{"q":"x"}'}},
            {"id": "call_c", "type": "function",
             "function": {"name": "apply_patch", "arguments": '{"input":"*** Begin Patch\\n*** End Patch"}'}},
        ]}}],
    "usage": {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120,
              "prompt_tokens_details": {"cached_tokens": 64}, "completion_tokens_details": {"reasoning_tokens": 7}},
}


def test_chat_to_response_items_and_usage() -> None:
    body = codex_request()
    _, tool_map = responses_to_chat(body)
    response = chat_to_response(COMPLETION, response_id="resp_abc", request=body, tool_map=tool_map, created_at=9)
    parsed = Response.model_validate(response)
    assert parsed.status == "completed" and parsed.output_text == "Let me check."
    assert response["usage"] == {"input_tokens": 100, "input_tokens_details": {"cached_tokens": 64,
                                                                               "cache_write_tokens": 0},
                                 "output_tokens": 20, "output_tokens_details": {"reasoning_tokens": 7},
                                 "total_tokens": 120}
    out = response["output"]
    assert [i["type"] for i in out] == ["reasoning", "message", "function_call", "function_call", "custom_tool_call"]
    assert out[0]["summary"] == [{"type": "summary_text", "text": "User wants a fix."}]
    assert out[1]["id"].startswith("msg_") and out[1]["status"] == "completed"
    assert out[1]["content"] == [{"type": "output_text", "text": "Let me check.", "annotations": [], "logprobs": []}]
    assert out[2] == {"id": "fc_abc_3", "type": "function_call", "status": "completed", "call_id": "call_a",
                      "name": "exec_command", "arguments": '{"cmd":"ls"}'}
    assert out[3]["name"] == "search" and out[3]["namespace"] == "mcp__docs__" and out[3]["call_id"] == "call_b"
    assert out[4] == {"id": "ctc_abc_5", "type": "custom_tool_call", "status": "completed", "call_id": "call_c",
                      "name": "apply_patch", "input": "*** Begin Patch\n*** End Patch"}
    assert len({i["id"] for i in out}) == 5
    # echoes clients read
    assert response["id"] == "resp_abc" and response["object"] == "response" and response["created_at"] == 9
    assert response["tools"] == CODEX_TOOLS and response["tool_choice"] == "auto"
    assert response["instructions"] == "You are Codex." and response["store"] is False
    assert response["reasoning"] == {"effort": "medium", "summary": "auto"} and response["error"] is None
    assert response["model"] == "qwen" and response["parallel_tool_calls"] is True


def test_output_maps_back_to_the_backend_message() -> None:
    body = codex_request()
    _, tool_map = responses_to_chat(body)
    response = chat_to_response(COMPLETION, response_id="resp_abc", request=body, tool_map=tool_map, created_at=9)
    message = COMPLETION["choices"][0]["message"]
    assert output_to_chat_messages(response, tool_map) == [
        {"role": "assistant", "content": "Let me check.", "tool_calls": message["tool_calls"]}]
    # and Codex sending the output back as input items (with the calls' outputs) gives the same message again
    outputs = [{"type": item["type"] + "_output", "call_id": item["call_id"], "output": "done"}
               for item in response["output"] if item["type"] in ("function_call", "custom_tool_call")]
    chat, _ = to_chat({"model": "qwen", "tools": CODEX_TOOLS, "input": [{"role": "user", "content": "x"},
                                                                          *response["output"], *outputs]})
    assert chat["messages"][1] == {"role": "assistant", "content": "Let me check.",
                                   "tool_calls": message["tool_calls"]}


def test_length_finish_is_incomplete() -> None:
    completion = {"choices": [{"index": 0, "finish_reason": "length",
                               "message": {"role": "assistant", "content": "Once upon"}}],
                  "usage": {"prompt_tokens": 3, "completion_tokens": 2}}
    response = chat_to_response(completion, response_id="resp_x", request={"model": "m", "max_output_tokens": 2},
                                tool_map=ToolMap(), created_at=1)
    Response.model_validate(response)
    assert response["status"] == "incomplete"
    assert response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert response["output"][0]["status"] == "incomplete" and response["max_output_tokens"] == 2
    assert response["usage"]["total_tokens"] == 5


def test_unknown_called_name_stays_a_function_call() -> None:
    completion = {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {"role": "assistant",
              "content": None, "tool_calls": [{"function": {"name": "web_search", "arguments": {"q": "x"}}}]}}]}
    response = chat_to_response(completion, response_id="resp_y", request={"model": "m"}, tool_map=ToolMap(),
                                created_at=1)
    Response.model_validate(response)
    (item,) = response["output"]
    assert item["name"] == "web_search" and item["arguments"] == '{"q":"x"}' and item["call_id"] == "call_y_2"
    assert response["usage"] is None


@pytest.mark.parametrize("arguments, expected", [
    ('{"input": "patch"}', "patch"), ('{"patch": "p"}', "p"), ('"bare"', "bare"), ("not json", "not json"),
    ('{"a": 1, "b": 2}', '{"a": 1, "b": 2}'), ({"input": "d"}, "d"),
])
def test_custom_input_is_lenient(arguments: Any, expected: str) -> None:
    assert custom_input(arguments) == expected


# -------------------------------------------------------------------------------------------- streams

BASE = {"id": "chatcmpl-9", "object": "chat.completion.chunk", "created": 5, "model": "qwen"}


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> dict[str, Any]:
    if delta is None:
        return {**BASE, "choices": [], **extra}
    return {**BASE, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}


def call_fragment(index: int, *, id: str | None = None, name: str | None = None, args: str = "") -> dict[str, Any]:
    frag: dict[str, Any] = {"index": index, "function": {"arguments": args}}
    if id:
        frag["id"], frag["type"] = id, "function"
    if name:
        frag["function"]["name"] = name
    return {"tool_calls": [frag]}


REALISTIC = [
    chunk({"role": "assistant", "content": ""}),
    chunk({"reasoning_content": "The user "}),
    chunk({"reasoning_content": "wants files."}),
    chunk({"content": "Let me "}),
    chunk({"content": "look."}),
    chunk(call_fragment(0, id="call_a", name="exec_command")),
    chunk(call_fragment(0, args='{"cmd"')),
    chunk(call_fragment(0, args=': "ls -la"}')),
    chunk(call_fragment(1, id="call_b", name="mcp__docs__search", args="")),
    chunk(call_fragment(1, args='{"q": ')),
    chunk(call_fragment(1, args='"tests"}')),
    chunk({}, "tool_calls"),
    chunk(None, usage={"prompt_tokens": 50, "completion_tokens": 30, "total_tokens": 80,
                       "prompt_tokens_details": {"cached_tokens": 32},
                       "completion_tokens_details": {"reasoning_tokens": 4}}),
]


def run_stream(chunks: list[dict[str, Any]], request: dict[str, Any] | None = None, *, end: str = "finish",
               response_id: str = "resp_s1") -> tuple[list[dict[str, Any]], ResponseStream]:
    request = request or codex_request()
    _, tool_map = responses_to_chat(request)
    stream = ResponseStream(response_id=response_id, request=request, tool_map=tool_map, created_at=7)
    events = stream.start()
    for c in chunks:
        events += stream.feed(c)
    events += stream.finish() if end == "finish" else stream.fail("server_error", "boom")
    return events, stream


def check_events(events: list[dict[str, Any]]) -> None:
    """Sequence numbers from 0, every event the SDK's, one item open at a time, deltas adding up."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    for event in events:
        EVENT.validate_python(event)
    open_index = None
    deltas: dict[str, list[str]] = {}
    for event in events:
        kind = event["type"]
        if kind == "response.output_item.added":
            assert open_index is None, "an item opened before the previous one closed"
            open_index = event["output_index"]
        elif kind == "response.output_item.done":
            assert event["output_index"] == open_index
            open_index = None
            item = event["item"]
            got = "".join(deltas.pop(item["id"], []))
            if item["type"] == "message":
                assert got == item["content"][0]["text"]
            elif item["type"] == "reasoning":
                assert got == item["summary"][0]["text"]
            elif item["type"] == "function_call":
                assert got == item["arguments"]
            elif item["type"] == "custom_tool_call":
                assert got == item["input"]
        elif kind.endswith(".delta"):
            assert event["output_index"] == open_index
            deltas.setdefault(event["item_id"], []).append(event["delta"])
    if events[-1]["type"] in ("response.completed", "response.incomplete"):
        assert open_index is None  # a failure leaves what was open as it was
    assert events[-1]["type"] in ("response.completed", "response.incomplete", "response.failed")
    assert [e["type"] for e in events].count(events[-1]["type"]) == 1


def test_stream_realistic_sequence() -> None:
    events, stream = run_stream(REALISTIC)
    check_events(events)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.reasoning_summary_part.added",
        "response.reasoning_summary_text.delta", "response.reasoning_summary_text.delta",
        "response.reasoning_summary_text.done", "response.reasoning_summary_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    final = events[-1]["response"]
    Response.model_validate(final)
    assert final == stream.response and final["status"] == "completed"
    assert final["usage"]["input_tokens"] == 50 and final["usage"]["input_tokens_details"]["cached_tokens"] == 32
    assert final["usage"]["output_tokens_details"]["reasoning_tokens"] == 4
    out = final["output"]
    assert out[1]["content"][0]["text"] == "Let me look."
    assert out[2]["arguments"] == '{"cmd": "ls -la"}' and out[2]["call_id"] == "call_a"
    assert out[3]["name"] == "search" and out[3]["namespace"] == "mcp__docs__"
    assert out[3]["arguments"] == '{"q": "tests"}'
    # the streamed response is the one the same completion gives unstreamed
    acc = ChunkAccumulator()
    for c in REALISTIC:
        acc.add(c)
    plain = chat_to_response(acc.completion(), response_id="resp_s1", request=codex_request(),
                             tool_map=responses_to_chat(codex_request())[1], created_at=7)
    assert plain == final


def test_stream_text_after_tool_call_opens_new_message() -> None:
    events, stream = run_stream([
        chunk({"content": "First."}),
        chunk(call_fragment(0, id="c1", name="exec_command", args="{}")),
        chunk({"content": "Then."}),
        chunk({}, "stop"),
    ])
    check_events(events)
    assert [i["type"] for i in stream.response["output"]] == ["message", "function_call", "message"]
    assert stream.response["output"][2]["content"][0]["text"] == "Then."


def test_stream_custom_tool_input_events() -> None:
    patch = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
    encoded = json.dumps({"input": patch})
    events, stream = run_stream([
        chunk(call_fragment(0, id="c1", name="apply_patch")),
        chunk(call_fragment(0, args=encoded[:20])),
        chunk(call_fragment(0, args=encoded[20:])),
        chunk({}, "tool_calls"),
    ])
    check_events(events)
    types = [e["type"] for e in events]
    assert types[2:] == ["response.output_item.added", "response.custom_tool_call_input.delta",
                         "response.custom_tool_call_input.done", "response.output_item.done", "response.completed"]
    item = stream.response["output"][0]
    assert item["type"] == "custom_tool_call" and item["input"] == patch and item["call_id"] == "c1"
    assert events[3]["delta"] == patch and events[4]["input"] == patch


def test_stream_cut_short_ends_with_response_incomplete() -> None:
    """As OpenAI ends a stream whose output hit max_output_tokens: ``response.incomplete``, never
    ``response.completed``."""
    events, stream = run_stream([chunk({"content": "Once upon"}), chunk({}, "length"),
                                 chunk(None, usage={"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7})])
    check_events(events)
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert "response.completed" not in [e["type"] for e in events]
    assert final["response"]["status"] == "incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["output"][0]["status"] == "incomplete"
    assert events[-2]["item"]["status"] == "incomplete"


def test_stream_without_usage_or_output() -> None:
    events, stream = run_stream([chunk({"role": "assistant", "content": ""}), chunk({}, "stop")])
    check_events(events)
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.completed"]
    assert stream.response["output"] == [] and stream.response["usage"] is None


def test_stream_fail_midway() -> None:
    events, stream = run_stream([chunk({"content": "Partial"})], end="fail")
    check_events(events)
    assert [e["type"] for e in events][-3:] == ["response.content_part.added", "response.output_text.delta",
                                                "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"] == {"code": "server_error", "message": "boom"}
    assert failed["output"][0]["status"] == "incomplete"
    assert failed["output"][0]["content"][0]["text"] == "Partial"
    Response.model_validate(failed)
    assert stream.finish() == [] and stream.fail("server_error", "again") == [] and stream.feed(REALISTIC[3]) == []
    assert stream.ended


def test_stream_fail_in_a_tool_call() -> None:
    events, stream = run_stream([chunk(call_fragment(0, id="c1", name="exec_command", args='{"cmd": "l')),
                                 chunk(call_fragment(1, id="c2", name="exec_command"))], end="fail")
    check_events(events)
    output = events[-1]["response"]["output"]
    assert [(i["call_id"], i["status"], i["arguments"]) for i in output] == [("c1", "completed", '{"cmd": "l')]
    assert stream.response["output"] == output  # the second call never got announced: not in the output


def test_stream_fail_codes_codex_reads() -> None:
    stream = ResponseStream(response_id="resp_f", request={"model": "m"}, tool_map=ToolMap(), created_at=1)
    events = stream.fail("context_length_exceeded", "Your input exceeds the context window of this model.")
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.failed"]
    assert events[-1]["response"]["error"]["code"] == "context_length_exceeded"
    # the SDK's ResponseError lists fewer codes than the API sends; the rest of the object is the SDK's
    Response.model_validate({**events[-1]["response"], "error": {"code": "server_error", "message": "x"}})
    rate = ResponseStream(response_id="resp_r", request={"model": "m"}, tool_map=ToolMap(), created_at=1)
    ev = rate.fail("rate_limit_exceeded", "Rate limit reached. Please try again in 2s.")
    check_events(ev)


def test_stream_feed_starts_itself_and_skips_other_choices() -> None:
    stream = ResponseStream(response_id="resp_q", request={"model": "m"}, tool_map=ToolMap(), created_at=1)
    events = stream.feed({**BASE, "choices": [{"index": 1, "delta": {"content": "other"}},
                                              {"index": 0, "delta": {"content": "mine"}}]})
    events += stream.finish()
    check_events(events)
    assert events[0]["type"] == "response.created" and stream.response["output"][0]["content"][0]["text"] == "mine"


def test_stream_tool_call_name_before_arguments_and_late_name() -> None:
    # name and id in one fragment, arguments only at the end; a call with no arguments at all
    events, stream = run_stream([
        chunk(call_fragment(0, id="c1", name="exec_command")),
        chunk(call_fragment(1, id="c2", name="exec_")),
        chunk(call_fragment(1, name="command")),
        chunk(call_fragment(1, args="{}")),
        chunk({}, "tool_calls"),
    ])
    check_events(events)
    out = stream.response["output"]
    assert [(i["call_id"], i["name"], i["arguments"]) for i in out] == [("c1", "exec_command", ""),
                                                                         ("c2", "exec_command", "{}")]


# --------------------------------------------------------------------------------------- validation


@pytest.mark.parametrize("body, param, code", [
    ({"input": "hi"}, "model", "missing_required_parameter"),
    ({"model": "", "input": "hi"}, "model", "invalid_value"),
    ({"model": "m"}, "input", "missing_required_parameter"),
    ({"model": "m", "input": 5}, "input", "invalid_value"),
    ({"model": "m", "input": {"role": "user"}}, "input", "invalid_value"),
    ({"model": "m", "input": ["hi"]}, "input[0]", "invalid_type"),
    ({"model": "m", "input": [{"type": "brand_new_item", "x": 1}]}, "input[0].type", "invalid_value"),
    ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_video", "video": "x"}]}]},
     "input[0].content[0].type", "invalid_value"),
    ({"model": "m", "input": [{"role": "user", "content": [{"type": "input_text"}]}]},
     "input[0].content[0].text", "missing_required_parameter"),
    ({"model": "m", "input": [{"content": "x"}]}, "input[0].type", "missing_required_parameter"),
    ({"model": "m", "input": [{"role": "tool", "content": "x"}]}, "input[0].role", "invalid_value"),
    ({"model": "m", "input": [{"role": "user"}]}, "input[0].content", "missing_required_parameter"),
    ({"model": "m", "input": [{"role": "user", "content": 3}]}, "input[0].content", "invalid_value"),
    ({"model": "m", "input": [{"role": "user", "content": [{"text": "x"}]}]}, "input[0].content[0].type",
     "missing_required_parameter"),
    ({"model": "m", "input": [{"role": "user", "content": "x"},
                              {"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[1].call_id", "missing_required_parameter"),
    ({"model": "m", "input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]},
     "input[0].name", "missing_required_parameter"),
    ({"model": "m", "input": [{"type": "function_call_output", "call_id": "c"}]},
     "input[0].output", "missing_required_parameter"),
    ({"model": "m", "input": [{"type": "custom_tool_call", "call_id": "c", "name": "p", "input": 1}]},
     "input[0].input", "invalid_type"),
    ({"model": "m", "input": "x", "instructions": ["x"]}, "instructions", "invalid_type"),
    ({"model": "m", "input": "x", "temperature": 3}, "temperature", "invalid_value"),
    ({"model": "m", "input": "x", "top_p": 0}, "top_p", "invalid_value"),
    ({"model": "m", "input": "x", "max_output_tokens": True}, "max_output_tokens", "invalid_type"),
    ({"model": "m", "input": "x", "stream": "yes"}, "stream", "invalid_type"),
    ({"model": "m", "input": "x", "tools": {"type": "function"}}, "tools", "invalid_type"),
    ({"model": "m", "input": "x", "tools": [{"name": "f"}]}, "tools[0].type", "missing_required_parameter"),
    ({"model": "m", "input": "x", "tools": [{"type": "function"}]}, "tools[0].name", "missing_required_parameter"),
    ({"model": "m", "input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "nope"}}]},
     "tools[0].parameters", "invalid_value"),
    ({"model": "m", "input": "x", "tools": [{"type": "namespace", "name": "ns", "tools": [{"type": "function"}]}]},
     "tools[0].tools[0].name", "missing_required_parameter"),
    ({"model": "m", "input": "x", "tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
    ({"model": "m", "input": "x", "tool_choice": {"type": "function"}}, "tool_choice.name",
     "missing_required_parameter"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "xml"}}}, "text.format", "invalid_value"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema",
     "missing_required_parameter"),
])
def test_invalid_requests_name_the_param(body: dict[str, Any], param: str, code: str) -> None:
    with pytest.raises(APIError) as exc:
        validate_responses_request(body)
    assert exc.value.status_code == 400
    assert exc.value.param == param and exc.value.code == code
    assert exc.value.body()["error"]["type"] == "invalid_request_error"


def test_valid_requests_pass() -> None:
    validate_responses_request(codex_request())
    validate_responses_request({"model": "m", "previous_response_id": "resp_1", "input": []})
    validate_responses_request({"model": "m", "previous_response_id": "resp_1"})
    validate_responses_request({"model": "m", "input": [{"type": "reasoning", "summary": []},
                                                        {"type": "compaction", "encrypted_content": "x"}],
                                "tools": [{"type": "brand_new_tool"}], "tool_choice": {"type": "mcp"}})
    with pytest.raises(APIError, match="JSON object"):
        validate_responses_request([1])


@pytest.mark.parametrize("body, param, code", [
    # null is no value: a null required field is a missing one
    ({"model": None, "input": "x"}, "model", "missing_required_parameter"),
    ({"model": "m", "input": [{"type": "function_call", "call_id": None, "name": "f"}]}, "input[0].call_id",
     "missing_required_parameter"),
    ({"model": "m", "input": [{"type": None, "content": "x"}]}, "input[0].type", "missing_required_parameter"),
    ({"model": "m", "input": "x", "tools": [{"type": "namespace", "name": "ns", "tools": None}]}, "tools[0].tools",
     "missing_required_parameter"),
    # ... but a message without a role has a wrong one
    ({"model": "m", "input": [{"type": "message", "content": "x"}]}, "input[0].role", "invalid_value"),
    # these have always been named missing when not of their type
    ({"model": "m", "input": "x", "tool_choice": {"type": "custom", "name": 5}}, "tool_choice.name",
     "missing_required_parameter"),
    ({"model": "m", "input": "x", "tool_choice": {"type": "allowed_tools", "tools": {}}}, "tool_choice.tools",
     "missing_required_parameter"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "", "schema": {}}}},
     "text.format.name", "missing_required_parameter"),
    # values are not coerced
    ({"model": "m", "input": "x", "temperature": "1"}, "temperature", "invalid_type"),
    ({"model": "m", "input": "x", "temperature": True}, "temperature", "invalid_type"),
    ({"model": "m", "input": "x", "max_output_tokens": 5.0}, "max_output_tokens", "invalid_type"),
    ({"model": "m", "input": "x", "store": 1}, "store", "invalid_type"),
    ({"model": "m", "input": "x", "metadata": []}, "metadata", "invalid_type"),
    # namespaces nest, and each level is checked
    ({"model": "m", "input": "x", "tools": [{"type": "namespace", "name": "a", "tools": [
        {"type": "namespace", "name": "b", "tools": [{"type": "custom", "name": ""}]}]}]},
     "tools[0].tools[0].tools[0].name", "invalid_value"),
    # with several faults the first in check order is named; text.format comes after every other field
    ({"model": "", "input": 5, "tools": 1}, "model", "invalid_value"),
    ({"model": "m", "input": [{"role": "user", "content": "x"}, 3, {"role": "tool"}]}, "input[1]", "invalid_type"),
    ({"model": "m", "input": "x", "text": {"format": {"type": "xml"}}, "tools": [{"name": "f"}]},
     "tools[0].type", "missing_required_parameter"),
    ({"model": "m", "input": "x", "text": 5, "tools": [{"name": "f"}]}, "text", "invalid_type"),
])
def test_invalid_requests_name_the_first_fault(body: dict[str, Any], param: str, code: str) -> None:
    with pytest.raises(APIError) as exc:
        validate_responses_request(body)
    assert (exc.value.status_code, exc.value.param, exc.value.code) == (400, param, code)


def test_invalid_requests_are_told_in_words() -> None:
    def message(body: dict[str, Any]) -> str:
        with pytest.raises(APIError) as exc:
            validate_responses_request(body)
        return exc.value.message

    assert message({"input": "x"}) == "Missing required parameter: 'model'."
    assert message({"model": "m", "input": ["hi"]}) == "Invalid type for 'input[0]': expected an input item object."
    assert message({"model": "m", "input": "x", "tool_choice": "sometimes"}) == \
        "Invalid value for 'tool_choice': expected 'auto', 'none', 'required' or a tool choice object."
    schema = message({"model": "m", "input": "x",
                      "tools": [{"type": "function", "name": "f", "parameters": {"type": "nope"}}]})
    assert schema.startswith("Invalid value for 'tools[0].parameters': not a valid JSON Schema at type:")
    assert message({"model": "m", "input": "x", "top_p": 0}).startswith("Invalid value for 'top_p': ")


def test_unknown_fields_pass_everywhere() -> None:
    validate_responses_request({
        "model": "m", "brand_new": {"x": 1}, "include": ["reasoning.encrypted_content"],
        "input": [{"type": "message", "role": "user", "content": "x", "id": "msg_1", "status": "completed"},
                  {"type": "function_call", "call_id": "c", "name": "f", "arguments": {"a": 1}, "extra": [1]}],
        "tools": [{"type": "function", "name": "f", "parameters": None, "defer_loading": True}],
        "tool_choice": {"type": "function", "name": "", "namespace": "ns"},
        "text": {"format": {"type": "json_schema", "name": "n", "schema": {}, "strict": True}, "verbosity": "low"},
    })


# ------------------------------------------------------------------------------------------ helpers


def test_encode_named_event() -> None:
    frame = encode_named_event("response.created", {"type": "response.created", "n": "a\nb"})
    assert frame == b'event: response.created\ndata: {"type":"response.created","n":"a\\nb"}\n\n'
    assert encode_event({"a": 1}) == b'data: {"a":1}\n\n'
    with pytest.raises(ValueError):
        encode_named_event("bad\ntype", {})
    lines = frame.decode().split("\n")
    assert orjson.loads(lines[1].removeprefix("data: "))["n"] == "a\nb"


@pytest.mark.parametrize("status, message, code", [
    (429, "slow down", "rate_limit_exceeded"),
    (400, "This model's maximum context length is 8192 tokens.", "context_length_exceeded"),
    (400, "The input exceeds the context window.", "context_length_exceeded"),
    (502, "upstream died", "server_error"),
    (None, "", "server_error"),
])
def test_failure_code(status: int | None, message: str, code: str) -> None:
    assert failure_code(status, message) == code
