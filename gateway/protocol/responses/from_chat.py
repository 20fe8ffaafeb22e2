"""Chat completions as Responses ``response`` objects, and finished responses as chat history again.

``reasoning_content`` becomes a ``reasoning`` item (its text as a summary), text a ``message`` item,
each tool call a ``function_call`` or ``custom_tool_call`` item, in that order. ``finish_reason``
``length`` makes the response ``incomplete`` (``max_output_tokens``). The item builders here are shared
with the stream (``stream.py``), so a stream and the response it ends in agree item for item.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.protocol.responses.to_chat import _items_to_messages, _text_of
from gateway.protocol.responses.tools import ToolEntry, ToolMap, custom_input


def response_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Chat ``usage`` as Responses ``usage``."""
    if not usage:
        return None
    prompt = usage.get("prompt_tokens") or 0
    completion = usage.get("completion_tokens") or 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
                                 "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {
            "reasoning_tokens": (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0},
        "total_tokens": usage.get("total_tokens") or prompt + completion,
    }


def _final_status(finish_reason: Any) -> tuple[str, dict[str, Any] | None]:
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "content_filter":
        return "incomplete", {"reason": "content_filter"}
    if finish_reason == "error":  # the embedded engine's grammar failed mid-way: the output does not match it
        return "incomplete", {"reason": "error"}
    return "completed", None


def _response_object(*, response_id: str, request: dict[str, Any], created_at: int, status: str,
                     output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                     error: dict[str, Any] | None = None,
                     incomplete_details: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": incomplete_details,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "metadata": request.get("metadata") or {},
        "model": request.get("model"),
        "output": output,
        "parallel_tool_calls": request.get("parallel_tool_calls", True) is not False,
        "previous_response_id": request.get("previous_response_id"),
        "prompt_cache_key": request.get("prompt_cache_key"),
        "reasoning": request.get("reasoning"),
        "store": request.get("store", True) is not False,
        "temperature": request.get("temperature"),
        "text": request.get("text") or {"format": {"type": "text"}},
        "tool_choice": request.get("tool_choice") or "auto",
        "tools": request.get("tools") or [],
        "top_p": request.get("top_p"),
        "truncation": request.get("truncation") or "disabled",
        "usage": usage,
        "user": request.get("user"),
    }


class _Ids:
    """Item ids derived from the response id: unique per response, the same for a stream and its replay."""

    def __init__(self, response_id: str) -> None:
        self.base = response_id.removeprefix("resp_") or response_id
        self.n = 0

    def next(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}_{self.base}_{self.n}"


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_item(item_id: str, text: str | None) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning",
            "summary": [] if text is None else [{"type": "summary_text", "text": text}]}


def _call_item(ids: _Ids, entry: ToolEntry, call_id: str | None, status: str,
               arguments: str = "") -> dict[str, Any]:
    """A ``function_call`` or ``custom_tool_call`` item for a backend tool call (its payload as given)."""
    if entry.kind == "custom":
        item = {"id": ids.next("ctc"), "type": "custom_tool_call", "status": status,
                "call_id": call_id or ids.next("call"), "name": entry.name,
                "input": custom_input(arguments) if arguments else ""}
    else:
        item = {"id": ids.next("fc"), "type": "function_call", "status": status,
                "call_id": call_id or ids.next("call"), "name": entry.name, "arguments": arguments}
    if entry.namespace:
        item["namespace"] = entry.namespace
    return item


def chat_to_response(completion: dict[str, Any], *, response_id: str, request: dict[str, Any],
                     tool_map: ToolMap, created_at: int) -> dict[str, Any]:
    """A ``chat.completion`` (its first choice) as a Responses ``response`` object."""
    choices = completion.get("choices") or [{}]
    choice = choices[0] or {}
    message = choice.get("message") or {}
    ids = _Ids(response_id)
    output: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        output.append(_reasoning_item(ids.next("rs"), reasoning))
    content = message.get("content")
    text = content if isinstance(content, str) else _text_of(content)
    if text:
        output.append(_message_item(ids.next("msg"), text, "completed"))
    for call in message.get("tool_calls") or ():
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = orjson.dumps(arguments).decode() if arguments is not None else ""
        output.append(_call_item(ids, tool_map.entry_for(function.get("name") or ""), call.get("id"),
                                 "completed", arguments))
    status, incomplete = _final_status(choice.get("finish_reason"))
    if incomplete and output and "status" in output[-1]:
        output[-1]["status"] = "incomplete"
    return _response_object(response_id=response_id, request=request, created_at=created_at, status=status,
                            output=output, usage=response_usage(completion.get("usage")),
                            incomplete_details=incomplete)


def output_to_chat_messages(response: dict[str, Any], tool_map: ToolMap | None = None) -> list[dict[str, Any]]:
    """A finished response's output as chat messages (normally one assistant message, its text and calls),
    to continue the conversation with ``previous_response_id``. Reasoning is left out, as from input."""
    messages = _items_to_messages(list(response.get("output") or ()), tool_map)
    return [m for m in messages if m.get("tool_calls") or _text_of(m.get("content"))]



def failure_code(status_code: int | None, message: str = "") -> str:
    """The ``response.failed`` code for a backend error: what Codex acts on (it compacts the history on
    ``context_length_exceeded`` and waits on ``rate_limit_exceeded``)."""
    text = message.lower()
    if status_code == 429:
        return "rate_limit_exceeded"
    if ("context" in text and ("length" in text or "window" in text)) or "maximum context" in text \
            or "too many tokens" in text or "prompt is too long" in text:
        return "context_length_exceeded"
    return "server_error"
