"""The checks that make a Messages request unusable, each a 400 naming the field (``messages.2.content.0.type``).

Only what the gateway itself must read is checked. Unknown fields and unknown block types are never errors: a
new Claude Code release adds some with each version, and they pass to an Anthropic upstream as they are.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import APIError

_ROLES = ("user", "assistant", "system")
_CHOICES = ("auto", "any", "tool", "none")


def _fail(message: str, param: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param, code="invalid_request")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def validate_messages_request(body: Any, *, counting: bool = False) -> None:
    """Raise a 400 ``APIError`` for a body the Messages API cannot take; ``counting``: a count_tokens body, which
    has no ``max_tokens``."""
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_request")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise _fail("a non-empty string is required", "model")
    if not counting or "max_tokens" in body:
        if not _is_int(body.get("max_tokens")) or body["max_tokens"] < 1:
            raise _fail("an integer of at least 1 is required", "max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _fail("a non-empty list of messages is required", "messages")
    for i, message in enumerate(messages):
        _check_message(message, f"messages.{i}")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        _check_blocks(system, "system")
    _check_tools(body.get("tools"))
    choice = body.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in _CHOICES:
            raise _fail(f"an object whose type is one of {', '.join(_CHOICES)} is required", "tool_choice")
        if choice["type"] == "tool" and not isinstance(choice.get("name"), str):
            raise _fail("a tool choice of type 'tool' names the tool", "tool_choice.name")
    stops = body.get("stop_sequences")
    if stops is not None and not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise _fail("a list of strings is required", "stop_sequences")
    for name in ("temperature", "top_p"):
        value = body.get(name)
        if value is not None and not (_is_number(value) and 0 <= value <= 1):
            raise _fail("a number from 0 to 1 is required", name)
    if body.get("top_k") is not None and not (_is_int(body["top_k"]) and body["top_k"] >= 0):
        raise _fail("a non-negative integer is required", "top_k")
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise _fail("a boolean is required", "stream")
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise _fail("an object is required", "metadata")


def _check_message(message: Any, where: str) -> None:
    if not isinstance(message, dict):
        raise _fail("a message object is required", where)
    if message.get("role") not in _ROLES:
        raise _fail(f"role must be one of {', '.join(_ROLES)}", f"{where}.role")
    content = message.get("content")
    if isinstance(content, str):
        return
    _check_blocks(content, f"{where}.content")


def _check_blocks(blocks: Any, where: str) -> None:
    if not isinstance(blocks, list):
        raise _fail("a string or a list of content blocks is required", where)
    for j, block in enumerate(blocks):
        at = f"{where}.{j}"
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise _fail("a content block is an object with a string type", f"{at}.type")
        kind = block["type"]
        if kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise _fail("a tool_use block has a string id and name", at)
            if not isinstance(block.get("input"), dict):
                raise _fail("a tool_use block's input is an object", f"{at}.input")
        elif kind == "tool_result" and not isinstance(block.get("tool_use_id"), str):
            raise _fail("a tool_result block names its tool_use_id", f"{at}.tool_use_id")
        elif kind == "text" and not isinstance(block.get("text"), str):
            raise _fail("a text block has a string text", f"{at}.text")


def _check_tools(tools: Any) -> None:
    if tools is None:
        return
    if not isinstance(tools, list):
        raise _fail("a list of tools is required", "tools")
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise _fail("a tool is an object", f"tools.{i}")
        if tool.get("type") not in (None, "custom"):
            continue  # a server tool: its own fields, checked by whoever serves it
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise _fail("a tool has a name", f"tools.{i}.name")
        if not isinstance(tool.get("input_schema"), dict):
            raise _fail("a tool's input_schema is an object", f"tools.{i}.input_schema")
