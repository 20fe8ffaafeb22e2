"""The Responses API over chat completions: requests, responses and streams translated both ways.

Pure functions over dicts, like ``protocol/chat.py``; the API layer does the I/O. Field names follow the
``openai`` SDK's ``types/responses`` (the tests validate every object and event made here against it).

Requests (``responses_to_chat``)
    ``instructions`` become a leading ``system`` message, ``developer`` messages become ``system`` ones,
    ``input`` items become chat messages: ``function_call`` / ``custom_tool_call`` / ``local_shell_call``
    items become assistant ``tool_calls`` (consecutive calls, and the assistant text just before them,
    share one assistant message), their outputs become ``tool`` messages. Chat backends reject a history in
    which a tool call is not followed at once by its result, so results are moved next to their calls, a
    missing result is replaced by a ``tool`` message saying so, and a result whose call is absent is dropped.
    ``reasoning``, ``item_reference``, ``web_search_call`` and every other item type are dropped.

Tools
    ``function`` tools keep their names; ``namespace`` tools (Codex's MCP bundles) are flattened into
    functions named ``{namespace}__{name}`` (``{namespace}{name}`` when the namespace already ends in
    ``__``, as Codex's ``mcp__server__`` ones do); ``custom`` (freeform) tools such as Codex's
    ``apply_patch`` become functions taking one string argument ``input``. Built-in tools (``web_search``,
    ``file_search``, ``local_shell``, ``mcp``, ``tool_search``, anything unknown) cannot run on a chat
    backend: they are left out and listed in ``ToolMap.dropped``. A ``ToolMap`` remembers what each
    function sent to the backend stands for, so calls map back: a namespaced call comes back as a
    ``function_call`` with the tool's own ``name`` and a ``namespace`` field (as OpenAI sends them), a
    custom tool's call as a ``custom_tool_call`` carrying ``input``.

Responses (``chat_to_response``) and streams (``ResponseStream``)
    ``reasoning_content`` becomes a ``reasoning`` item (its text as a summary), text a ``message`` item,
    each tool call a ``function_call`` or ``custom_tool_call`` item, in that order. ``finish_reason``
    ``length`` makes the response ``incomplete`` (``max_output_tokens``). A stream always ends with
    ``response.completed`` -- also for an incomplete response, whose status says so: Codex treats OpenAI's
    ``response.incomplete`` event as a failed stream -- or with ``response.failed``.
"""

from __future__ import annotations

import copy
import hashlib
import re
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.errors import APIError
from gateway.protocol.chat import _schema_problem

# --------------------------------------------------------------------------------------------- tools

_NAME_OK = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_NAME_BAD_CHARS = re.compile(r"[^A-Za-z0-9_.\-]")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
LOCAL_SHELL_FUNCTION = "local_shell"
MISSING_OUTPUT = "No output was recorded for this tool call."


@dataclass(frozen=True)
class ToolEntry:
    """What one function sent to the backend stands for.

    ``kind``: ``"function"`` (a plain function tool), ``"namespace"`` (a function inside a namespace tool)
    or ``"custom"`` (a freeform tool, its ``namespace`` set when it came inside one).
    """

    kind: str
    name: str
    namespace: str | None = None


def flat_name(name: str, namespace: str | None = None) -> str:
    """The function name a (namespaced) tool gets on the backend, before de-duplication."""
    if namespace:
        name = f"{namespace}{'' if namespace.endswith('__') else '__'}{name}"
    name = _NAME_BAD_CHARS.sub("_", name) or "tool"
    if len(name) > 64:
        name = f"{name[:55]}_{hashlib.sha1(name.encode()).hexdigest()[:8]}"
    return name


class ToolMap:
    """How the client's tools were presented to the chat backend, so that calls map back.

    ``entries``: backend function name -> ``ToolEntry``. ``dropped``: the tools the backend cannot run
    (built-ins such as ``{"type": "web_search"}``), as the client sent them, in order.
    ``chat_tools``: the chat-completions ``tools`` list made from the rest.
    """

    def __init__(self) -> None:
        self.entries: dict[str, ToolEntry] = {}
        self.dropped: list[dict[str, Any]] = []
        self.chat_tools: list[dict[str, Any]] = []
        self._by_origin: dict[tuple[str | None, str], str] = {}

    @classmethod
    def from_tools(cls, tools: list[Any] | None) -> ToolMap:
        """The map for a Responses ``tools`` list (rebuilding it later gives the same names)."""
        tool_map = cls()
        tool_map.add_tools(tools)
        return tool_map

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, backend_name: object) -> bool:
        return backend_name in self.entries

    def get(self, backend_name: str) -> ToolEntry | None:
        return self.entries.get(backend_name)

    def entry_for(self, backend_name: str) -> ToolEntry:
        """The entry of a name the model called; a name no tool has (a hallucination) stays a function."""
        return self.entries.get(backend_name) or ToolEntry("function", backend_name)

    def find(self, name: str | None, namespace: str | None = None) -> str | None:
        """The backend name of a client-side tool (its own name and namespace), or ``None``."""
        if not isinstance(name, str) or not name:
            return None
        found = self._by_origin.get((namespace or None, name))
        if found:
            return found
        if not namespace:
            if name in self.entries:
                return name
            matches = [b for b, e in self.entries.items() if e.name == name]
            if len(matches) == 1:
                return matches[0]
        return None

    def backend_name(self, name: str, namespace: str | None = None) -> str:
        """As ``find``, falling back to the flattening rule for tools this request no longer has."""
        return self.find(name, namespace) or flat_name(name, namespace)

    # building

    def add_tools(self, tools: list[Any] | None) -> None:
        for tool in tools or ():
            if not isinstance(tool, dict):
                continue
            kind = tool.get("type")
            if kind == "function":
                self._add_function(tool, None)
            elif kind == "custom":
                self._add_custom(tool, None)
            elif kind == "namespace":
                namespace = tool.get("name") if isinstance(tool.get("name"), str) else ""
                for inner in tool.get("tools") or ():
                    inner_kind = inner.get("type") if isinstance(inner, dict) else None
                    if inner_kind == "function":
                        self._add_function(inner, namespace or None)
                    elif inner_kind == "custom":
                        self._add_custom(inner, namespace or None)
                    elif isinstance(inner, dict):
                        self.dropped.append({**inner, "namespace": namespace})
            else:
                self.dropped.append(tool)

    def _allocate(self, entry: ToolEntry) -> str:
        base = flat_name(entry.name, entry.namespace)
        name, n = base, 1
        while name in self.entries:
            n += 1
            suffix = f"_{n}"
            name = base[: 64 - len(suffix)] + suffix
        self.entries[name] = entry
        self._by_origin.setdefault((entry.namespace, entry.name), name)
        return name

    def _add_function(self, tool: dict[str, Any], namespace: str | None) -> None:
        original = tool.get("name")
        if not isinstance(original, str) or not original:
            return
        name = self._allocate(ToolEntry("namespace" if namespace else "function", original, namespace))
        function: dict[str, Any] = {"name": name}
        if isinstance(tool.get("description"), str) and tool["description"]:
            function["description"] = tool["description"]
        parameters = tool.get("parameters")
        function["parameters"] = parameters if isinstance(parameters, dict) else dict(_EMPTY_PARAMETERS)
        if isinstance(tool.get("strict"), bool):
            function["strict"] = tool["strict"]
        self.chat_tools.append({"type": "function", "function": function})

    def _add_custom(self, tool: dict[str, Any], namespace: str | None) -> None:
        original = tool.get("name")
        if not isinstance(original, str) or not original:
            return
        name = self._allocate(ToolEntry("custom", original, namespace))
        self.chat_tools.append({"type": "function", "function": {
            "name": name,
            "description": _custom_description(tool),
            "parameters": {"type": "object",
                           "properties": {"input": {"type": "string",
                                                    "description": "The complete free-form input of the tool."}},
                           "required": ["input"], "additionalProperties": False},
        }})


def _custom_description(tool: dict[str, Any]) -> str:
    parts = [tool["description"]] if isinstance(tool.get("description"), str) and tool["description"] else []
    parts.append("This tool takes free-form text, not JSON: pass the whole text as the string argument `input`.")
    fmt = tool.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "grammar" and fmt.get("definition"):
        syntax = fmt.get("syntax") or "lark"
        parts.append(f"The text must match this {syntax} grammar:\n```{syntax}\n{fmt['definition']}\n```")
    return "\n\n".join(parts)


def custom_input(arguments: Any) -> str:
    """The freeform text of a custom tool's call, from the arguments the backend produced.

    Lenient with weak models: ``{"input": text}`` is the contract, but a one-key object holding a string,
    a bare JSON string or text that is not JSON at all are taken as the text too.
    """
    value = arguments
    if isinstance(arguments, str):
        try:
            value = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            return arguments
    if isinstance(value, dict):
        if isinstance(value.get("input"), str):
            return value["input"]
        if len(value) == 1 and isinstance(next(iter(value.values())), str):
            return next(iter(value.values()))
    elif isinstance(value, str):
        return value
    return arguments if isinstance(arguments, str) else orjson.dumps(arguments).decode()


# ----------------------------------------------------------------------------------------- validation


def _missing(param: str) -> APIError:
    return APIError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")


def _invalid(param: str, why: str) -> APIError:
    return APIError(400, f"Invalid value for '{param}': {why}", param=param, code="invalid_value")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


_ROLES = ("user", "assistant", "system", "developer")


def validate_responses_request(body: Any) -> None:
    """Check a decoded ``POST /v1/responses`` body; raise a 400 ``APIError`` that names the field.

    Params are named as OpenAI names them for this API (``input[2].call_id``). Lenient where the
    translation is: unknown item and tool types pass (they are dropped), unknown fields pass.
    """
    if not isinstance(body, dict):
        raise APIError(400, "Request body must be a JSON object.")
    model = body.get("model")
    if model is None:
        raise _missing("model")
    if not isinstance(model, str) or not model:
        raise _invalid("model", "expected a non-empty string.")
    previous = body.get("previous_response_id")
    if previous is not None and (not isinstance(previous, str) or not previous):
        raise _invalid("previous_response_id", "expected a non-empty string.")
    inp = body.get("input")
    if inp is None:
        if not previous:
            raise _missing("input")
    elif isinstance(inp, list):
        for i, item in enumerate(inp):
            _check_item(item, f"input[{i}]")
    elif not isinstance(inp, str):
        raise _invalid("input", "expected a string or an array of input items.")
    if body.get("instructions") is not None and not isinstance(body["instructions"], str):
        raise _invalid("instructions", "expected a string.")
    for key, low, high, low_open in (("temperature", 0, 2, False), ("top_p", 0, 1, True)):
        value = body.get(key)
        if value is not None and (not _is_number(value) or value > high or value < low or (low_open and value == low)):
            raise _invalid(key, f"expected a number {'above' if low_open else 'from'} {low} to {high}.")
    if body.get("max_output_tokens") is not None and not (_is_int(body["max_output_tokens"])
                                                        and body["max_output_tokens"] >= 1):
        raise _invalid("max_output_tokens", "expected a positive integer.")
    for key in ("stream", "parallel_tool_calls", "store", "background"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise _invalid(key, "expected a boolean.")
    for key in ("metadata", "reasoning", "text", "client_metadata"):
        if body.get(key) is not None and not isinstance(body[key], dict):
            raise _invalid(key, "expected an object.")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _invalid("tools", "expected an array of tools.")
        for i, tool in enumerate(tools):
            _check_tool(tool, f"tools[{i}]")
    _check_tool_choice(body.get("tool_choice"))
    fmt = (body.get("text") or {}).get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_schema", "json_object"):
            raise _invalid("text.format", "expected a format of type 'text', 'json_schema' or 'json_object'.")
        if fmt["type"] == "json_schema":
            if not isinstance(fmt.get("name"), str) or not fmt["name"]:
                raise _missing("text.format.name")
            if not isinstance(fmt.get("schema"), dict):
                raise _missing("text.format.schema")


def _check_item(item: Any, path: str) -> None:
    if not isinstance(item, dict):
        raise _invalid(path, "expected an input item object.")
    kind = item.get("type")
    if kind is None:
        if "role" not in item:
            raise _missing(f"{path}.type")
        kind = "message"
    if not isinstance(kind, str):
        raise _invalid(f"{path}.type", "expected a string.")
    if kind == "message":
        if item.get("role") not in _ROLES:
            raise _invalid(f"{path}.role", f"expected one of {', '.join(_ROLES)}.")
        content = item.get("content")
        if content is None:
            raise _missing(f"{path}.content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, str):
                    continue
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise _invalid(f"{path}.content[{j}]", "expected a content part with a 'type'.")
        elif not isinstance(content, str):
            raise _invalid(f"{path}.content", "expected a string or an array of content parts.")
    elif kind in ("function_call", "custom_tool_call"):
        _require_str(item, "call_id", path)
        _require_str(item, "name", path)
        if kind == "custom_tool_call":
            if not isinstance(item.get("input"), str):
                raise _missing(f"{path}.input") if item.get("input") is None else _invalid(
                    f"{path}.input", "expected a string.")
        elif item.get("arguments") is not None and not isinstance(item["arguments"], str | dict):
            raise _invalid(f"{path}.arguments", "expected a JSON string.")
    elif kind in ("function_call_output", "custom_tool_call_output"):
        _require_str(item, "call_id", path)
        output = item.get("output")
        if output is None:
            raise _missing(f"{path}.output")
        if not isinstance(output, str | list | dict):
            raise _invalid(f"{path}.output", "expected a string or an array of content parts.")


def _require_str(item: dict[str, Any], key: str, path: str) -> None:
    value = item.get(key)
    if value is None:
        raise _missing(f"{path}.{key}")
    if not isinstance(value, str) or not value:
        raise _invalid(f"{path}.{key}", "expected a non-empty string.")


def _check_tool(tool: Any, path: str) -> None:
    if not isinstance(tool, dict):
        raise _invalid(path, "expected a tool object.")
    kind = tool.get("type")
    if not isinstance(kind, str):
        raise _missing(f"{path}.type") if kind is None else _invalid(f"{path}.type", "expected a string.")
    if kind in ("function", "custom"):
        _require_str(tool, "name", path)
        parameters = tool.get("parameters")
        if kind == "function" and parameters is not None:
            if not isinstance(parameters, dict):
                raise _invalid(f"{path}.parameters", "expected a JSON Schema object.")
            problem = _schema_problem(orjson.dumps(parameters, option=orjson.OPT_SORT_KEYS))
            if problem:
                raise _invalid(f"{path}.parameters", problem)
    elif kind == "namespace":
        _require_str(tool, "name", path)
        inner = tool.get("tools")
        if not isinstance(inner, list):
            raise _missing(f"{path}.tools") if inner is None else _invalid(f"{path}.tools", "expected an array.")
        for j, sub in enumerate(inner):
            _check_tool(sub, f"{path}.tools[{j}]")


def _check_tool_choice(choice: Any) -> None:
    if choice is None:
        return
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise _invalid("tool_choice", "expected 'auto', 'none', 'required' or a tool choice object.")
        return
    if not isinstance(choice, dict) or not isinstance(choice.get("type"), str):
        raise _invalid("tool_choice", "expected 'auto', 'none', 'required' or a tool choice object.")
    if choice["type"] in ("function", "custom") and not isinstance(choice.get("name"), str):
        raise _missing("tool_choice.name")
    if choice["type"] == "allowed_tools" and not isinstance(choice.get("tools"), list):
        raise _missing("tool_choice.tools")


# ------------------------------------------------------------------------------- request translation


def responses_to_chat(body: dict[str, Any], history: list[dict[str, Any]] | None = None
                      ) -> tuple[dict[str, Any], ToolMap]:
    """A validated Responses request as a chat-completions request, and the map of its tools.

    ``history``: the chat messages of the conversation so far when the request continues an earlier
    response (``previous_response_id``) -- ``conversation_messages(...)`` of that response's request plus
    ``output_to_chat_messages(...)`` of that response; they go after the instructions, before the input.
    ``stream`` / ``stream_options`` are left to the caller. Raises a 400 when nothing is left to send.
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
    messages = _pair_tool_results(messages)
    if not messages:
        raise APIError(400, "The request has no input to send to the model.", param="input", code="invalid_value")

    chat: dict[str, Any] = {"model": body["model"], "messages": messages}
    tools = tool_map.chat_tools
    choice = _tool_choice(body.get("tool_choice"), tool_map)
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
        return {"type": "function", "function": {"name": name}} if name else "auto"
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


def _pair_tool_results(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each assistant message with tool calls followed at once by one result per call, in call order."""
    results: dict[str, list[dict[str, Any]]] = {}
    for message in messages:
        if message.get("role") == "tool":
            results.setdefault(message.get("tool_call_id") or "", []).append(message)
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "tool":
            continue  # placed after its call below, or dropped when its call is absent
        calls = message.get("tool_calls") if role == "assistant" else None
        if role == "assistant" and not calls:
            message.pop("tool_calls", None)
            if not _text_of(message.get("content")):
                continue  # an empty assistant turn (say, only reasoning) is nothing to a backend
        out.append(message)
        if not calls:
            continue
        images: list[dict[str, Any]] = []
        for call in calls:
            queue = results.get(call.get("id") or "")
            result = dict(queue.pop(0)) if queue else {"role": "tool", "tool_call_id": call.get("id") or "",
                                                        "content": MISSING_OUTPUT}
            images += result.pop("_images", None) or []
            out.append(result)
        if images:  # chat tool messages cannot hold images; they follow as the user's
            out.append({"role": "user", "content": [{"type": "text", "text": "Images returned by the tool calls:"},
                                                    *images]})
    return out


# ------------------------------------------------------------------------------ response translation


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


# ------------------------------------------------------------------------------------------- streams


class _Slot:
    """One chat tool call (by its ``index``) on its way to becoming an output item."""

    def __init__(self) -> None:
        self.call_id: str | None = None
        self.name: list[str] = []
        self.arguments: list[str] = []
        self.item: dict[str, Any] | None = None  # set once announced (``output_item.added``)
        self.output_index = -1
        self.closed = False


class ResponseStream:
    """Chat-completion chunks in, Responses stream events out: a pure state machine.

    ``start()`` gives ``response.created`` and ``response.in_progress``; ``feed(chunk)`` the events a
    chunk causes; then the caller MUST call exactly one of ``finish()`` (``response.completed``, with the
    usage of the stream's usage chunk) or ``fail(code, message)`` (``response.failed``), or the client sees
    a stream without an end -- Codex treats that as an error. Calls after the end give no events.
    ``feed``/``finish``/``fail`` start the stream themselves if ``start`` was not called.

    Every event is a dict with ``type`` and a ``sequence_number`` counting from 0. One output item is open
    at a time and closed before the next opens (text after a tool call starts a new message item). A
    function call's arguments stream as ``response.function_call_arguments.delta`` events; a custom tool's
    input is only known once its JSON arguments are complete, so it comes as one
    ``response.custom_tool_call_input.delta`` when the call closes. Tool-call fragments are expected in
    order of ``index``, as OpenAI-compatible servers send them; a fragment for a call already closed only
    updates the final response object.

    ``response``: the response object as it stands; final after ``finish``/``fail``.
    """

    def __init__(self, *, response_id: str, request: dict[str, Any], tool_map: ToolMap, created_at: int) -> None:
        self._request = request
        self._tool_map = tool_map
        self._ids = _Ids(response_id)
        self.response = _response_object(response_id=response_id, request=request, created_at=created_at,
                                         status="in_progress", output=[])
        self._seq = 0
        self._started = False
        self._ended = False
        self._current: tuple[str, Any] | None = None  # ("message" | "reasoning", item) or ("tool", _Slot)
        self._text: list[str] = []
        self._slots: dict[int, _Slot] = {}
        self._finish_reason: str | None = None
        self._usage: dict[str, Any] | None = None

    @property
    def ended(self) -> bool:
        return self._ended

    # events

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _snapshot_event(self, kind: str) -> dict[str, Any]:
        """An event carrying the response as it stands. The echoed request fields (tools, instructions:
        often tens of kilobytes) are never changed here, so they are shared rather than copied."""
        snapshot = {**self.response, "output": copy.deepcopy(self.response["output"]),
                    "usage": copy.deepcopy(self.response["usage"]), "error": copy.deepcopy(self.response["error"])}
        return self._event(kind, response=snapshot)

    def start(self) -> list[dict[str, Any]]:
        if self._started:
            return []
        self._started = True
        return [self._snapshot_event("response.created"), self._snapshot_event("response.in_progress")]

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if self._ended:
            return []
        out = self.start()
        if chunk.get("usage"):
            self._usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            if (choice.get("index") or 0) != 0:
                continue  # one response per request: the first choice
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                out += self._reasoning_delta(reasoning)
            text = delta.get("content") or delta.get("refusal")
            if isinstance(text, str) and text:
                out += self._text_delta(text)
            for fragment in delta.get("tool_calls") or ():
                out += self._tool_fragment(fragment)
            if choice.get("finish_reason"):
                self._finish_reason = choice["finish_reason"]
        return out

    def finish(self) -> list[dict[str, Any]]:
        if self._ended:
            return []
        out = self.start()
        status, incomplete = _final_status(self._finish_reason)
        out += self._close_current("incomplete" if incomplete else "completed")
        self._ended = True
        self.response.update(status=status, incomplete_details=incomplete, usage=response_usage(self._usage))
        out.append(self._snapshot_event("response.completed"))
        return out

    def fail(self, code: str, message: str) -> list[dict[str, Any]]:
        """End with ``response.failed``; an item left open stays in ``output`` as ``incomplete``, without
        further events. Codes as OpenAI's: ``context_length_exceeded``, ``rate_limit_exceeded`` (with
        "try again in Ns" in the message, which Codex reads), ``insufficient_quota``, ``server_error``..."""
        if self._ended:
            return []
        out = self.start()
        current, self._current = self._current, None
        if current is not None:
            kind, value = current
            if kind == "message":
                value.update(status="incomplete", content=[_text_part("".join(self._text))])
            elif kind == "reasoning":
                value["summary"] = [{"type": "summary_text", "text": "".join(self._text)}]
            elif kind == "tool" and value.item is not None:
                self._settle_call(value, "incomplete")
        self._ended = True
        self.response.update(status="failed", error={"code": code, "message": message},
                             usage=response_usage(self._usage))
        out.append(self._snapshot_event("response.failed"))
        return out

    # items

    def _open(self, item: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        output = self.response["output"]
        output.append(item)
        index = len(output) - 1
        return index, self._event("response.output_item.added", output_index=index, item=copy.deepcopy(item))

    def _index_of(self, item: dict[str, Any]) -> int:
        output = self.response["output"]
        return next(i for i in range(len(output) - 1, -1, -1) if output[i] is item)

    def _text_delta(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._current is None or self._current[0] != "message":
            out += self._close_current("completed")
            item = _message_item(self._ids.next("msg"), None, "in_progress")
            index, added = self._open(item)
            out.append(added)
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part=_text_part("")))
            self._current, self._text = ("message", item), []
        item = self._current[1]
        self._text.append(text)
        out.append(self._event("response.output_text.delta", item_id=item["id"], output_index=self._index_of(item),
                               content_index=0, delta=text, logprobs=[]))
        return out

    def _reasoning_delta(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._current is None or self._current[0] != "reasoning":
            out += self._close_current("completed")
            item = _reasoning_item(self._ids.next("rs"), None)
            index, added = self._open(item)
            out.append(added)
            out.append(self._event("response.reasoning_summary_part.added", item_id=item["id"], output_index=index,
                                   summary_index=0, part={"type": "summary_text", "text": ""}))
            self._current, self._text = ("reasoning", item), []
        item = self._current[1]
        self._text.append(text)
        out.append(self._event("response.reasoning_summary_text.delta", item_id=item["id"],
                               output_index=self._index_of(item), summary_index=0, delta=text))
        return out

    def _tool_fragment(self, fragment: dict[str, Any]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        index = fragment.get("index")
        if not isinstance(index, int):
            current = self._current[1] if self._current and self._current[0] == "tool" else None
            index = next((i for i, s in self._slots.items() if s is current), len(self._slots))
        slot = self._slots.get(index)
        if slot is None:
            out += self._close_current("completed")
            slot = self._slots[index] = _Slot()
            self._current = ("tool", slot)
        function = fragment.get("function") or {}
        arguments = function.get("arguments") if isinstance(function.get("arguments"), str) else ""
        if slot.closed:  # a late fragment of a call already closed (servers send calls in order; rare)
            if arguments and slot.item is not None:
                slot.arguments.append(arguments)
                self._settle_call(slot, slot.item.get("status") or "completed")
            return out
        if fragment.get("id") and not slot.call_id:
            slot.call_id = fragment["id"]
        if function.get("name") and slot.item is None:
            slot.name.append(function["name"])
        if arguments:
            slot.arguments.append(arguments)
            if slot.item is None and slot.name:
                out += self._announce(slot)
            elif slot.item is not None and slot.item["type"] == "function_call":
                out.append(self._event("response.function_call_arguments.delta", item_id=slot.item["id"],
                                       output_index=slot.output_index, delta=arguments))
        return out

    def _announce(self, slot: _Slot) -> list[dict[str, Any]]:
        """``output_item.added`` for a call, once its name is known (and what arguments came with it)."""
        entry = self._tool_map.entry_for("".join(slot.name))
        slot.item = _call_item(self._ids, entry, slot.call_id, "in_progress")
        slot.output_index, added = self._open(slot.item)
        out = [added]
        if slot.arguments and slot.item["type"] == "function_call":
            out.append(self._event("response.function_call_arguments.delta", item_id=slot.item["id"],
                                   output_index=slot.output_index, delta="".join(slot.arguments)))
        return out

    def _settle_call(self, slot: _Slot, status: str) -> None:
        assert slot.item is not None
        arguments = "".join(slot.arguments)
        slot.item["status"] = status
        if slot.item["type"] == "custom_tool_call":
            slot.item["input"] = custom_input(arguments) if arguments else ""
        else:
            slot.item["arguments"] = arguments

    def _close_current(self, status: str) -> list[dict[str, Any]]:
        current, self._current = self._current, None
        if current is None:
            return []
        kind, value = current
        out: list[dict[str, Any]] = []
        if kind == "message":
            item, text = value, "".join(self._text)
            index = self._index_of(item)
            part = _text_part(text)
            out.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=text, logprobs=[]))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=copy.deepcopy(part)))
            item.update(status=status, content=[part])
        elif kind == "reasoning":
            item, text = value, "".join(self._text)
            index = self._index_of(item)
            part = {"type": "summary_text", "text": text}
            out.append(self._event("response.reasoning_summary_text.done", item_id=item["id"], output_index=index,
                                   summary_index=0, text=text))
            out.append(self._event("response.reasoning_summary_part.done", item_id=item["id"], output_index=index,
                                   summary_index=0, part=dict(part)))
            item["summary"] = [part]
        else:
            slot: _Slot = value
            slot.closed = True
            if slot.item is None:
                if not slot.name and not slot.arguments:
                    return []  # a fragment with nothing in it
                if not slot.name:
                    slot.name.append("")
                out += self._announce(slot)
            item, index = slot.item, slot.output_index
            assert item is not None
            self._settle_call(slot, status)
            if item["type"] == "custom_tool_call":
                if item["input"]:
                    out.append(self._event("response.custom_tool_call_input.delta", item_id=item["id"],
                                           output_index=index, delta=item["input"]))
                out.append(self._event("response.custom_tool_call_input.done", item_id=item["id"],
                                       output_index=index, input=item["input"]))
            else:
                out.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                       output_index=index, arguments=item["arguments"]))
        out.append(self._event("response.output_item.done", output_index=self._index_of(item),
                               item=copy.deepcopy(item)))
        return out


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
