"""Chat-completions requests and streams: validation, and assembly of chunks into a completion.

Pure functions over dicts; the API layer does the I/O.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Annotated, Any, Literal

import orjson
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import AfterValidator, BaseModel, Field, TypeAdapter, WithJsonSchema, field_validator, model_validator

from gateway.protocol.strict import Fault, Missing, Strict, check_type, validate

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


def _valid_schema(value: dict[str, Any]) -> dict[str, Any]:
    problem = _schema_problem(orjson.dumps(value, option=orjson.OPT_SORT_KEYS))
    if problem:
        raise ValueError(problem)
    return value


@lru_cache(maxsize=4096)
def _schema_problem(schema_json: bytes) -> str | None:
    """Checking a schema costs hundreds of microseconds; clients resend the same tools every turn."""
    try:
        Draft202012Validator.check_schema(orjson.loads(schema_json))
    except SchemaError as exc:
        path = "/".join(str(p) for p in exc.path) or "(root)"
        return f"not a valid JSON Schema at {path}: {exc.message}"
    return None


# A tool's parameters: an object that is itself a valid JSON Schema.
JsonSchema = Annotated[dict[str, Any], AfterValidator(_valid_schema)]
_NAME_PATTERN = r"^[A-Za-z0-9_.\-]{1,64}$"
_Name = Annotated[str, Field(pattern=_NAME_PATTERN)]


class _Function(Strict):
    name: _Name
    description: str | None = None
    parameters: JsonSchema | None = None
    strict: bool | None = None


class _Tool(Strict):
    type: Literal["function"]
    function: _Function


# ------------------------------------------------------------------------------------------- messages


class _TextPart(Strict):
    text: str


class _ImageURL(Strict):
    url: str


class _ImagePart(Strict):
    image_url: _ImageURL


class _Audio(Strict):
    data: str
    format: str


class _AudioPart(Strict):
    input_audio: _Audio


class _FilePart(Strict):
    file: dict[str, Any]


class _RefusalPart(Strict):
    refusal: str


_PARTS: dict[str, type[BaseModel]] = {"text": _TextPart, "image_url": _ImagePart, "input_audio": _AudioPart,
                                      "file": _FilePart, "refusal": _RefusalPart}
_parts = TypeAdapter(list[Annotated[Any, AfterValidator(lambda p: check_type(p, _PARTS, tuple(_PARTS),
                                                                             "a content part"))]])


_STRING = {"type": "string"}
_OBJECT = {"type": "object"}
_PART_SCHEMA = {"oneOf": [
    {"type": "object", "required": ["type", "text"], "properties": {"type": {"const": "text"}, "text": _STRING}},
    {"type": "object", "required": ["type", "image_url"], "properties": {
        "type": {"const": "image_url"},
        "image_url": {"type": "object", "required": ["url"], "properties": {"url": _STRING}}}},
    {"type": "object", "required": ["type", "input_audio"], "properties": {
        "type": {"const": "input_audio"},
        "input_audio": {"type": "object", "required": ["data", "format"], "properties": {"data": _STRING,
                                                                                        "format": _STRING}}}},
    {"type": "object", "required": ["type", "file"], "properties": {"type": {"const": "file"}, "file": _OBJECT}},
    {"type": "object", "required": ["type", "refusal"], "properties": {"type": {"const": "refusal"},
                                                                       "refusal": _STRING}}]}
# What the checks below accept, for the published OpenAPI document: the fields they check have no pydantic type.
CONTENT_SCHEMA = {"anyOf": [_STRING, {"type": "array", "items": _PART_SCHEMA}]}
# A message by its role: what each role needs (that each tool message answers a call is beyond a schema).
_CALL_SCHEMA = {"type": "object", "required": ["id", "type", "function"], "properties": {
    "id": {"type": "string", "minLength": 1}, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name", "arguments"], "properties": {"name": _STRING,
                                                                                    "arguments": _STRING}}}}
MESSAGE_SCHEMA = {"oneOf": [
    {"type": "object", "required": ["role", "content"], "properties": {
        "role": {"enum": ["system", "developer", "user"]}, "content": CONTENT_SCHEMA, "name": _STRING}},
    {"type": "object", "required": ["role"], "properties": {
        "role": {"const": "assistant"}, "content": {"anyOf": [CONTENT_SCHEMA, {"type": "null"}]},
        "tool_calls": {"type": "array", "items": _CALL_SCHEMA}}},
    {"type": "object", "required": ["role", "tool_call_id", "content"], "properties": {
        "role": {"const": "tool"}, "tool_call_id": {"type": "string", "minLength": 1}, "content": CONTENT_SCHEMA}}]}


def _content(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        _parts.validate_python(value)
        return value
    raise Fault("expected a string or an array of content parts.", code="invalid_type")


class _CalledFunction(Strict):
    name: str
    arguments: str


class _ToolCall(Strict):
    id: Annotated[str, Field(min_length=1)]
    type: Literal["function"]
    function: _CalledFunction


class _Message(Strict):
    role: Role
    content: Annotated[Any, AfterValidator(_content)] = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _what_the_role_needs(self) -> _Message:
        if self.role == "tool" and not self.tool_call_id:
            raise Missing(("tool_call_id",))
        if self.content is None and not (self.role == "assistant" or self.role == "function"):
            raise Missing(("content",))
        return self


def _paired(messages: list[_Message]) -> list[_Message]:
    """Each assistant message with tool calls followed at once by a tool message for each call, and no tool
    message that answers none: a history that pairs is the only kind a trajectory can be trained on."""
    pending: dict[str, int] = {}  # call id -> the index of the assistant message that made it
    for i, message in enumerate(messages):
        if message.role == "tool":
            if message.tool_call_id not in pending:
                raise Fault("Invalid parameter: messages with role 'tool' must be a response to a preceding "
                            "message with 'tool_calls'.", (i, "role"))
            del pending[message.tool_call_id]
            continue
        if pending:
            break
        pending = {call.id: i for call in message.tool_calls or ()} if message.role == "assistant" else {}
    if pending:
        made_at = next(iter(pending.values()))
        raise Fault("An assistant message with 'tool_calls' must be followed by tool messages responding to each "
                    "'tool_call_id'. The following tool_call_ids did not have response messages: "
                    f"{', '.join(pending)}.", (made_at, "role"))
    return messages


# A conversation as chat completions take it: at least one message, every tool call answered.
Messages = Annotated[list[Annotated[_Message, WithJsonSchema(MESSAGE_SCHEMA)]], Field(min_length=1),
                     AfterValidator(_paired)]


# --------------------------------------------------------------------------------------------- options


class _StreamOptions(Strict):
    include_usage: bool = False


class _NamedFunction(Strict):
    name: str


class _NamedToolChoice(Strict):
    type: Literal["function"]
    function: _NamedFunction


class _AllowedTools(Strict):
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]


class _AllowedToolsChoice(Strict):
    type: Literal["allowed_tools"]
    allowed_tools: _AllowedTools


_CHOICES: dict[str, type[BaseModel]] = {"function": _NamedToolChoice, "allowed_tools": _AllowedToolsChoice}


_TOOL_CHOICE_SCHEMA = {"anyOf": [
    {"enum": ["none", "auto", "required"]},
    {"type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"},
        "function": {"type": "object", "required": ["name"], "properties": {"name": _STRING}}}},
    {"type": "object", "required": ["type", "allowed_tools"], "properties": {
        "type": {"const": "allowed_tools"},
        "allowed_tools": {"type": "object", "required": ["mode", "tools"], "properties": {
            "mode": {"enum": ["auto", "required"]}, "tools": {"type": "array", "items": _OBJECT}}}}},
    {"type": "null"}]}


def _tool_choice(value: Any) -> Any:
    if isinstance(value, dict):
        return check_type(value, _CHOICES, tuple(_CHOICES), "a tool choice")
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, str):
        raise Fault(f"Invalid value: '{value[:64]}'. Supported values are: 'none', 'auto' and 'required'.")
    raise Fault("expected 'none', 'auto', 'required' or a tool choice object.", code="invalid_type")


class _JsonSchemaSpec(Strict):
    name: _Name
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class _JsonSchemaFormat(Strict):
    json_schema: _JsonSchemaSpec


_FORMATS: dict[str, type[BaseModel]] = {"json_schema": _JsonSchemaFormat}


_RESPONSE_FORMAT_SCHEMA = {"type": "object", "required": ["type"], "properties": {
    "type": {"enum": ["text", "json_object", "json_schema"]},
    "json_schema": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": _NAME_PATTERN}, "description": _STRING, "schema": _OBJECT,
        "strict": {"type": "boolean"}}}}}


def _response_format(value: Any) -> Any:
    return check_type(value, _FORMATS, ("text", "json_object", "json_schema"), "a response format")


Unit = Annotated[float, Field(ge=-2, le=2)]


class ChatCompletionRequest(Strict):
    """A ``POST /v1/chat/completions`` body: what OpenAI checks, checked as strictly; other fields pass."""

    model: str = ""  # none: routing applies the key's, tenant's or configured default
    messages: Messages
    stream: bool = False
    stream_options: _StreamOptions | None = None
    tools: list[_Tool] | None = None
    tool_choice: Annotated[Any, AfterValidator(_tool_choice), WithJsonSchema(_TOOL_CHOICE_SCHEMA)] = None
    parallel_tool_calls: bool | None = None
    n: int = Field(1, ge=1, le=16)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    presence_penalty: Unit | None = None
    frequency_penalty: Unit | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: Annotated[str | list[str] | None, WithJsonSchema({"anyOf": [
        _STRING, {"type": "array", "maxItems": 4, "items": _STRING}, {"type": "null"}]})] = None
    seed: int | None = None
    response_format: Annotated[Any, AfterValidator(_response_format),
                               WithJsonSchema({"anyOf": [_RESPONSE_FORMAT_SCHEMA, {"type": "null"}]})] = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    # This gateway's own: answer with the token ids and log-probabilities sampled (backends.token_capture).
    return_token_ids: bool | None = None

    @field_validator("stop")
    @classmethod
    def _stop_limit(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences")
        return value

    @model_validator(mode="after")
    def _choice_names_a_tool(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto"):
            return self
        if not self.tools:
            raise Fault("Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' are "
                        "specified.", ("tool_choice",))
        if isinstance(choice, dict) and choice.get("type") == "function":
            name = choice["function"]["name"]
            if name not in {tool.function.name for tool in self.tools}:
                raise Fault(f"Invalid value for 'tool_choice': no function named '{name[:64]}' is in 'tools'.",
                            ("tool_choice", "function", "name"))
        return self


def validate_chat_request(body: Any) -> ChatCompletionRequest:
    """Check a decoded body against the chat-completions contract; raise a 400 that names the field."""
    parsed: ChatCompletionRequest = validate(ChatCompletionRequest, body)
    return parsed


def carries_output(chunk: dict[str, Any]) -> bool:
    """Whether a chunk holds generated output (content, reasoning, a refusal or a tool call), not only a role, a
    finish or usage: the first such chunk is what time to first token measures."""
    return any(delta.get("content") or delta.get("reasoning_content") or delta.get("refusal") or delta.get("tool_calls")
               for c in chunk.get("choices") or () if isinstance(delta := c.get("delta"), dict))


class ChunkAccumulator:
    """Folds a stream of ``chat.completion.chunk`` dicts into the ``chat.completion`` it describes."""

    def __init__(self) -> None:
        self.id: str | None = None
        self.model: str | None = None
        self.created: int | None = None
        self.usage: dict[str, Any] | None = None
        self._choices: dict[int, dict[str, Any]] = {}
        self.chunks = 0

    def add(self, chunk: dict[str, Any]) -> None:
        self.chunks += 1
        self.id = self.id or chunk.get("id")
        self.model = self.model or chunk.get("model")
        self.created = self.created or chunk.get("created")
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            idx = choice.get("index", 0)
            acc = self._choices.setdefault(
                idx, {"content": [], "reasoning": [], "tool_calls": {}, "finish_reason": None, "role": "assistant"}
            )
            delta = choice.get("delta") or {}
            if delta.get("role"):
                acc["role"] = delta["role"]
            if delta.get("content"):
                acc["content"].append(delta["content"])
            if delta.get("reasoning_content"):
                acc["reasoning"].append(delta["reasoning_content"])
            for call in delta.get("tool_calls") or ():
                slot = acc["tool_calls"].setdefault(
                    call.get("index", 0), {"id": None, "type": "function", "name": [], "arguments": []}
                )
                if call.get("id"):
                    slot["id"] = call["id"]
                fn = call.get("function") or {}
                if fn.get("name"):
                    slot["name"].append(fn["name"])
                if fn.get("arguments"):
                    slot["arguments"].append(fn["arguments"])
            if choice.get("finish_reason"):
                acc["finish_reason"] = choice["finish_reason"]

    def completion(self) -> dict[str, Any]:
        choices = []
        for idx in sorted(self._choices):
            acc = self._choices[idx]
            message: dict[str, Any] = {"role": acc["role"], "content": "".join(acc["content"]) or None}
            if acc["reasoning"]:
                message["reasoning_content"] = "".join(acc["reasoning"])
            if acc["tool_calls"]:
                message["tool_calls"] = [
                    {"id": s["id"], "type": s["type"],
                     "function": {"name": "".join(s["name"]), "arguments": "".join(s["arguments"])}}
                    for _, s in sorted(acc["tool_calls"].items())
                ]
            choices.append({"index": idx, "message": message, "finish_reason": acc["finish_reason"]})
        out: dict[str, Any] = {"id": self.id, "object": "chat.completion", "created": self.created,
                               "model": self.model, "choices": choices}
        if self.usage:
            out["usage"] = self.usage
        return out


def split_tool_calls(chunk: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(the chunk minus its tool-call parts, or None when nothing else is in it; a chunk of only those parts,
    or None when it has none): the parts wait for the guard, the rest streams on."""
    rest, parts = [], []
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if "tool_calls" in delta:
            parts.append({"index": choice.get("index", 0), "delta": {"tool_calls": delta["tool_calls"]},
                          "finish_reason": None})
        others = {k: v for k, v in delta.items() if k != "tool_calls"}
        if others or choice.get("finish_reason"):
            rest.append({**choice, "delta": others})
    calls = {**chunk, "choices": parts} if parts else None
    if not rest and chunk.get("choices"):
        return None, calls
    return {**chunk, "choices": rest}, calls


def tool_call_chunk(template: dict[str, Any], calls: list[dict[str, Any]]) -> dict[str, Any]:
    """One chunk carrying whole tool calls (a guard's retry's), framed like the stream's other chunks."""
    deltas = [{"index": i, "id": c.get("id"), "type": "function", "function": c.get("function")}
              for i, c in enumerate(calls)]
    return {**{k: template[k] for k in ("id", "object", "created", "model") if k in template},
            "choices": [{"index": 0, "delta": {"tool_calls": deltas}, "finish_reason": None}]}


class ChunkRelay:
    """Which chunks of a backend's stream go out as they come and which wait: fed chunk by chunk, no I/O.

    The chunk that finishes the last of ``n`` choices, and any after it, are ``held`` until the exchange is
    recorded. When ``guarded`` (the client's tools on a single choice), tool-call parts are kept in ``call_parts``
    until the guard has checked them; text still streams. Usage chunks go out only to a client that asked."""

    def __init__(self, n: int, *, guarded: bool, include_usage: bool) -> None:
        self.guarded = guarded
        self.include_usage = include_usage
        self.acc = ChunkAccumulator()
        self.held: list[dict[str, Any]] = []
        self.call_parts: list[dict[str, Any]] = []
        self.template: dict[str, Any] = {}  # the first chunk: how a chunk of this stream is framed
        self._unfinished = n

    def feed(self, chunk: dict[str, Any]) -> dict[str, Any] | None:
        """The chunk to send now (maybe less its tool-call parts), or None."""
        if not self.template:
            self.template = chunk
        self.acc.add(chunk)
        choices = chunk.get("choices")
        if not choices and chunk.get("usage") and not self.include_usage:
            return None
        self._unfinished -= sum(1 for c in choices or () if c.get("finish_reason"))
        if self.guarded:
            rest, parts = split_tool_calls(chunk)
            if parts is not None:
                self.call_parts.append(parts)
            if rest is None:
                return None
            chunk = rest
        if self.held or self._unfinished <= 0 or not choices:
            self.held.append(chunk)
            return None
        return chunk

    def release_calls(self, retried_calls: list[dict[str, Any]] | None) -> None:
        """Once the guard has spoken: the parts as the backend sent them, or a retry's calls whole, go first."""
        if retried_calls is None:
            self.held[:0] = self.call_parts
        elif retried_calls:
            self.held.insert(0, tool_call_chunk(self.template, retried_calls))
