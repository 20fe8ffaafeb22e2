"""``POST /v1/agent/runs`` bodies checked as strictly as chat requests (``protocol/chat.py``). Pure."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, Field, TypeAdapter, WithJsonSchema

from gateway.protocol.chat import MESSAGE_SCHEMA, Messages
from gateway.protocol.strict import Fault, Strict, validate

_messages: TypeAdapter[Any] = TypeAdapter(Messages)


def _task(value: Any) -> Any:
    if isinstance(value, str):
        if not value.strip():
            raise Fault("expected a task: the string is empty.")
        return [{"role": "user", "content": value}]
    if isinstance(value, list):
        _messages.validate_python(value)
        return value
    raise Fault("expected a string or an array of chat messages.", code="invalid_type")


def _limit(value: Any) -> Any:
    # a number as sent: an integer limit stays an integer
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Fault("expected a number.", code="invalid_type")
    if value < 0:
        raise Fault("expected a number >= 0.")
    return value


_Limit = Annotated[Any, AfterValidator(_limit), WithJsonSchema({"type": "number", "minimum": 0})]


class AgentRunRequest(Strict):
    """The task (a string, or chat messages), the profile that runs it, and limits tighter than the profile's."""

    profile: Annotated[str, Field(min_length=1)]
    # the task as chat messages, once checked
    input: Annotated[Any, AfterValidator(_task), WithJsonSchema({"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "items": MESSAGE_SCHEMA}]})]
    limits: dict[str, _Limit] | None = None


def validate_agent_run(body: Any) -> AgentRunRequest:
    """Check a decoded ``POST /v1/agent/runs`` body; raise a 400 that names the field."""
    parsed: AgentRunRequest = validate(AgentRunRequest, body)
    return parsed
