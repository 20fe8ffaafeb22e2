"""A chat completion as an Anthropic Message, and back (an upstream's Message recorded as a chat completion)."""

from __future__ import annotations

from typing import Any

import orjson

_STOPS = {"length": "max_tokens", "tool_calls": "tool_use", "function_call": "tool_use", "content_filter": "refusal"}
_FINISHES = {"end_turn": "stop", "stop_sequence": "stop", "pause_turn": "stop", "max_tokens": "length",
             "tool_use": "tool_calls", "refusal": "content_filter"}


def tool_input(arguments: Any) -> dict[str, Any]:
    """A tool call's arguments as the object Anthropic's ``input`` must be; ``{}`` for anything else."""
    if isinstance(arguments, dict):
        return arguments
    try:
        value = orjson.loads(arguments or "")
    except (orjson.JSONDecodeError, TypeError):
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(finish_reason: str | None, matched: Any, stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence). ``matched`` is the stop string a backend reports (SGLang's ``matched_stop``,
    vLLM's ``stop_reason``), when it does: a chat backend stops before the string, so the text never shows it."""
    if finish_reason == "stop" and isinstance(matched, str) and stop_sequences and matched in stop_sequences:
        return "stop_sequence", matched
    return _STOPS.get(finish_reason or "", "end_turn"), None


def usage_of(chat_usage: dict[str, Any] | None) -> dict[str, Any]:
    usage = chat_usage or {}
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {"input_tokens": max(int(usage.get("prompt_tokens") or 0) - cached, 0),
            "output_tokens": int(usage.get("completion_tokens") or 0),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text = message.get("content")
    if isinstance(text, list):
        text = "".join(p.get("text") or "" for p in text if isinstance(p, dict))
    if text:
        blocks.append({"type": "text", "text": text})
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        blocks.append({"type": "tool_use", "id": call.get("id"), "name": function.get("name"),
                       "input": tool_input(function.get("arguments"))})
    return blocks or [{"type": "text", "text": ""}]


def chat_to_message(completion: dict[str, Any], *, message_id: str, model: str,
                    stop_sequences: list[str] | None = None) -> dict[str, Any]:
    choice = (completion.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    reason, sequence = stop_reason(choice.get("finish_reason"), choice.get("matched_stop", choice.get("stop_reason")),
                                   stop_sequences)
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": content_blocks(message), "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage_of(completion.get("usage"))}


def message_to_chat(message: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic Message (as an upstream answered it) as the chat completion the store records."""
    text, thinking, calls = [], [], []
    for block in message.get("content") or []:
        if not isinstance(block, dict):
            continue
        kind = block.get("type")
        if kind == "text":
            text.append(block.get("text") or "")
        elif kind == "thinking":
            thinking.append(block.get("thinking") or "")
        elif kind == "tool_use":
            calls.append({"id": block.get("id"), "type": "function", "function": {
                "name": block.get("name"), "arguments": orjson.dumps(block.get("input") or {}).decode()}})
    reply: dict[str, Any] = {"role": "assistant", "content": "".join(text) if text or not calls else None}
    if thinking:
        reply["reasoning_content"] = "".join(thinking)
    if calls:
        reply["tool_calls"] = calls
    usage = message.get("usage") or {}
    cached = int(usage.get("cache_read_input_tokens") or 0)
    prompt = int(usage.get("input_tokens") or 0) + cached + int(usage.get("cache_creation_input_tokens") or 0)
    completion = int(usage.get("output_tokens") or 0)
    return {"id": message.get("id"), "object": "chat.completion", "model": message.get("model"),
            "choices": [{"index": 0, "message": reply,
                         "finish_reason": _FINISHES.get(message.get("stop_reason") or "", "stop")}],
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                      "prompt_tokens_details": {"cached_tokens": cached}}}
