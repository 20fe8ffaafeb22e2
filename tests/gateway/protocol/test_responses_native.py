"""The pure parts of a Responses pass-through and of compaction: a stream read into its response, a response as a
chat completion, compaction items made and read back, lenient translation, and the read model's items."""

from __future__ import annotations

import pytest

from gateway.errors import APIError
from gateway.protocol.responses import ToolMap, responses_to_chat
from gateway.protocol.responses.compaction import (
    SUMMARY_INTRO,
    asks_compaction,
    compaction_item,
    compacts,
    is_compacted,
    kept_user_messages,
    summary_of,
)
from gateway.protocol.responses.native import ResponseAccumulator, is_output_event, response_to_chat
from replay.model import RESPONSES, ModelCall, Trajectory

REASONING = {"id": "rs_1", "type": "reasoning", "encrypted_content": "gAAAA+opaque/==",
             "summary": [{"type": "summary_text", "text": "Think first."}]}
CALL = {"id": "fc_1", "type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": '{"cmd":"ls"}'}
PATCH = {"id": "ctc_1", "type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": "*** Begin"}
TOOLS = [{"type": "function", "name": "exec_command", "parameters": {"type": "object"}},
         {"type": "custom", "name": "apply_patch"}]


def test_a_stream_is_read_into_the_response_it_ends_in() -> None:
    acc = ResponseAccumulator()
    start = {"id": "resp_1", "status": "in_progress", "output": []}
    acc.add({"type": "response.created", "response": start})
    acc.add({"type": "response.output_item.done", "output_index": 0, "item": REASONING})
    acc.add({"type": "response.output_text.delta", "delta": "x"})
    assert acc.response == {**start, "output": [REASONING]}  # a client gone mid-way: what was finished
    acc.add({"type": "response.output_item.done", "output_index": 1, "item": CALL})
    final = {"id": "resp_1", "status": "completed", "output": [REASONING, CALL], "usage": {"input_tokens": 3}}
    acc.add({"type": "response.completed", "response": final})
    assert acc.response == final and acc.error is None

    failed = ResponseAccumulator()
    failed.add({"type": "response.failed", "response": {"id": "r", "output": [],
                                                         "error": {"code": "server_error", "message": "boom"}}})
    assert failed.error == {"code": "server_error", "message": "boom"}
    assert is_output_event("response.function_call_arguments.delta") and not is_output_event("response.created")


def test_a_response_as_a_chat_completion() -> None:
    tool_map = ToolMap.from_tools(TOOLS)
    message_item = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Doing."}]}
    completion = response_to_chat({"id": "resp_1", "created_at": 7, "model": "m", "output": [
        REASONING, message_item, CALL, PATCH], "usage": {
        "input_tokens": 10, "input_tokens_details": {"cached_tokens": 4}, "output_tokens": 5,
        "output_tokens_details": {"reasoning_tokens": 2}, "total_tokens": 15}}, tool_map)
    [choice] = completion["choices"]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert (message["content"], message["reasoning_content"]) == ("Doing.", "Think first.")
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("c1", "exec_command", '{"cmd":"ls"}'), ("c2", "apply_patch", '{"input":"*** Begin"}')]
    assert completion["usage"] == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
                                   "prompt_tokens_details": {"cached_tokens": 4},
                                   "completion_tokens_details": {"reasoning_tokens": 2}}
    cut = response_to_chat({"output": [message_item], "incomplete_details": {"reason": "max_output_tokens"}},
                           tool_map)
    assert cut["choices"][0]["finish_reason"] == "length" and "usage" not in cut


def test_compaction_items_are_made_and_read_back() -> None:
    item = compaction_item("cmp_1", "Summary: ünïcode and = / + survive.")
    assert item["type"] == "compaction" and "Summary" not in item["encrypted_content"]
    assert summary_of(item) == "Summary: ünïcode and = / + survive."
    assert summary_of({"type": "compaction", "encrypted_content": "gAAAA-made-elsewhere"}) is None
    chat, _ = responses_to_chat({"model": "m", "input": [
        {"type": "compaction", "encrypted_content": "gAAAA-made-elsewhere"}, item,
        {"role": "user", "content": "go on"}]})
    assert chat["messages"] == [{"role": "user", "content": SUMMARY_INTRO + "Summary: ünïcode and = / + survive."},
                                {"role": "user", "content": "go on"}]


def test_which_requests_compact_and_which_histories_are_compacted() -> None:
    user = {"type": "message", "role": "user", "content": "hi"}
    assert asks_compaction({"input": [user, {"type": "compaction_trigger"}]})
    assert not asks_compaction({"input": "hi"}) and not asks_compaction({"input": [user]})
    checkpoint = {"role": "user", "content": [{"type": "input_text",
                                               "text": "You are performing a CONTEXT CHECKPOINT COMPACTION. ..."}]}
    assert compacts({"input": [user, checkpoint]}) and not compacts({"input": [user]})
    codex_summary = {"role": "user", "content": "Another language model started to solve this problem and ..."}
    assert is_compacted({"input": [user, codex_summary]})
    assert is_compacted({"input": [{"type": "compaction_summary", "encrypted_content": "x"}, user]})
    assert not is_compacted({"input": [user]}) and not is_compacted({"input": "hi"})
    assert kept_user_messages({"input": [user, checkpoint, codex_summary, CALL]}) == [user]


def test_lenient_translation_records_what_a_strict_one_refuses() -> None:
    body = {"model": "m", "previous_response_id": "resp_upstream",
            "input": [{"type": "function_call_output", "call_id": "c9", "output": "42"}],
            "tools": TOOLS, "tool_choice": {"type": "function", "name": "missing"}}
    with pytest.raises(APIError):
        responses_to_chat(body)
    chat, _ = responses_to_chat(body, lenient=True)
    assert chat["messages"] == [] and chat["tool_choice"] == "auto"
    unanswered = {"model": "m", "input": [{"role": "user", "content": "hi"}, CALL]}
    assert responses_to_chat(unanswered, lenient=True)[0]["messages"] == [{"role": "user", "content": "hi"}]


def _call(seq: int, inputs: list, output: list) -> ModelCall:
    return ModelCall(id=str(seq), seq=seq, created_at=0.0, status="ok", request={"messages": []}, response=None,
                     native={"api": RESPONSES, "request": {"input": inputs}, "response": {"output": output}})


def test_the_read_model_lays_a_session_out_as_items() -> None:
    user = {"type": "message", "role": "user", "content": "run it"}
    result = {"type": "function_call_output", "call_id": "c1", "output": "ok"}
    answer = {"id": "msg_1", "type": "message", "role": "assistant", "status": "completed", "content": []}
    compaction = {"id": "cmp_1", "type": "compaction", "encrypted_content": "x"}
    sent_back = [{k: v for k, v in i.items() if k not in ("id", "status")} for i in (REASONING, CALL)]
    calls = [_call(0, [user], [REASONING, CALL]),
             _call(1, [user, *sent_back, result], [answer]),  # ids dropped by the client: still the same items
             _call(2, [user, *sent_back, result, answer, {"type": "compaction_trigger"}], [compaction]),
             _call(3, [compaction, user], [answer])]
    trajectory = Trajectory(id="t", source="gateway", status="ok", created_at=0.0, updated_at=0.0,
                            format=RESPONSES, calls=calls)
    assert trajectory.items() == [user, REASONING, CALL, result, answer, {"type": "compaction_trigger"},
                                  compaction, compaction, user, answer]
    assert trajectory.to_dict()["items"] == trajectory.items()
