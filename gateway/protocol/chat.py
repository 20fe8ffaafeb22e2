"""Chat-completions requests and streams: validation, and assembly of chunks into a completion.

Pure functions over dicts; the API layer does the I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Annotated, Any, Literal

import orjson
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from gateway.errors import APIError

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


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


class _Function(_Open):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: JsonSchema | None = None
    strict: bool | None = None


class _Tool(_Open):
    type: Literal["function"]
    function: _Function


class _Message(_Open):
    role: Role
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class _StreamOptions(_Open):
    include_usage: bool = False


class ChatCompletionRequest(_Open):
    model: str = ""  # none: routing applies the key's, tenant's or configured default
    messages: list[_Message] = Field(min_length=1)
    stream: bool = False
    stream_options: _StreamOptions | None = None
    tools: list[_Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    n: int = Field(1, ge=1, le=16)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    response_format: dict[str, Any] | None = None
    user: str | None = None
    prompt_cache_key: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_limit(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences")
        return value


def validate_chat_request(body: Any) -> ChatCompletionRequest:
    """Check a decoded body against the chat-completions contract; raise a 400 that names the field."""
    if not isinstance(body, dict):
        raise APIError(400, "Request body must be a JSON object.")
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise request_error(err, ".".join(str(p) for p in err["loc"]) or None) from None


def request_error(err: Mapping[str, Any], param: str | None) -> APIError:
    """A request's first validation error as the 400 OpenAI sends, missing and invalid fields told apart."""
    if err["type"] == "missing":
        return APIError(400, f"Missing required parameter: '{param}'.", param=param,
                        code="missing_required_parameter")
    return APIError(400, f"Invalid value for '{param}': {err['msg']}", param=param, code="invalid_value")


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
