"""``POST /v1/responses`` bodies checked against the contract, as ``protocol/chat.py`` checks chat requests.

Item and content-part types are those OpenAI accepts (an unknown one is a 400 that lists them); those the
translation cannot give a chat backend (``reasoning``, ``compaction``) are accepted and dropped there, as are
tools of any type but ``function``, ``custom`` and ``namespace``. Unknown fields pass. Params are named as
OpenAI names them (``input[2].call_id``). Items, tools and tool choices are checked by the model of their
``type`` (``strict.check_type``).
"""

from __future__ import annotations

from collections.abc import Callable
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
    WithJsonSchema,
    WrapValidator,
    field_validator,
    model_validator,
)

from gateway.protocol.chat import JsonSchema
from gateway.protocol.strict import Missing, Strict, check_type, validate

_Role = Literal["user", "assistant", "system", "developer"]
_ROLES: tuple[str, ...] = get_args(_Role)


def _given(value: Any) -> Any:
    # SDKs send null for a field they leave unset: a null required field is a missing one
    if value is None:
        raise Missing()
    return value


def _needed(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    # These fields have always been reported missing, not invalid, when not of their type: clients see no change
    try:
        return handler(value)
    except ValidationError:
        raise Missing() from None


_T = TypeVar("_T")
_Given = Annotated[_T, BeforeValidator(_given)]  # required, null counting as absent
_Needed = Annotated[_T, WrapValidator(_needed)]  # required, a wrong value counting as absent
_NonEmpty = Annotated[str, Field(min_length=1)]


def _typed(value: Any, models: dict[str, type[BaseModel]], allowed: tuple[str, ...], what: str) -> Any:
    # the SDK's ``EasyInputMessage`` has a role and no type
    default = "message" if isinstance(value, dict) and "role" in value else None
    return check_type(value, models, allowed, what, default=default)


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


class _TextPart(Strict):
    text: _Given[str]


class _RefusalPart(Strict):
    refusal: _Given[str]


_PARTS: dict[str, type[BaseModel]] = {"input_text": _TextPart, "output_text": _TextPart, "summary_text": _TextPart,
                                      "reasoning_text": _TextPart, "refusal": _RefusalPart}
_PART_TYPES = (*_PARTS, "input_image", "input_file", "input_audio", "computer_screenshot")


def _content_part(part: Any) -> Any:
    return check_type(part, _PARTS, _PART_TYPES, "a content part")


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


class _MessageItem(Strict):
    # No role is a wrong one, not a missing one: the default is checked as any role is.
    role: _Role = Field(None, validate_default=True)
    content: _Given[Annotated[Any, AfterValidator(_content)]]


class _FunctionCallItem(Strict):
    call_id: _Given[_NonEmpty]
    name: _Given[_NonEmpty]
    arguments: Annotated[Any, AfterValidator(_arguments)] = None


class _CustomToolCallItem(Strict):
    call_id: _Given[_NonEmpty]
    name: _Given[_NonEmpty]
    input: _Given[str]


class _ToolOutputItem(Strict):
    call_id: _Given[_NonEmpty]
    output: _Given[Annotated[Any, AfterValidator(_output)]]


_ITEMS: dict[str, type[BaseModel]] = {
    "message": _MessageItem,
    "function_call": _FunctionCallItem,
    "custom_tool_call": _CustomToolCallItem,
    "function_call_output": _ToolOutputItem,
    "custom_tool_call_output": _ToolOutputItem,
}
# What OpenAI accepts as input items, and what Codex sends besides (its context compaction); the translation
# gives a chat backend messages, calls and their outputs, and drops the rest.
_ITEM_TYPES = (*_ITEMS, "local_shell_call", "local_shell_call_output", "shell_call", "shell_call_output",
               "apply_patch_call", "apply_patch_call_output", "reasoning", "compaction", "compaction_summary",
               "compaction_trigger", "item_reference", "additional_tools", "web_search_call", "file_search_call",
               "computer_call", "computer_call_output", "image_generation_call", "code_interpreter_call",
               "mcp_list_tools", "mcp_approval_request", "mcp_approval_response", "mcp_call", "tool_search_call",
               "tool_search_output")


def _input_item(value: Any) -> Any:
    return _typed(value, _ITEMS, _ITEM_TYPES, "an input item")


_input_value = _text_or_list(TypeAdapter(list[Annotated[Any, AfterValidator(_input_item)]]),
                       "expected a string or an array of input items.")

# What the checks accept, for the published OpenAPI document: these fields have no pydantic type of their own.
_STRING = {"type": "string"}
_ID = {"type": "string", "minLength": 1}
_CONTENT_SCHEMA = {"anyOf": [_STRING, {"type": "array", "items": {
    "type": "object", "required": ["type"],
    "properties": {"type": {"enum": list(_PART_TYPES)}, "text": _STRING, "refusal": _STRING}}}]}
_INPUT_SCHEMA = {"anyOf": [_STRING, {"type": "array", "items": {"type": "object", "properties": {
    "type": {"enum": list(_ITEM_TYPES)}, "role": {"enum": list(_ROLES)}, "content": _CONTENT_SCHEMA,
    "call_id": _ID, "name": _ID, "arguments": _STRING, "input": _STRING,
    "output": {"anyOf": [_STRING, {"type": "array"}]}}}}]}


# --------------------------------------------------------------------------------------------- tools


def _tool(value: Any) -> Any:
    # Any tool type passes: built-in ones come and go with each client release, and the translation drops
    # (and logs) what a chat backend cannot run rather than refusing the client's whole request.
    return _typed(value, _TOOLS, None, "a tool")


_Tool = Annotated[Any, AfterValidator(_tool), WithJsonSchema({"type": "object", "required": ["type"], "properties": {
    "type": _STRING, "name": _ID, "parameters": {"type": "object"}, "tools": {"type": "array"}}})]


class _FunctionTool(Strict):
    name: _Given[_NonEmpty]
    parameters: JsonSchema | None = None


class _CustomTool(Strict):
    name: _Given[_NonEmpty]


class _NamespaceTool(Strict):
    name: _Given[_NonEmpty]
    tools: _Given[list[_Tool]]


_TOOLS: dict[str, type[BaseModel]] = {"function": _FunctionTool, "custom": _CustomTool, "namespace": _NamespaceTool}


class _NamedToolChoice(Strict):
    name: _Needed[str]


class _AllowedToolsChoice(Strict):
    tools: _Needed[list[Any]]


_CHOICE_MODES = ("auto", "none", "required")
_TOOL_CHOICES: dict[str, type[BaseModel]] = {
    "function": _NamedToolChoice, "custom": _NamedToolChoice, "allowed_tools": _AllowedToolsChoice}


_TOOL_CHOICE_SCHEMA = {"anyOf": [{"enum": list(_CHOICE_MODES)}, {"type": "object", "required": ["type"], "properties": {
    "type": {"enum": [*_TOOL_CHOICES, "web_search_preview", "mcp"]}, "name": _STRING, "tools": {"type": "array"},
    "mode": {"enum": ["auto", "required"]}}}, {"type": "null"}]}


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


class _JsonSchemaFormat(Strict):
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


class _Text(Strict):
    format: Annotated[Any, AfterValidator(_text_format)] = None


class _TextFormat(Strict):
    """``text`` once more, for its ``format`` alone: validated from the top so that a fault is located there."""

    text: _Text


# ------------------------------------------------------------------------------------------- request


class ResponsesRequest(Strict):
    """A ``POST /v1/responses`` body. The fields are in the order they are checked: the first fault is
    the one reported."""

    # Published as required with ``model``: only a continuation may leave it out, which a schema cannot say.
    model_config = ConfigDict(extra="allow", strict=True,
                              json_schema_extra=lambda schema: schema.update(required=["model", "input"]))

    model: _Given[_NonEmpty]
    previous_response_id: _NonEmpty | None = None
    input: Annotated[Any, WithJsonSchema(_INPUT_SCHEMA)] = Field(None, validate_default=True)
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
    text: Annotated[dict[str, Any] | None, WithJsonSchema({"anyOf": [{"type": "object", "properties": {"format": {
        "type": "object", "required": ["type"], "properties": {
            "type": {"enum": ["text", "json_schema", "json_object"]}, "name": _ID,
            "schema": {"type": "object"}}}}}, {"type": "null"}]})] = None
    client_metadata: dict[str, Any] | None = None
    tools: list[_Tool] | None = None
    tool_choice: Annotated[Any, AfterValidator(_tool_choice), WithJsonSchema(_TOOL_CHOICE_SCHEMA)] = None

    @field_validator("input")
    @classmethod
    def _input(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            if not info.data.get("previous_response_id"):  # a continuation may add nothing
                raise Missing()
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
    validate(ResponsesRequest, body)
