"""Responses requests as chat-completions requests.

``instructions`` become a leading ``system`` message, ``developer`` messages become ``system`` ones,
``input`` items become chat messages: ``function_call`` / ``custom_tool_call`` / ``local_shell_call``
items become assistant ``tool_calls`` (consecutive calls, and the assistant text just before them,
share one assistant message), their outputs become ``tool`` messages. Chat backends reject a history in
which a tool call is not followed at once by its result, so results are moved next to their calls; a call
without its output, or an output without its call, is a 400, as OpenAI answers it.
A ``compaction`` item this gateway made (``compaction.py``) becomes the user message holding its summary;
``reasoning``, ``item_reference``, ``web_search_call``, a compaction item made elsewhere and every other item type
are dropped.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.errors import APIError
from gateway.protocol.responses.compaction import ITEM_TYPES as COMPACTION_ITEMS
from gateway.protocol.responses.compaction import summary_message, summary_of
from gateway.protocol.responses.tools import ToolMap
from gateway.protocol.responses.validation import _ROLES

LOCAL_SHELL_FUNCTION = "local_shell"


def responses_to_chat(body: dict[str, Any], history: list[dict[str, Any]] | None = None, *,
                      lenient: bool = False) -> tuple[dict[str, Any], ToolMap]:
    """A validated Responses request as a chat-completions request, and the map of its tools.

    ``history``: the chat messages of the conversation so far when the request continues an earlier
    response (``previous_response_id``) -- ``conversation_messages(...)`` of that response's request plus
    ``output_to_chat_messages(...)`` of that response; they go after the instructions, before the input.
    ``stream`` / ``stream_options`` are left to the caller. Raises a 400 when nothing is left to send.
    ``lenient``: for the record of a request passed through as it came (whose upstream may hold what the request
    refers to): a call without its output or an output without its call is left out, a tool choice naming no tool
    is ``auto``, and no message at all is no error.
    """
    tool_map = ToolMap()
    inp = body.get("input")
    items = inp if isinstance(inp, list) else []
    extra_tools = [t for item in items if isinstance(item, dict) and item.get("type") == "additional_tools"
                   for t in (item.get("tools") or ())]
    tool_map.add_tools(list(body.get("tools") or ()) + extra_tools)

    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        messages.append({"role": "system", "content": instructions})
    for message in history or ():
        message = dict(message)
        if message.get("role") == "developer":
            message["role"] = "system"
        messages.append(message)
    if isinstance(inp, str):
        messages.append({"role": "user", "content": inp})
    else:
        messages += _items_to_messages(items, tool_map)
    messages = _pair_tool_results(messages, lenient)
    if not messages and not lenient:
        raise APIError(400, "The request has no input to send to the model.", param="input", code="invalid_value")

    chat: dict[str, Any] = {"model": body["model"], "messages": messages}
    tools = tool_map.chat_tools
    try:
        choice = _tool_choice(body.get("tool_choice"), tool_map)
    except APIError:
        if not lenient:
            raise
        choice = "auto"
    if isinstance(choice, tuple):  # allowed_tools: a mode and the names it allows
        mode, allowed = choice
        tools = [t for t in tools if t["function"]["name"] in allowed]
        choice = mode
    if tools:
        chat["tools"] = tools
        if choice is not None:
            chat["tool_choice"] = choice
        if isinstance(body.get("parallel_tool_calls"), bool):
            chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            chat[key] = body[key]
    response_format = _response_format((body.get("text") or {}).get("format"))
    if response_format:
        chat["response_format"] = response_format
    return chat, tool_map


def conversation_messages(chat_body: dict[str, Any], request: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of a request without its ``instructions`` message: what a later request that
    names this response as ``previous_response_id`` carries over (instructions are not carried over)."""
    messages = list(chat_body.get("messages") or ())
    if isinstance(request.get("instructions"), str) and request["instructions"] and messages:
        return messages[1:]
    return messages


def _tool_choice(choice: Any, tool_map: ToolMap) -> Any:
    if choice is None:
        return None
    if isinstance(choice, str):
        return choice if choice in ("auto", "none", "required") else "auto"
    if not isinstance(choice, dict):
        return "auto"
    kind = choice.get("type")
    if kind in ("function", "custom"):
        name = tool_map.find(choice.get("name"), choice.get("namespace"))
        if not name:
            raise APIError(400, f"Tool choice '{kind}' with name '{str(choice.get('name'))[:64]}' not found in "
                                "'tools' parameter.", param="tool_choice", code="invalid_value")
        return {"type": "function", "function": {"name": name}}
    if kind == "allowed_tools":
        allowed: set[str] = set()
        for ref in choice.get("tools") or ():
            if not isinstance(ref, dict):
                continue
            if ref.get("type") in ("function", "custom"):
                name = tool_map.find(ref.get("name"), ref.get("namespace"))
                if name:
                    allowed.add(name)
            elif ref.get("type") == "namespace":
                allowed.update(b for b, e in tool_map.entries.items() if e.namespace == ref.get("name"))
        mode = choice.get("mode") if choice.get("mode") in ("auto", "required") else "auto"
        return mode, allowed
    return "auto"  # a built-in tool's choice (web_search_preview, mcp, ...): its tool was dropped


def _response_format(fmt: Any) -> dict[str, Any] | None:
    if not isinstance(fmt, dict):
        return None
    if fmt.get("type") == "json_schema":
        schema: dict[str, Any] = {"name": fmt.get("name") or "response", "schema": fmt.get("schema") or {}}
        if isinstance(fmt.get("strict"), bool):
            schema["strict"] = fmt["strict"]
        if isinstance(fmt.get("description"), str):
            schema["description"] = fmt["description"]
        return {"type": "json_schema", "json_schema": schema}
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    return None


_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def _content(content: Any, role: str) -> str | list[dict[str, Any]]:
    """Responses message content as chat content: a string, or a list of parts when it has images."""
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for part in content if isinstance(content, list) else ():
        if isinstance(part, str):
            parts.append({"type": "text", "text": part})
            continue
        if not isinstance(part, dict):
            continue
        kind = part.get("type")
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind in ("input_image", "image_url"):
            url = part.get("image_url")
            if isinstance(url, dict):
                url = url.get("url")
            if isinstance(url, str) and url and role == "user":
                image: dict[str, Any] = {"url": url}
                if part.get("detail") in ("low", "high", "auto"):
                    image["detail"] = part["detail"]
                parts.append({"type": "image_url", "image_url": image})
            else:
                ref = part.get("file_id") or "image"
                parts.append({"type": "text", "text": f"[{ref}: image not available to this model]"})
        elif kind == "input_file":
            ref = part.get("filename") or part.get("file_id") or part.get("file_url") or "file"
            parts.append({"type": "text", "text": f"[{ref}: file not available to this model]"})
        elif kind == "input_audio":
            parts.append({"type": "text", "text": "[audio not available to this model]"})
    if any(p["type"] != "text" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def _output_content(output: Any) -> tuple[str, list[dict[str, Any]]]:
    """A tool output (string or content list) as tool-message text plus any images it carried."""
    if isinstance(output, str):
        return output, []
    if isinstance(output, dict):
        return orjson.dumps(output).decode(), []
    content = _content(output, "user")
    if isinstance(content, str):
        return content, []
    text = "\n".join(p["text"] for p in content if p["type"] == "text")
    return text, [p for p in content if p["type"] != "text"]


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def _items_to_messages(items: list[Any], tool_map: ToolMap | None) -> list[dict[str, Any]]:
    tool_map = tool_map or ToolMap()
    messages: list[dict[str, Any]] = []
    for item in items:
        if not isinstance(item, dict):
            continue
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                continue
            content = _content(item.get("content"), role)
            if role == "assistant":
                messages.append({"role": "assistant", "content": _text_of(content) or None})
            else:
                messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "function_call":
            arguments = item.get("arguments")
            if not isinstance(arguments, str):
                arguments = orjson.dumps(arguments).decode() if arguments is not None else "{}"
            name = tool_map.backend_name(item.get("name") or "", item.get("namespace"))
            _add_call(messages, item.get("call_id") or item.get("id") or "", name, arguments)
        elif kind == "custom_tool_call":
            name = tool_map.backend_name(item.get("name") or "", item.get("namespace"))
            arguments = orjson.dumps({"input": item.get("input") or ""}).decode()
            _add_call(messages, item.get("call_id") or item.get("id") or "", name, arguments)
        elif kind == "local_shell_call":
            action = {k: v for k, v in (item.get("action") or {}).items() if k != "type" and v is not None}
            _add_call(messages, item.get("call_id") or item.get("id") or "", LOCAL_SHELL_FUNCTION,
                      orjson.dumps(action).decode())
        elif kind in ("function_call_output", "custom_tool_call_output", "local_shell_call_output"):
            call_id = item.get("call_id") or (item.get("id") if kind == "local_shell_call_output" else None)
            text, images = _output_content(item.get("output"))
            message: dict[str, Any] = {"role": "tool", "tool_call_id": call_id or "", "content": text}
            if images:
                message["_images"] = images
            messages.append(message)
        elif kind in COMPACTION_ITEMS:
            summary = summary_of(item)
            if summary is not None:
                messages.append(summary_message(summary))
        # reasoning, item_reference, web_search_call, additional_tools (its tools are taken above) and any
        # other item type: nothing a chat backend can be given
    return messages


def _add_call(messages: list[dict[str, Any]], call_id: str, name: str, arguments: str) -> None:
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is not None and last.get("role") == "assistant":
        last["tool_calls"] = [*(last.get("tool_calls") or ()), call]  # same turn: text and calls share one message
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _pair_tool_results(messages: list[dict[str, Any]], lenient: bool = False) -> list[dict[str, Any]]:
    """Each assistant message with tool calls followed at once by one result per call, in call order (``lenient``:
    what cannot be paired is left out rather than refused)."""
    results: dict[str, list[dict[str, Any]]] = {}
    for message in messages:
        if message.get("role") == "tool":
            results.setdefault(message.get("tool_call_id") or "", []).append(message)
    made = {call.get("id") or "" for m in messages if m.get("role") == "assistant"
            for call in m.get("tool_calls") or ()}
    orphans = sorted(results.keys() - made)
    if orphans and not lenient:
        raise APIError(400, f"No tool call found for function call output with call_id {orphans[0][:64]}.",
                       param="input")
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "tool":
            continue  # placed after its call below
        calls = message.get("tool_calls") if role == "assistant" else None
        if role == "assistant" and not calls:
            message.pop("tool_calls", None)
            if not _text_of(message.get("content")):
                continue  # an empty assistant turn (say, only reasoning) is nothing to a backend
        if lenient and calls:
            calls = message["tool_calls"] = [c for c in calls if results.get(c.get("id") or "")]
            if not calls:
                message.pop("tool_calls")
                if not _text_of(message.get("content")):
                    continue
        out.append(message)
        if not calls:
            continue
        images: list[dict[str, Any]] = []
        for call in calls:
            queue = results.get(call.get("id") or "")
            if not queue:
                if lenient:
                    continue
                raise APIError(400, f"No tool output found for function call {(call.get('id') or '')[:64]}.",
                               param="input")
            result = dict(queue.pop(0))
            images += result.pop("_images", None) or []
            out.append(result)
        if images:  # chat tool messages cannot hold images; they follow as the user's
            out.append({"role": "user", "content": [{"type": "text", "text": "Images returned by the tool calls:"},
                                                    *images]})
    return out
