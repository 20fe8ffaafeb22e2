"""``POST /v1/responses`` bodies checked before translation: a 400 that names the field."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.errors import APIError
from gateway.protocol.chat import _schema_problem


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
