"""``POST /v1/responses`` bodies checked against the contract, as ``protocol/chat.py`` checks chat requests.

Lenient where the translation is: unknown item and tool types pass (they are dropped), unknown fields pass.
Params are named as OpenAI names them for this API (``input[2].call_id``). Items, tools and tool choices are
checked by the model of their ``type``, picked by a function rather than a pydantic union: a union's errors
name its members in their location (``input.0.function_call.call_id``), not the field.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal, TypeVar, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)

from gateway.errors import APIError
from gateway.protocol.chat import JsonSchema, request_error

_Role = Literal["user", "assistant", "system", "developer"]
_ROLES: tuple[str, ...] = get_args(_Role)


class _Missing(ValueError):
    """Raised by a check here: the field counts as absent, and the 400 says it is missing."""


def _given(value: Any) -> Any:
    # SDKs send null for a field they leave unset: a null required field is a missing one
    if value is None:
        raise _Missing("required")
    return value


def _needed(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    # These fields have always been reported missing, not invalid, when not of their type: clients see no change
    try:
        return handler(value)
    except ValidationError:
        raise _Missing("required") from None


_T = TypeVar("_T")
_Given = Annotated[_T, BeforeValidator(_given)]  # required, null counting as absent
_Needed = Annotated[_T, WrapValidator(_needed)]  # required, a wrong value counting as absent
_NonEmpty = Annotated[str, Field(min_length=1)]


class _Strict(BaseModel):
    # Values are checked as the JSON has them, never coerced: "1" is no number here, nor 1 a boolean.
    model_config = ConfigDict(extra="allow", strict=True)


class _Typed(_Strict):
    type: _Given[str]


def _by_type(value: Any, models: dict[str, type[BaseModel]], what: str, message_by_role: bool = False) -> Any:
    """Check an item or a tool by the model of its ``type``; a type without one passes."""
    if not isinstance(value, dict):
        raise ValueError(f"expected {what} object.")
    kind = value.get("type")
    if kind is None and message_by_role and "role" in value:
        kind = "message"  # the SDK's ``EasyInputMessage``: a role and no type
    elif not isinstance(kind, str):
        _Typed.model_validate(value)  # names the fault: no type, or not a string
    model = models.get(kind)
    if model is not None:
        model.model_validate(value)
    return value


def _text_or_list(adapter: TypeAdapter[Any], why: str) -> Callable[[Any], Any]:
    """The check of a field holding a string or a list that ``adapter`` checks."""
    def check(value: Any) -> Any:
        if isinstance(value, list):
            return adapter.validate_python(value)
        if not isinstance(value, str):
            raise ValueError(why)
        return value
    return check


# --------------------------------------------------------------------------------------------- items


def _content_part(part: Any) -> Any:
    if not isinstance(part, str) and not (isinstance(part, dict) and isinstance(part.get("type"), str)):
        raise ValueError("expected a content part with a 'type'.")
    return part


_content = _text_or_list(TypeAdapter(list[Annotated[Any, AfterValidator(_content_part)]]),
                         "expected a string or an array of content parts.")


def _arguments(value: Any) -> Any:
    if value is not None and not isinstance(value, str | dict):
        raise ValueError("expected a JSON string.")
    return value


def _output(value: Any) -> Any:
    if not isinstance(value, str | list | dict):
        raise ValueError("expected a string or an array of content parts.")
    return value


class _MessageItem(_Strict):
    # No role is a wrong one, not a missing one: the default is checked as any role is.
    role: _Role = Field(None, validate_default=True)
    content: _Given[Annotated[Any, AfterValidator(_content)]]


class _FunctionCallItem(_Strict):
    call_id: _Given[_NonEmpty]
    name: _Given[_NonEmpty]
    arguments: Annotated[Any, AfterValidator(_arguments)] = None


class _CustomToolCallItem(_Strict):
    call_id: _Given[_NonEmpty]
    name: _Given[_NonEmpty]
    input: _Given[str]


class _ToolOutputItem(_Strict):
    call_id: _Given[_NonEmpty]
    output: _Given[Annotated[Any, AfterValidator(_output)]]


_ITEMS: dict[str, type[BaseModel]] = {
    "message": _MessageItem,
    "function_call": _FunctionCallItem,
    "custom_tool_call": _CustomToolCallItem,
    "function_call_output": _ToolOutputItem,
    "custom_tool_call_output": _ToolOutputItem,
}


def _input_item(value: Any) -> Any:
    return _by_type(value, _ITEMS, "an input item", message_by_role=True)


_input_value = _text_or_list(TypeAdapter(list[Annotated[Any, AfterValidator(_input_item)]]),
                       "expected a string or an array of input items.")


# --------------------------------------------------------------------------------------------- tools


def _tool(value: Any) -> Any:
    return _by_type(value, _TOOLS, "a tool")


_Tool = Annotated[Any, AfterValidator(_tool)]


class _FunctionTool(_Strict):
    name: _Given[_NonEmpty]
    parameters: JsonSchema | None = None


class _CustomTool(_Strict):
    name: _Given[_NonEmpty]


class _NamespaceTool(_Strict):
    name: _Given[_NonEmpty]
    tools: _Given[list[_Tool]]


_TOOLS: dict[str, type[BaseModel]] = {"function": _FunctionTool, "custom": _CustomTool, "namespace": _NamespaceTool}


class _NamedToolChoice(_Strict):
    name: _Needed[str]


class _AllowedToolsChoice(_Strict):
    tools: _Needed[list[Any]]


_CHOICE_MODES = ("auto", "none", "required")
_TOOL_CHOICES: dict[str, type[BaseModel]] = {
    "function": _NamedToolChoice, "custom": _NamedToolChoice, "allowed_tools": _AllowedToolsChoice}


def _tool_choice(value: Any) -> Any:
    if value is None or (isinstance(value, str) and value in _CHOICE_MODES):
        return value
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ValueError("expected 'auto', 'none', 'required' or a tool choice object.")
    model = _TOOL_CHOICES.get(value["type"])
    if model is not None:
        model.model_validate(value)
    return value


# ------------------------------------------------------------------------------------------ text.format


class _JsonSchemaFormat(_Strict):
    name: _Needed[_NonEmpty]
    schema_: _Needed[dict[str, Any]] = Field(alias="schema")


def _text_format(value: Any) -> Any:
    if value is None:
        return value
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_schema", "json_object"):
        raise ValueError("expected a format of type 'text', 'json_schema' or 'json_object'.")
    if value["type"] == "json_schema":
        _JsonSchemaFormat.model_validate(value)
    return value


class _Text(_Strict):
    format: Annotated[Any, AfterValidator(_text_format)] = None


class _TextFormat(_Strict):
    """``text`` once more, for its ``format`` alone: validated from the top so that a fault is located there."""

    text: _Text


# ------------------------------------------------------------------------------------------- request


class ResponsesRequest(_Strict):
    """A ``POST /v1/responses`` body. The fields are in the order they are checked: the first fault is
    the one reported."""

    model: _Given[_NonEmpty]
    previous_response_id: _NonEmpty | None = None
    input: Any = Field(None, validate_default=True)
    instructions: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_output_tokens: int | None = Field(None, ge=1)
    stream: bool | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None
    background: bool | None = None
    metadata: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    client_metadata: dict[str, Any] | None = None
    tools: list[_Tool] | None = None
    tool_choice: Annotated[Any, AfterValidator(_tool_choice)] = None

    @field_validator("input")
    @classmethod
    def _input(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            if not info.data.get("previous_response_id"):  # a continuation may add nothing
                raise _Missing("required")
            return value
        return _input_value(value)

    @model_validator(mode="after")
    def _text_format_last(self) -> ResponsesRequest:
        # After every field above, as it always came: a body with two faults is told the same one.
        if self.text is not None:
            _TextFormat.model_validate({"text": self.text})
        return self


def validate_responses_request(body: Any) -> None:
    """Check a decoded ``POST /v1/responses`` body; raise a 400 ``APIError`` that names the field."""
    if not isinstance(body, dict):
        raise APIError(400, "Request body must be a JSON object.")
    try:
        ResponsesRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, ValueError):  # a check of this module's: its own words, not "Value error, ..."
            err = {**err, "type": "missing" if isinstance(cause, _Missing) else err["type"], "msg": str(cause)}
        raise request_error(err, _param(err["loc"])) from None


def _param(loc: Sequence[int | str]) -> str | None:
    """``("input", 2, "call_id")`` as OpenAI writes it: ``input[2].call_id``."""
    param = ""
    for part in loc:
        param += f"[{part}]" if isinstance(part, int) else f".{part}" if param else part
    return param or None
